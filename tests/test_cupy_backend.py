"""The cupy backend (issue 6): interface, kernel logic against the oracle, and GPU differentials.

Three layers, so that machines without a GPU still test what they can:

* interface (always): availability never raises and explains itself, importing the package
  touches neither cupy nor CUDA, ``not_supported_reasons`` names every refusal, and the Python
  list of template instantiations matches the templates and constants in ``kernels/*.cu``;
* kernel logic on the host (needs g++ and the CUDA headers, not a GPU): the CUDA sources run
  under ``emulation/host_cuda.h`` with the launch plans and argument tuples of the real launches,
  compared with the NumPy oracle (spec A3, A3.2, A6, A7 step 2, INT8 storage);
* GPU differentials (skipped with the reason when the backend is unavailable): the backend
  through the public API against the oracle, for CuPy arrays and torch CUDA tensors.
"""

from __future__ import annotations

import math
from dataclasses import replace

import importlib.util
import re
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

from subspace_ref import SubspaceState, calibrate
from subspace_ref.backend import Backend
from subspace_ref.numpy_backend import attend_reference
from subspace_ref.policies.online_run import relative_residual
from subspace_ref.quantization import quantize_rows
from subspace_ref_cupy import CupyBackend, _emulation, _kernels, _launch

# ----------------------------------------------------------------------------- helpers


def static_state(H=2, d=64, d_v=None, rank_k=20, rank_v=24, T=90, batch=None, seed=0, dtype=np.float32, coefficients="float", **kwargs):
    rng = np.random.default_rng(seed)
    d_v = d if d_v is None else d_v
    K = rng.standard_normal((H, 256, d)).astype(dtype)
    V = rng.standard_normal((H, 256, d_v)).astype(dtype)
    basis = calibrate(K, V, rank_k=rank_k, rank_v=rank_v, gamma="paper")
    state = SubspaceState.static(basis, dtype=dtype, batch=batch, coefficients=coefficients, **kwargs)
    lead = (H,) if batch is None else (batch, H)
    if T:
        state.append(rng.standard_normal((*lead, T, d)).astype(dtype), rng.standard_normal((*lead, T, d_v)).astype(dtype))
    return state


def chunked_state(N=2, H=2, d=64, T=80, max_chunk=24, seed=1, coefficients="float", dtype=np.float32, **kwargs):
    """An adaptive state (spec A7) whose chunks come from the length trigger only (tau close to 1),
    so every head has ceil(T / max_chunk) chunks with different bases."""
    rng = np.random.default_rng(seed)
    state = SubspaceState.adaptive(
        H, d, rank_k=(12, 16), rank_v=(16, 10), tau_k=0.999, tau_v=0.999, max_chunk=max_chunk, batch=N,
        dtype=dtype, coefficients=coefficients, byte_ceiling=math.inf, **kwargs,  # the length rule alone (spec A7.3 would defer)
    )
    state.append(rng.standard_normal((N, H, T, d)).astype(dtype), rng.standard_normal((N, H, T, d)).astype(dtype))
    return state


def rounded_layout(state, dtype: str):
    """A copy of ``state`` whose float arrays hold what ``dtype`` storage holds (as float32), so the
    oracle sees the same inputs as the kernels and only the arithmetic differs."""
    def cut(name, x):
        if name in ("chunk_starts", "num_chunks"):
            return x
        x = np.asarray(x, dtype=np.float32)
        if dtype == "bfloat16":
            return _emulation.bf16_float(_emulation.bf16_bits(x))
        return x.astype(dtype).astype(np.float32)

    out = state.copy()
    out.layout = out.layout.map_arrays(cut)
    return out


def host_q(q: np.ndarray, dtype: str) -> np.ndarray:
    return _emulation.bf16_bits(q) if dtype == "bfloat16" else np.ascontiguousarray(q, dtype=dtype)


def from_host(x: np.ndarray, dtype: str) -> np.ndarray:
    return _emulation.bf16_float(x) if dtype == "bfloat16" else x.astype(np.float32)


class _FakeDevice:
    def __init__(self, index: int) -> None:
        self.id = index


class FakeCupyArray:
    """Looks like a cupy array to the backend's checks (module name, dtype, shape, device), so
    not_supported_reasons can be exercised without a GPU."""

    def __init__(self, a, device: int = 0) -> None:
        self._a = np.asarray(a)
        self.device = _FakeDevice(device)

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)


FakeCupyArray.__module__ = "cupy._core.core"


def fake_gpu_state(state, **overrides):
    out = state.copy()
    out.layout = out.layout.map_arrays(lambda name, x: overrides.get(name, FakeCupyArray(x)))
    if out.window is not None:
        fields = ("keys", "values", "sink_keys", "sink_values")
        out.window = replace(out.window, **{f: overrides.get(f, FakeCupyArray(getattr(out.window, f))) for f in fields if getattr(out.window, f) is not None})
    return out


def reasons_besides_availability(q, state) -> list[str]:
    return [r for r in CupyBackend().not_supported_reasons(q, state) if "unavailable" not in r]


# ----------------------------------------------------------------------------- interface


def test_is_a_backend_and_registered():
    from subspace_ref.registry import get_backend

    backend = get_backend("cupy")
    assert isinstance(backend, CupyBackend)
    assert isinstance(backend, Backend)
    assert (backend.name, backend.array_family) == ("cupy", "cupy")
    # CuPy holds bfloat16 arrays only with ml_dtypes installed
    bf16 = {"bfloat16"} if importlib.util.find_spec("ml_dtypes") else set()
    assert set(backend.dtypes) == {"float32", "float16"} | bf16


def test_availability_explains_itself_and_never_raises():
    a = CupyBackend().availability()
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except ImportError:
        assert not a and "cupy" in a.reason
    except Exception:
        assert not a and "device" in a.reason and "GPU" in a.reason
    else:
        assert bool(a) == (count > 0) or "NVRTC" in a.reason
    if not a:
        print(f"cupy backend unavailable here: {a.reason}")


def test_availability_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    a = CupyBackend().availability()
    assert not a and "cupy" in a.reason


@pytest.mark.parametrize("outcome", ["raises", "zero"])
def test_availability_without_a_device(monkeypatch, outcome):
    def count():
        if outcome == "raises":
            raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
        return 0

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=count)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    a = CupyBackend().availability()
    assert not a
    assert "device" in a.reason and "GPU" in a.reason


def test_import_touches_neither_cupy_nor_torch_nor_cuda():
    # a fresh interpreter: this one may have imported cupy already
    code = textwrap.dedent(
        """
        import sys
        import subspace_ref_cupy
        from subspace_ref_cupy import _emulation, _interop, _kernels, _launch
        subspace_ref_cupy.CupyBackend()
        _kernels.name_expressions()
        print(sorted(m for m in ("cupy", "torch") if m in sys.modules))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_not_supported_reasons_for_host_arrays():
    state = static_state(T=8)
    q = np.zeros((1, 4, 64), dtype=np.float32)
    reasons = CupyBackend().not_supported_reasons(q, state)
    assert any(r.startswith("q is a NumPy") for r in reasons)
    assert any("state.to('cupy')" in r for r in reasons)
    if not CupyBackend().availability():
        assert any("unavailable" in r for r in reasons)


def test_not_supported_reasons_accepts_a_supported_call():
    state = fake_gpu_state(static_state(T=8))
    q = FakeCupyArray(np.zeros((1, 4, 64), dtype=np.float32))
    assert reasons_besides_availability(q, state) == []


@pytest.mark.parametrize(
    "case, expected",
    [
        ("float64", "float64"),
        ("q_dtype", "expected the same dtype"),
        ("rank", "no compiled kernel for head sizes (d, d_v) = (64, 64) with ranks (r, r_v) = (300, 8)"),
        ("int8_no_scales", "need their float32 scales"),
        ("index_dtype", "expected int64"),
        ("two_devices", "different CUDA devices"),
        ("torch_cpu", "expected a CUDA tensor"),
    ],
)
def test_not_supported_reasons_names_each_refusal(case, expected):
    d = 64
    base = static_state(d=d, rank_k=8, rank_v=8, T=8, dtype=np.float64 if case == "float64" else np.float32)
    q = FakeCupyArray(np.zeros((1, 4, d), dtype=base.dtype))
    overrides = {}
    if case == "q_dtype":
        q = FakeCupyArray(np.zeros((1, 4, d), dtype=np.float16))
    elif case == "rank":  # r <= d for real bases; the shape alone drives the check
        overrides["key_coef"] = FakeCupyArray(np.zeros((1, 2, 8, 300), dtype=np.float32))
    elif case == "int8_no_scales":
        overrides["key_coef"] = FakeCupyArray(np.zeros(base.layout.key_coef.shape, dtype=np.int8))
    elif case == "index_dtype":
        overrides["chunk_starts"] = FakeCupyArray(base.layout.chunk_starts.astype(np.int32))
    elif case == "two_devices":
        q = FakeCupyArray(np.zeros((1, 4, d), dtype=np.float32), device=1)
    elif case == "torch_cpu":
        torch = pytest.importorskip("torch")
        q = torch.zeros((1, 4, d))
    reasons = reasons_besides_availability(q, fake_gpu_state(base, **overrides))
    assert any(expected in r for r in reasons), reasons


def test_half_precision_online_append_runs_the_oracle_in_float32():
    """Adaptive appends of a 16-bit state (spec A7): the oracle's loop on float32 copies (SVDs need
    float32), rounded back; host arrays stand in for CuPy ones, the code is array-generic."""
    from subspace_ref_cupy.cupy_backend import _append_widened

    rng = np.random.default_rng(17)
    k = rng.standard_normal((1, 2, 30, 16)).astype(np.float16)
    v = rng.standard_normal((1, 2, 30, 16)).astype(np.float16)
    oracle = SubspaceState.adaptive(2, 16, rank_k=4, rank_v=4, max_chunk=8, batch=1, dtype=np.float32)
    half = oracle.copy()
    half.layout = half.layout.map_arrays(lambda name, x: x.astype(np.float16) if x.dtype.kind == "f" else x)
    oracle.append(k.astype(np.float32), v.astype(np.float32))
    _append_widened(half, k, v)
    assert half.layout.key_coef.dtype == np.float16 and half.sketches.keys.dtype == np.float16
    np.testing.assert_array_equal(half.layout.num_chunks, oracle.layout.num_chunks)
    T = oracle.num_tokens
    np.testing.assert_allclose(half.layout.key_coef[:, :, :T], oracle.layout.key_coef[:, :, :T], atol=2e-2)


# ----------------------------------------------------------------------------- sources


def test_name_expressions_match_the_templates_in_the_sources():
    known_types = {*_kernels.CUDA_TYPES.values(), _kernels.INT8_TYPE, *_kernels.LOW_BIT_TYPES.values()}
    for filename, names in _kernels.name_expressions().items():
        declared = _kernels.declared_templates(filename)
        used = set()
        for expr in names:
            kernel, args = _kernels.split_name_expression(expr)
            assert kernel in declared, f"{expr}: no template {kernel} in {filename}"
            assert len(args) == declared[kernel], f"{expr}: {kernel} takes {declared[kernel]} template arguments"
            for a in args:
                assert a in known_types or a.isdigit(), expr
            used.add(kernel)
        assert used == set(declared), f"templates in {filename} that Python never launches: {set(declared) - used}"
        assert len(set(names)) == len(names)


def _constants() -> dict[str, int]:
    """The ``constexpr int`` constants of the kernel sources, evaluated."""
    text = "\n".join(p.read_text() for p in sorted(_kernels.KERNEL_DIR.glob("*.cu*")))
    values: dict[str, int] = {}
    for name, expr in re.findall(r"constexpr int (\w+) = ([^;]+);", text):
        # arithmetic on literals and earlier constants only; template-dependent ones are skipped
        if not re.fullmatch(r"[\w\s+\-*/()]+", expr):
            continue
        try:
            values[name] = int(eval(expr.replace("/", "//"), {"__builtins__": {}}, dict(values)))
        except NameError:
            continue
    return values


def test_launch_constants_match_the_sources():
    c = _constants()
    assert c["kDecodeThreads"] == _kernels.DECODE_THREADS
    assert c["kDecodeMinBlocks"] == _kernels.DECODE_MIN_BLOCKS
    assert c["kTokenTile"] == _kernels.TOKEN_TILE
    assert c["kTokenTileSmall"] == _kernels.TOKEN_TILE_SMALL
    assert c["kStageBudgetBytes"] == _kernels.STAGE_BUDGET_BYTES
    assert c["kRowPadBytes"] == _kernels.ROW_PAD_BYTES
    assert c["kMergeThreads"] == _kernels.MERGE_THREADS
    assert c["kProjectThreads"] == _kernels.PROJECT_THREADS
    assert _kernels.PROJECT_WARPS == c["kProjectWarps"]


def test_source_text_pastes_headers_once():
    text = _kernels.source_text(_kernels.DECODE_SOURCE)
    assert '#include "' not in text
    assert text.count("struct CoefReader {") == 1


def test_choose_splits_covers_the_tokens():
    for blocks, T in [(1, 1), (2, 31), (8, 1000), (64, 100_000), (4096, 5000)]:
        S, length = _launch.choose_splits(blocks, T, sm_count=132)
        assert length % _kernels.TOKEN_TILE == 0
        assert S * length >= T > (S - 1) * length  # no empty split
        assert S <= _launch.MAX_SPLITS


# ----------------------------------------------------------------------------- kernel logic on the host

EMULATION, EMULATION_REASON = _emulation.availability()
needs_emulation = pytest.mark.skipif(not EMULATION, reason=f"host emulation of the kernels unavailable: {EMULATION_REASON}")

_EMU_CONFIGS = [
    # rank tile 32: what ranks <= 32 launch (the tests' small ranks)
    _kernels.KernelConfig("float32", "same", 64, 64, 32),
    _kernels.KernelConfig("float32", "int8", 64, 64, 32),
    _kernels.KernelConfig("float16", "same", 64, 64, 32),
    _kernels.KernelConfig("bfloat16", "same", 64, 64, 32),
    _kernels.KernelConfig("float32", "same", _kernels.GENERIC, _kernels.GENERIC, 32),
    _kernels.KernelConfig("float32", "int8", _kernels.GENERIC, _kernels.GENERIC, 32),
    # rank tile 64 and 128: ranks above 32
    _kernels.KernelConfig("float32", "same", 64, 64, 64),
    _kernels.KernelConfig("float32", "int8", 64, 64, 64),
    _kernels.KernelConfig("float16", "same", 64, 64, 64),
    _kernels.KernelConfig("bfloat16", "same", 64, 64, 64),
    _kernels.KernelConfig("float32", "same", 128, 128, 128),
    _kernels.KernelConfig("float32", "same", _kernels.GENERIC, _kernels.GENERIC, 64),
    _kernels.KernelConfig("float32", "int8", _kernels.GENERIC, _kernels.GENERIC, 64),
    # int4/int2 (spec/quantization.md Q2)
    _kernels.KernelConfig("float32", "int4", 64, 64, 32),
    _kernels.KernelConfig("float32", "int2", 64, 64, 32),
    _kernels.KernelConfig("bfloat16", "int4", 64, 64, 32),
    _kernels.KernelConfig("float32", "int4", 64, 64, 64),
    _kernels.KernelConfig("float32", "int2", _kernels.GENERIC, _kernels.GENERIC, 32),
    _kernels.KernelConfig("float32", "int4", _kernels.GENERIC, _kernels.GENERIC, 32),
]


# pre-RoPE states (spec/rope.md P3): float, int8, int4 and int2 coefficients, rank tiles 32 and 64
_EMU_ROPE = [
    _kernels.RopeConfig("float32", "same", 32),
    _kernels.RopeConfig("float32", "int8", 32),
    _kernels.RopeConfig("bfloat16", "same", 32),
    _kernels.RopeConfig("float32", "same", 64),
    _kernels.RopeConfig("float32", "int4", 32),
    _kernels.RopeConfig("float32", "int2", 32),
    _kernels.RopeConfig("bfloat16", "int4", 32),
    _kernels.RopeConfig("float32", "int4", 64),
]


@pytest.fixture(scope="module")
def emu_lib():
    """One host build holding every kernel these tests launch (one compile, ~10 s)."""
    names = [c.decode_name for c in _EMU_CONFIGS] + [_kernels.merge_name(t) for t in ("float32", "float16", "bfloat16")]
    names += [c.name for c in _EMU_ROPE] + [_kernels.exact_name(t) for t in ("float32", "float16", "bfloat16")]
    names += [c.project_name for c in _EMU_CONFIGS if c.dtype == "float32" and c.d in (64, _kernels.GENERIC) and c.coef in _kernels.COEF_KINDS]
    return _emulation.library(names)


@needs_emulation
@pytest.mark.parametrize("splits", [None, (5, 32)], ids=["auto", "empty-splits"])
def test_emulated_attention_static(emu_lib, splits):
    """Spec A2/A3 with one chunk, GQA group 2; (5, 32) covers 160 slots for 90 tokens, so the
    last two splits are empty and must merge as the identity (spec A3.2)."""
    state = static_state(T=90)
    q = np.random.default_rng(2).standard_normal((1, 4, 64)).astype(np.float32)
    ref = attend_reference(q, state, None)
    out = _emulation.attend(q, "float32", _emulation.host_arrays(state.layout, "float32"), 1 / 8, splits=splits, lib=emu_lib)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


@needs_emulation
def test_emulated_attention_across_chunks_and_splits(emu_lib):
    """Spec A3 over chunks with different bases (24-token chunks, 32-token splits: splits start
    inside chunks and span chunk boundaries), batch of 2, MHA (group 1), per-head ranks."""
    state = chunked_state()
    assert (state.num_chunks == 4).all()
    q = np.random.default_rng(3).standard_normal((2, 2, 64)).astype(np.float32)
    ref = attend_reference(q, state, 0.3)
    out = _emulation.attend(q, "float32", _emulation.host_arrays(state.layout, "float32"), 0.3, splits=(3, 32), lib=emu_lib)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


@needs_emulation
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_emulated_attention_half_precision(emu_lib, dtype):
    """16-bit storage, float32 accumulation: equal to the oracle on the rounded inputs up to the
    rounding of the output."""
    state = static_state(T=70, seed=4)
    q = np.random.default_rng(5).standard_normal((1, 4, 64)).astype(np.float32)
    qh = host_q(q, dtype)
    ref = attend_reference(from_host(qh, dtype), rounded_layout(state, dtype), None)
    out = from_host(_emulation.attend(qh, dtype, _emulation.host_arrays(state.layout, dtype), 1 / 8, splits=(2, 64), lib=emu_lib), dtype)
    eps = {"float16": 2**-11, "bfloat16": 2**-8}[dtype]
    np.testing.assert_allclose(out, ref, rtol=2 * eps, atol=2 * eps * np.abs(ref).max())


@needs_emulation
def test_emulated_attention_int8(emu_lib):
    """INT8 coefficients (spec A10) dequantised in the kernel: the oracle's own int8 state, read
    by both, so only the order of the float32 arithmetic differs."""
    state = chunked_state(N=1, T=60, seed=6, coefficients="int8")
    assert state.layout.key_coef.dtype == np.int8
    q = np.random.default_rng(7).standard_normal((1, 4, 64)).astype(np.float32)
    ref = attend_reference(q, state, None)
    out = _emulation.attend(q, "float32", _emulation.host_arrays(state.layout, "float32"), 1 / 8, splits=(2, 32), lib=emu_lib)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def _check_low_bit(lib, state64, q64: np.ndarray, scale, dtype: str, splits) -> None:
    """The kernel in ``dtype`` over a float64 low-bit state against the float64 oracle, within the
    differential harness's tolerance: the oracle's own error when run in ``dtype``
    (tests/differential/tolerance.py)."""
    from tests.differential.tolerance import reference_error, tolerance

    out64 = attend_reference(q64, state64, scale)
    arrays = _emulation.host_arrays(state64.layout, dtype)
    s = 1 / np.sqrt(q64.shape[-1]) if scale is None else scale
    out = from_host(_emulation.attend(host_q(q64.astype(np.float32), dtype), dtype, arrays, s, splits=splits, lib=lib), dtype)
    err = float(np.abs(out.astype(np.float64) - out64).max())
    tol = tolerance(reference_error(state64, q64, scale, out64, dtype), out64, dtype)
    assert err <= tol, f"max |kernel - oracle64| = {err:.3g} > tol {tol:.3g}"
    # the codes matter: reading every key as its group's zero point moves the output past twice tol
    flat = state64.copy()
    flat.layout = replace(flat.layout, key_coef=np.zeros_like(flat.layout.key_coef))
    assert np.abs(attend_reference(q64, flat, scale) - out64).max() > 2 * tol


@needs_emulation
@pytest.mark.parametrize("fmt, dtype", [("int4", "float32"), ("int2", "float32"), ("int4", "bfloat16")])
def test_emulated_attention_low_bit_static(emu_lib, fmt, dtype):
    """int4/int2 codes dequantised in the kernel (spec/quantization.md Q2): keys per channel over
    groups of 8 tokens, 75 tokens so the last 3 are the float tail; values per token. Odd key rank
    (a half-filled last byte), GQA group 2, 32-token splits crossing key groups and the tail."""
    state = static_state(rank_k=19, rank_v=24, T=75, seed=21, dtype=np.float64, coefficients=fmt, group_size=8)
    assert state.layout.low_bits == int(fmt[3]) and state.layout.num_tokens % 8 == 3
    q = np.random.default_rng(22).standard_normal((1, 4, 64))
    _check_low_bit(emu_lib, state, q, None, dtype, (3, 32))


@needs_emulation
@pytest.mark.parametrize("fmt", ["int4", "int2"])
def test_emulated_attention_low_bit_chunks(emu_lib, fmt):
    """Low-bit codes over chunks with different bases (adaptive, spec A7), batch 2, per-head ranks;
    16-token key groups straddle the 24-token chunks and the splits."""
    state = chunked_state(T=70, seed=23, coefficients=fmt, dtype=np.float64, group_size=16)
    assert (state.num_chunks == 3).all() and state.layout.low_bits
    q = np.random.default_rng(24).standard_normal((2, 2, 64))
    _check_low_bit(emu_lib, state, q, 0.3, "float32", (3, 32))


@needs_emulation
def test_emulated_attention_low_bit_rank_tile_64_and_run_time_d(emu_lib):
    """int4 at rank tile 64 (ranks 40, 36) and int2 with run-time head sizes (d = 16, d_v = 12)."""
    state = static_state(rank_k=40, rank_v=36, T=50, seed=25, dtype=np.float64, coefficients="int4", group_size=32)
    _check_low_bit(emu_lib, state, np.random.default_rng(26).standard_normal((1, 2, 64)), None, "float32", None)
    state = static_state(d=16, d_v=12, rank_k=3, rank_v=5, T=50, batch=2, seed=27, dtype=np.float64, coefficients="int2", group_size=4)
    _check_low_bit(emu_lib, state, np.random.default_rng(28).standard_normal((2, 8, 16)), 0.7, "float32", (2, 32))


@pytest.mark.parametrize("fmt", ["int4", "int2"])
def test_low_bit_attention_is_accepted_and_append_refused(fmt):
    """The capability declares int4/int2 (the decode kernel reads them); appends to them are
    refused with the format named, before the state changes."""
    state = static_state(rank_k=8, rank_v=8, T=10, coefficients=fmt, group_size=4)
    q = FakeCupyArray(np.zeros((1, 4, 64), dtype=np.float32))
    assert fmt in CupyBackend().capabilities.coefficient_formats
    assert reasons_besides_availability(q, fake_gpu_state(state)) == []
    before = state.layout.num_tokens
    with pytest.raises(NotImplementedError, match=f"{fmt} coefficients"):
        CupyBackend().append(state, np.zeros((2, 1, 64), np.float32), np.zeros((2, 1, 64), np.float32))
    assert state.layout.num_tokens == before


@needs_emulation
def test_emulated_attention_run_time_head_sizes(emu_lib):
    """Head sizes without their own instantiation (d = 16, d_v = 12, as in the differential
    harness) run the GENERIC one; GQA group 4, tiny ranks in a 64-wide rank tile."""
    state = static_state(d=16, d_v=12, rank_k=3, rank_v=5, T=50, batch=2, seed=12)
    q = np.random.default_rng(13).standard_normal((2, 8, 16)).astype(np.float32)
    ref = attend_reference(q, state, 0.7)
    out = _emulation.attend(q, "float32", _emulation.host_arrays(state.layout, "float32"), 0.7, splits=(2, 32), lib=emu_lib)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


@needs_emulation
def test_emulated_attention_head_size_128(emu_lib):
    """d = 128 with ranks above 64 (rank tile 128): four columns per lane in the query projection."""
    state = static_state(d=128, rank_k=100, rank_v=72, T=40, seed=8)
    q = np.random.default_rng(9).standard_normal((1, 2, 128)).astype(np.float32)
    ref = attend_reference(q, state, None)
    out = _emulation.attend(q, "float32", _emulation.host_arrays(state.layout, "float32"), 128**-0.5, lib=emu_lib)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


@needs_emulation
@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("d, d_v", [(64, 64), (16, 12)], ids=["fixed-d", "run-time-d"])
def test_emulated_projection(emu_lib, int8, d, d_v):
    """Spec A6 step 1 for a batch of heads in one launch, written at an offset, with the residuals
    of spec A7 step 2 (0 for a zero key); INT8 codes and scales as spec A10 defines them."""
    # ranks below d: with r = d the residual is pure float32 cancellation noise (~sqrt(eps))
    state = static_state(d=d, d_v=d_v, rank_k=min(20, d - 4), rank_v=min(24, d_v - 4), T=5, batch=2, seed=10)
    rng = np.random.default_rng(11)
    keys = rng.standard_normal((2, 2, 7, d)).astype(np.float32)
    values = rng.standard_normal((2, 2, 7, d_v)).astype(np.float32)
    keys[1, 0, 3] = 0.0
    lay = state.layout.with_capacity(12, 1)
    r, r_v = lay.key_coef.shape[3], lay.value_coef.shape[3]
    coef_dtype = np.int8 if int8 else np.float32
    key_coef = np.full((2, 2, 12, r), 7, dtype=coef_dtype)  # rows outside 5..11 must stay untouched
    value_coef = np.full((2, 2, 12, r_v), 7, dtype=coef_dtype)
    scales = (np.zeros((2, 2, 12), np.float32), np.zeros((2, 2, 12), np.float32)) if int8 else (None, None)
    rho_k, rho_v = _emulation.project(
        "float32", keys, values, np.ascontiguousarray(lay.key_bases), np.ascontiguousarray(lay.value_bases),
        np.ascontiguousarray(lay.num_chunks), key_coef, value_coef, 5, *scales, lib=emu_lib,
    )
    c = np.einsum("nhtd,nhrd->nhtr", keys, lay.key_bases[:, :, 0])
    dv = np.einsum("nhtd,nhrd->nhtr", values, lay.value_bases[:, :, 0])
    assert (key_coef[:, :, :5] == 7).all() and (value_coef[:, :, :5] == 7).all()
    if int8:
        for got, got_scale, want in ((key_coef, scales[0], c), (value_coef, scales[1], dv)):
            codes, scale = quantize_rows(want)
            # a code may differ by one where c / s lies within rounding of a half-integer
            assert np.abs(got[:, :, 5:].astype(int) - codes).max() <= 1
            assert (got[:, :, 5:] != codes).mean() < 0.01
            np.testing.assert_allclose(got_scale[:, :, 5:], scale, rtol=1e-5)
        assert (key_coef[1, 0, 8] == 0).all() and scales[0][1, 0, 8] == 0
    else:
        np.testing.assert_allclose(key_coef[:, :, 5:], c, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(value_coef[:, :, 5:], dv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rho_k, relative_residual(keys, c), atol=1e-5)
    np.testing.assert_allclose(rho_v, relative_residual(values, dv), atol=1e-5)
    assert rho_k[1, 0, 3] == 0.0


def _harness_cases(slow: bool):
    try:
        from tests.differential.cases import CASES
    except ImportError:  # the harness is not importable from this rootdir
        return []
    fast = {"static-T1", "static-head_ranks", "adaptive-T_5L+1-N2", "rotating-N2-gqa4-logits1e4"}
    return [c for c in CASES if (c.name not in fast) == slow]


def _check_harness_case(lib, case) -> None:
    """A differential-harness case (tests/differential/cases.py) through the emulated kernels in
    float32, judged by the harness's own tolerance rule."""
    from tests.differential.cases import build
    from tests.differential.harness import declared_gaps
    from tests.differential.tolerance import reference_error, tolerance

    gaps = declared_gaps("cupy", "attend", case.features, case)
    if gaps:  # the kernel does not read these arrays: the cupy backend refuses such states
        pytest.skip(f"{case}: the cupy backend declares no {', '.join(sorted(gaps))} (its capabilities)")
    b = build(case)
    scale = 1 / np.sqrt(case.d) if b.scale is None else b.scale
    # the state's arrays beyond the layout: a pre-RoPE rotation, the sinks and the recent window
    arrays = _emulation.host_state_arrays(b.state, "float32")
    names = _launch.plan_attend("float32", b.q.shape, arrays, 4, None).kernel_names()
    if not set(names) <= set(lib.names):  # e.g. a format per side (issue 37): a build of what the case launches
        lib = _emulation.library(names)
    out = _emulation.attend(b.q.astype(np.float32), "float32", arrays, scale, lib=lib)
    err = float(np.abs(out.astype(np.float64) - b.out64).max())
    tol = tolerance(reference_error(b.state, b.q, b.scale, b.out64, "float32"), b.out64, "float32")
    assert err <= tol, f"{case}: max |kernel - oracle64| = {err:.3g} > tol {tol:.3g}"


@needs_emulation
@pytest.mark.parametrize("case", _harness_cases(slow=False), ids=str)
def test_emulated_attention_harness_cases(emu_lib, case):
    _check_harness_case(emu_lib, case)


def _exact_and_rope_cases():
    return [c for c in _harness_cases(slow=True) if {"window", "sinks", "rope"} & set(c.features)]


@needs_emulation
@pytest.mark.parametrize("case", _exact_and_rope_cases(), ids=str)
def test_emulated_attention_harness_window_sinks_rope(emu_lib, case):
    """The harness's window, sink and pre-RoPE cases (issue 16; small, so not only under -m slow):
    exact-only states (T < min_tokens), sinks beside a window, per-head ranks, GQA 4, logits 1e4,
    adaptive chunks with sinks, partial rotary with attention scaling."""
    _check_harness_case(emu_lib, case)


@pytest.mark.slow
@needs_emulation
@pytest.mark.parametrize("case", _harness_cases(slow=True), ids=str)
def test_emulated_attention_harness_cases_slow(emu_lib, case):
    """The rest of the harness's cases (hundreds of chunks, T = 4000, huge logits): minutes on
    the host, so on purpose only (-m slow)."""
    _check_harness_case(emu_lib, case)


def _rope(d: int, layout: str = "half", scaling: float = 1.1, rotary: float = 0.75):
    from subspace_ref.rope import RopeParams

    m = int(rotary * d) // 2
    return RopeParams(1.0 / 10000.0 ** (np.arange(m) / m), layout=layout, attention_scaling=scaling)


def _check_state(lib, state64, q64: np.ndarray, scale, dtype: str, splits, arrays=None) -> float:
    """The emulated kernels in ``dtype`` over a float64 state against the float64 oracle, within
    the differential harness's tolerance; returns the tolerance."""
    from tests.differential.tolerance import reference_error, tolerance

    out64 = attend_reference(q64, state64, scale)
    arrays = _emulation.host_state_arrays(state64, dtype) if arrays is None else arrays
    s = 1 / np.sqrt(q64.shape[-1]) if scale is None else scale
    out = from_host(_emulation.attend(host_q(q64.astype(np.float32), dtype), dtype, arrays, s, splits=splits, lib=lib), dtype)
    err = float(np.abs(out.astype(np.float64) - out64).max())
    tol = tolerance(reference_error(state64, q64, scale, out64, dtype), out64, dtype)
    assert err <= tol, f"max |kernel - oracle64| = {err:.3g} > tol {tol:.3g}"
    return tol


@needs_emulation
@pytest.mark.parametrize(
    "layout, coefficients, dtype, rank_k, splits",
    [("half", "float", "float32", 20, (2, 64)), ("interleaved", "float", "float32", 20, (5, 32)), ("half", "int8", "float32", 20, None),
     ("half", "float", "bfloat16", 20, (3, 32)), ("half", "float", "float32", 40, (2, 64))],
    ids=["half-two-stages", "interleaved-empty-splits", "int8", "bf16", "rank-tile-64-one-stage"],
)
def test_emulated_rope_static(emu_lib, layout, coefficients, dtype, rank_k, splits):
    """Spec/rope.md P3: keys rebuilt from the coefficients, rotated to positions 0..T-1 (partial
    rotary, attention scaling 1.1, both plane layouts), GQA group 2; 90 tokens in splits of two
    32-token tiles (double-buffered at rank tile 32, one buffer at float32 rank tile 64, a short
    last tile), in 5 splits of 32 (two empty: the merge identity), or the automatic split. The
    rotation matters: attending over the same coefficients as a plain static state (no rotation)
    is outside twice the tolerance."""
    rng = np.random.default_rng(31)
    d = 64
    K = rng.standard_normal((2, 256, d))
    basis = calibrate(K, rng.standard_normal((2, 256, d)), rank_k=rank_k, rank_v=24, gamma="paper")
    state = SubspaceState.static(basis, dtype=np.float64, rope=_rope(d, layout), coefficients=coefficients)
    state.append(rng.standard_normal((2, 90, d)), rng.standard_normal((2, 90, d)))
    q = rng.standard_normal((1, 4, d))
    tol = _check_state(emu_lib, state, q, None, dtype, splits)
    flat = state.copy()
    flat.policy = replace(flat.policy, rope=None)
    assert np.abs(attend_reference(q, flat, None) - attend_reference(q, state, None)).max() > 2 * tol


@needs_emulation
@pytest.mark.parametrize(
    "fmt, dtype, rank_k, splits",
    [("int4", "float32", 19, (3, 32)), ("int2", "float32", 19, (3, 32)), ("int4", "bfloat16", 19, (2, 64)), ("int4", "float32", 40, None)],
    ids=["int4", "int2", "int4-bf16", "int4-rank-tile-64"],
)
def test_emulated_rope_low_bit(emu_lib, fmt, dtype, rank_k, splits):
    """Spec/rope.md P3 over int4/int2 codes (spec/quantization.md Q2): the keys dequantised per
    tile (per channel over groups of 8 tokens, the last 3 of 75 tokens the float tail) before the
    rebuild and rotation, the values per token in the weighted sum. Odd key rank (a half-filled
    last byte), GQA group 2, splits of 32 tokens crossing key groups and the tail, splits of two
    tiles, and the automatic split at rank tile 64. The codes matter (all keys read as their
    group's zero point moves the output past twice the tolerance), and so does the rotation."""
    rng = np.random.default_rng(35)
    d = 64
    basis = calibrate(rng.standard_normal((2, 256, d)), rng.standard_normal((2, 256, d)), rank_k=rank_k, rank_v=24, gamma="paper")
    state = SubspaceState.static(basis, dtype=np.float64, rope=_rope(d), coefficients=fmt, group_size=8)
    state.append(rng.standard_normal((2, 75, d)), rng.standard_normal((2, 75, d)))
    assert state.layout.low_bits == int(fmt[3]) and state.layout.num_tokens == 75
    q = rng.standard_normal((1, 4, d))
    tol = _check_state(emu_lib, state, q, None, dtype, splits)
    out64 = attend_reference(q, state, None)
    flat = state.copy()
    flat.layout = replace(flat.layout, key_coef=np.zeros_like(flat.layout.key_coef))
    assert np.abs(attend_reference(q, flat, None) - out64).max() > 2 * tol
    unrotated = state.copy()
    unrotated.policy = replace(unrotated.policy, rope=None)
    assert np.abs(attend_reference(q, unrotated, None) - out64).max() > 2 * tol


@needs_emulation
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_emulated_rope_with_sinks_and_window_is_exact_on_the_span(emu_lib, dtype):
    """Spec/window.md W10.1 through the kernels: pre-RoPE keys of rank 4 in the span of B, 3
    sinks and a 5-token window: the result is exact attention over the keys given (the oracle's
    and subspace_ref.exact's), and rotating from position 0 instead of S = 3 (W10's offset
    removed) moves it past twice the tolerance."""
    import subspace_ref as sr
    from subspace_ref.rope import rotate

    rng = np.random.default_rng(41)
    H, d, T = 2, 32, 70
    rope = _rope(d)
    basis_rows = np.linalg.qr(rng.standard_normal((H, d, 4)))[0].transpose(0, 2, 1)  # (H, 4, d)
    pre = np.einsum("htr,hrd->htd", rng.standard_normal((H, T, 4)), basis_rows)
    K = rotate(pre, np.arange(T), rope)  # post-RoPE at positions 0..T-1, as a model gives them
    V = rng.standard_normal((H, T, d))
    E = np.linalg.qr(rng.standard_normal((H, d, d)))[0].transpose(0, 2, 1)
    state = SubspaceState.static(sr.StaticBasis.from_bases(basis_rows, E, np.ones(H)), dtype=np.float64, rope=rope, sinks=3, window=5)
    state.append(K[:, :40], V[:, :40])
    state.append(K[:, 40:], V[:, 40:])
    assert state.layout.num_tokens == T - 8
    q = rng.standard_normal((1, 4, d))
    tol = _check_state(emu_lib, state, q[0][None], None, dtype, (2, 64))
    np.testing.assert_allclose(attend_reference(q, state, None)[0], sr.exact_attention(q[0], K, V), atol=1e-9)
    wrong = replace(_emulation.host_state_arrays(state, dtype), rope_first_position=0)
    out = from_host(_emulation.attend(host_q(q.astype(np.float32), dtype), dtype, wrong, d**-0.5, splits=(2, 64), lib=emu_lib), dtype)
    assert np.abs(out - attend_reference(q, state, None)).max() > 2 * tol


@needs_emulation
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_emulated_sinks_and_window(emu_lib, dtype):
    """Spec/window.md W3, W8: the exact tokens (4 sinks, a 6-token window) join the compressed
    tokens' softmax as partials merged with the splits; adaptive chunks (spec A7), batch 2, GQA 2.
    Dropping the exact segments moves the result past twice the tolerance."""
    rng = np.random.default_rng(51)
    state = SubspaceState.adaptive(2, 64, rank_k=6, rank_v=8, max_chunk=16, batch=2, dtype=np.float64, sinks=4, window=6, byte_ceiling=math.inf)
    state.append(rng.standard_normal((2, 2, 75, 64)), rng.standard_normal((2, 2, 75, 64)))
    assert state.window.sink_count == 4 and state.window.keys.shape[2] == 6 and (state.layout.num_chunks > 1).all()
    q = rng.standard_normal((2, 4, 64)) * 2
    tol = _check_state(emu_lib, state, q, None, dtype, (3, 32))
    no_exact = replace(_emulation.host_state_arrays(state, dtype), exact=())
    out = from_host(_emulation.attend(host_q(q.astype(np.float32), dtype), dtype, no_exact, 1 / 8, splits=(3, 32), lib=emu_lib), dtype)
    assert np.abs(out - attend_reference(q, state, None)).max() > 2 * tol


@needs_emulation
def test_emulated_long_sinks_and_window(emu_lib):
    """Exact segments longer than one 32-token tile (40 sinks, a 70-token window: two and three
    tiles, the last ones short) beside a static compressed part, GQA group 4, logits ~1e2."""
    state = static_state(H=2, rank_k=12, rank_v=16, T=0, seed=61, dtype=np.float64, sinks=40, window=70)
    rng = np.random.default_rng(62)
    state.append(rng.standard_normal((2, 150, 64)), rng.standard_normal((2, 150, 64)))
    assert state.window.sink_count == 40 and state.window.keys.shape[2] == 70 and state.layout.num_tokens == 40
    _check_state(emu_lib, state, rng.standard_normal((1, 8, 64)) * 4, None, "float32", None)


def test_pre_rope_append_unrotates_at_the_compressed_positions():
    """The cupy static append un-rotates keys at positions S+T.. (spec/rope.md P2, spec/window.md
    W10) before its projection kernel: projected with B, they are the coefficients the oracle
    stores (numpy arrays stand in for CuPy ones; the rotation is array-generic)."""
    from subspace_ref.policies.append_static import append_static
    from subspace_ref_cupy.cupy_backend import _pre_rope_keys

    rng = np.random.default_rng(71)
    state = static_state(rank_k=12, rank_v=12, T=0, dtype=np.float64, rope=_rope(64), sinks=3, window=4)
    state.append(rng.standard_normal((2, 30, 64)), rng.standard_normal((2, 30, 64)))
    T = state.layout.num_tokens
    assert T == 23
    keys = rng.standard_normal((1, 2, 5, 64))
    oracle = state.copy()
    append_static(oracle, keys, rng.standard_normal((1, 2, 5, 64)))
    got = np.einsum("nhtd,nhrd->nhtr", _pre_rope_keys(state, keys), state.layout.key_bases[:, :, 0])
    np.testing.assert_allclose(got, oracle.layout.key_coef[:, :, T : T + 5], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fmt", ["int4", "int2"])
def test_rope_window_and_low_bit_rope_are_accepted(fmt):
    """The capability declares window, sinks and rope; pre-RoPE states with int4/int2 codes are
    accepted too (decode_rope_partial reads them as decode_split_partial does)."""
    caps = CupyBackend().capabilities
    assert caps.window and caps.sinks and caps.rope
    q = FakeCupyArray(np.zeros((1, 4, 64), dtype=np.float32))
    state = static_state(rank_k=8, rank_v=8, T=20, sinks=2, window=4, rope=_rope(64))
    assert reasons_besides_availability(q, fake_gpu_state(state)) == []
    low = static_state(rank_k=8, rank_v=8, T=20, rope=_rope(64), coefficients=fmt, group_size=4)
    assert reasons_besides_availability(q, fake_gpu_state(low)) == []


@needs_emulation
def test_emulated_shared_memory_size_is_checked(emu_lib, monkeypatch):
    """The emulation reports a kernel writing past its dynamic shared memory, so the launcher's
    size formula (decode_shared_bytes) is checked by every emulated attention above."""
    state = static_state(T=10)
    q = np.zeros((1, 4, 64), dtype=np.float32)
    monkeypatch.setattr(_kernels, "decode_shared_bytes", lambda *a: 1024)
    with pytest.raises(RuntimeError, match="shared memory"):
        _emulation.attend(q, "float32", _emulation.host_arrays(state.layout, "float32"), 1 / 8, lib=emu_lib)


# ----------------------------------------------------------------------------- GPU differentials

AVAILABLE = CupyBackend().availability()
needs_gpu = pytest.mark.skipif(not AVAILABLE, reason=f"cupy backend unavailable: {AVAILABLE.reason}")


def _tolerance(dtype: str) -> float:
    return {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}[dtype]


def _assert_close(out, ref, dtype):
    from subspace_ref.arrays import to_numpy

    got = to_numpy(out).astype(np.float32)
    tol = _tolerance(dtype)
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * np.abs(ref).max())


def _cupy_dtype(dtype: str):
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes", reason="CuPy bfloat16 arrays need ml_dtypes")
        return ml_dtypes.bfloat16
    return np.dtype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["static", "adaptive"])
@pytest.mark.gpu
@needs_gpu
def test_gpu_attend_matches_oracle(kind, dtype):
    import cupy

    import subspace_ref

    state = static_state(T=300) if kind == "static" else chunked_state(T=300, max_chunk=48)
    q = np.random.default_rng(12).standard_normal((state.batch, 4 if kind == "static" else 2, 64)).astype(np.float32)
    on_gpu = state.to("cupy", dtype=_cupy_dtype(dtype))
    rounded = rounded_layout(state, dtype)
    q_dev = cupy.asarray(q).astype(_cupy_dtype(dtype))
    ref = attend_reference(from_host(host_q(q, dtype), dtype), rounded, None)
    out = subspace_ref.attend(q_dev if state.batched else q_dev[0], on_gpu, backend="cupy")
    assert isinstance(out, cupy.ndarray) and str(out.dtype) == dtype
    _assert_close(out if state.batched else out[None], ref, dtype)


@pytest.mark.gpu
@needs_gpu
def test_gpu_empty_splits_and_forced_splits():
    import cupy

    state = chunked_state(N=1, T=100)
    on_gpu = state.to("cupy")
    q = np.random.default_rng(13).standard_normal((1, 4, 64)).astype(np.float32)
    ref = attend_reference(q, state, None)
    for splits in [(1, 128), (4, 32), (9, 32), (64, 32)]:
        out = CupyBackend(splits=splits).attend(cupy.asarray(q), on_gpu, None)
        _assert_close(out, ref, "float32")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.gpu
@needs_gpu
def test_gpu_torch_tensors_round_trip(dtype):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    state = static_state(T=200)
    tdtype = getattr(torch, dtype)
    # the state's arrays as torch CUDA tensors: the backend reads them through DLPack
    torch_state = state.copy()
    torch_state.layout = torch_state.layout.map_arrays(
        lambda name, x: torch.as_tensor(np.asarray(x)).cuda().to(tdtype) if np.asarray(x).dtype.kind == "f" else torch.as_tensor(np.asarray(x)).cuda()
    )
    q = torch.randn((1, 4, 64), generator=torch.Generator().manual_seed(0)).to(tdtype).cuda()
    out = CupyBackend().attend(q, torch_state, None)
    assert isinstance(out, torch.Tensor) and out.dtype == tdtype and out.device == q.device
    ref = attend_reference(q.float().cpu().numpy(), rounded_layout(state, dtype), None)
    _assert_close(out, ref, dtype)


@pytest.mark.parametrize("d", [64, 48], ids=["fixed-d", "run-time-d"])
@pytest.mark.gpu
@needs_gpu
def test_gpu_static_append_matches_oracle(d):
    """Static appends (spec A6) run the projection kernel and must store the oracle's coefficients.
    Adaptive and rotating appends (the oracle's own loop on CuPy arrays) are compared by the
    differential harness (tests/differential/test_append.py), which runs every registered backend."""
    import cupy

    from subspace_ref.arrays import to_numpy

    rng = np.random.default_rng(14)
    host = static_state(d=d, rank_k=20, rank_v=24, T=10, batch=2)
    dev = host.to("cupy")
    for n in (1, 17, 3):
        k = rng.standard_normal((2, 2, n, d)).astype(np.float32)
        v = rng.standard_normal((2, 2, n, d)).astype(np.float32)
        host.append(k, v)
        dev.append(cupy.asarray(k), cupy.asarray(v))
    assert dev.num_tokens == host.num_tokens
    T = host.num_tokens
    for name in ("key_coef", "value_coef"):
        np.testing.assert_allclose(to_numpy(getattr(dev.layout, name))[:, :, :T], getattr(host.layout, name)[:, :, :T], atol=2e-5)


@pytest.mark.gpu
@needs_gpu
def test_gpu_projection_kernel_residuals():
    import cupy

    rng = np.random.default_rng(15)
    state = static_state(T=0, batch=2)
    keys = rng.standard_normal((2, 2, 5, 64)).astype(np.float32)
    keys[0, 1, 2] = 0
    values = rng.standard_normal((2, 2, 5, 64)).astype(np.float32)
    B = state.layout.key_bases[:, :, 0]
    E = state.layout.value_bases[:, :, 0]
    c, dv, rho_k, rho_v = CupyBackend.project_tokens(cupy.asarray(keys), cupy.asarray(values), cupy.asarray(B), cupy.asarray(E))
    c_ref = np.einsum("nhtd,nhrd->nhtr", keys, B)
    np.testing.assert_allclose(c.get(), c_ref, atol=1e-5)
    np.testing.assert_allclose(rho_k.get(), relative_residual(keys, c_ref), atol=1e-5)
    assert float(rho_k[0, 1, 2]) == 0.0
    np.testing.assert_allclose(dv.get(), np.einsum("nhtd,nhrd->nhtr", values, E), atol=1e-5)
    assert rho_v.shape == (2, 2, 5)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind", ["static", "adaptive"])
def test_gpu_int8_state(kind):
    """Spec A10 on the GPU: static appends store the oracle's codes (up to one where c / s rounds
    at a half-integer) and scales; attention dequantises in the kernel and matches the oracle run
    on the very same int8 state."""
    import cupy

    from subspace_ref.arrays import to_numpy

    rng = np.random.default_rng(16)
    if kind == "static":
        host = static_state(T=0, batch=2, coefficients="int8")
    else:
        host = SubspaceState.adaptive(2, 64, rank_k=8, rank_v=8, max_chunk=16, batch=2, dtype=np.float32, coefficients="int8")
    dev = host.to("cupy")
    for n in (1, 40, 3):
        k = rng.standard_normal((2, 2, n, 64)).astype(np.float32)
        v = rng.standard_normal((2, 2, n, 64)).astype(np.float32)
        host.append(k, v)
        dev.append(cupy.asarray(k), cupy.asarray(v))
    T = host.num_tokens
    assert to_numpy(dev.layout.key_coef).dtype == np.int8
    if kind == "static":  # online bases come from cuSOLVER vs LAPACK SVDs: codes comparable only here
        for name in ("key_coef", "value_coef"):
            got, want = to_numpy(getattr(dev.layout, name))[:, :, :T], getattr(host.layout, name)[:, :, :T]
            assert np.abs(got.astype(int) - want).max() <= 1 and (got != want).mean() < 0.01
        np.testing.assert_allclose(to_numpy(dev.layout.key_scale)[:, :, :T], host.layout.key_scale[:, :, :T], rtol=1e-5)
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    ref = attend_reference(q, dev.to("numpy"), None)
    _assert_close(CupyBackend().attend(cupy.asarray(q), dev, None), ref, "float32")
