"""The cupy backend over layouts with a format per side (issue 37 item 1; spec/quantization.md Q0):
keys in one of float, int8, int4, int2 and values in another, read by one launch of the plain or
the pre-RoPE decode kernel (``KeyT``/``ValT`` template arguments, kernels/decode_attention.cu).

Evidence without a GPU: the CUDA sources run under the host emulation (emulation/host_cuda.h) with
the real launch plans and argument tuples, against the float64 oracle (the numpy backend), within
the differential harness's tolerance rule (tests/differential/tolerance.py). Every one of the 12
pairs of different formats runs with GQA, d != d_v, attention sinks and a recent window, plain and
pre-RoPE; a few pairs also run over adaptive chunks, in bfloat16, and at rank tile 64.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from subspace_ref import SubspaceState, calibrate
from subspace_ref.formats import MIXED_FORMATS
from subspace_ref.numpy_backend import attend_reference
from subspace_ref_cupy import CupyBackend, _emulation, _kernels

FORMATS = ("float", "int8", "int4", "int2")
PAIRS = [(k, v) for k in FORMATS for v in FORMATS if k != v]
KIND = _kernels.FORMAT_KINDS

EMULATION, EMULATION_REASON = _emulation.availability()
needs_emulation = pytest.mark.skipif(not EMULATION, reason=f"host emulation of the kernels unavailable: {EMULATION_REASON}")


def _ids(pairs):
    return [f"{k}-{v}" for k, v in pairs]


def _rope(d: int, scaling: float = 1.1, rotary: float = 0.75):
    from subspace_ref.rope import RopeParams

    m = int(rotary * d) // 2
    return RopeParams(1.0 / 10000.0 ** (np.arange(m) / m), layout="half", attention_scaling=scaling)


def mixed_state(pair, *, d=32, d_v=24, rank_k=19, rank_v=13, T=75, H=2, seed=0, rope=None, sinks=2, window=5, batch=None, group_size=8):
    """A float64 static state whose keys are stored as ``pair[0]`` and values as ``pair[1]``, with
    ``sinks`` exact sinks and a ``window``-token exact window beside T compressed tokens."""
    rng = np.random.default_rng(seed)
    basis = calibrate(rng.standard_normal((H, 256, d)), rng.standard_normal((H, 256, d_v)), rank_k=rank_k, rank_v=rank_v, gamma="paper")
    state = SubspaceState.static(basis, dtype=np.float64, coefficients=pair, group_size=group_size, rope=rope, sinks=sinks, window=window, batch=batch)
    lead = (H,) if batch is None else (batch, H)
    n = T + sinks + window
    state.append(rng.standard_normal((*lead, n, d)), rng.standard_normal((*lead, n, d_v)))
    assert state.layout.coefficients == f"{pair[0]}/{pair[1]}" and state.layout.num_tokens == T
    return state


def chunked_mixed_state(pair, *, N=2, H=2, d=32, T=70, max_chunk=24, seed=1):
    """An adaptive state (spec A7) whose chunks come from the length trigger only, per-head ranks."""
    import math

    rng = np.random.default_rng(seed)
    state = SubspaceState.adaptive(
        H, d, rank_k=(12, 16), rank_v=(16, 10), tau_k=0.999, tau_v=0.999, max_chunk=max_chunk, batch=N,
        dtype=np.float64, coefficients=pair, byte_ceiling=math.inf, group_size=16,
    )
    state.append(rng.standard_normal((N, H, T, d)), rng.standard_normal((N, H, T, d)))
    assert (state.num_chunks == 3).all()
    return state


def host_q(q: np.ndarray, dtype: str) -> np.ndarray:
    return _emulation.bf16_bits(q) if dtype == "bfloat16" else np.ascontiguousarray(q, dtype=dtype)


def from_host(x: np.ndarray, dtype: str) -> np.ndarray:
    return _emulation.bf16_float(x) if dtype == "bfloat16" else x.astype(np.float32)


def _configs():
    """The instantiations these tests launch."""
    decode = [_kernels.find_config(dt, KIND[k], 32, 24, 19, 13, KIND[v]) for dt in ("float32",) for k, v in PAIRS]
    decode += [_kernels.find_config("float32", KIND[k], 32, 32, 16, 16, KIND[v]) for k, v in PAIRS]  # chunked (ranks <= 16)
    decode += [_kernels.find_config("bfloat16", KIND[k], 32, 24, 19, 13, KIND[v]) for k, v in (("int4", "int8"), ("float", "int2"))]
    decode += [_kernels.find_config("float32", KIND[k], 64, 64, 40, 36, KIND[v]) for k, v in (("int4", "float"), ("int8", "int2"))]
    decode += [_kernels.find_config("float32", "int4", 32, 24, 19, 13)]  # uniform int4 at run-time head sizes
    rope = [_kernels.find_rope_config("float32", KIND[k], 19, 13, KIND[v]) for k, v in PAIRS]
    rope += [_kernels.find_rope_config("bfloat16", KIND[k], 19, 13, KIND[v]) for k, v in (("int4", "int8"),)]
    return decode, rope


@pytest.fixture(scope="module")
def lib():
    decode, rope = _configs()
    assert all(c is not None for c in decode + rope)
    names = sorted({c.decode_name for c in decode} | {c.name for c in rope})
    names += [_kernels.merge_name(t) for t in ("float32", "bfloat16")] + [_kernels.exact_name(t) for t in ("float32", "bfloat16")]
    return _emulation.library(names)


def _check(lib, state64, q64, scale, dtype: str, splits, codes_matter: bool = True) -> float:
    """The emulated kernels in ``dtype`` against the float64 oracle within the harness's tolerance
    (FACTOR x the oracle's own error in ``dtype`` + FLOOR_ULPS ulps); and, when ``codes_matter``,
    zeroing either side's codes moves the oracle past twice the tolerance (so both sides' formats
    are read, not one side's format applied to both)."""
    from tests.differential.tolerance import reference_error, tolerance

    out64 = attend_reference(q64, state64, scale)
    arrays = _emulation.host_state_arrays(state64, dtype)
    s = 1 / np.sqrt(q64.shape[-1]) if scale is None else scale
    out = from_host(_emulation.attend(host_q(q64.astype(np.float32), dtype), dtype, arrays, s, splits=splits, lib=lib), dtype)
    err = float(np.abs(out.astype(np.float64) - out64).max())
    tol = tolerance(reference_error(state64, q64, scale, out64, dtype), out64, dtype)
    assert err <= tol, f"max |kernel - oracle64| = {err:.3g} > tol {tol:.3g}"
    if codes_matter:
        for side in ("key", "value"):
            flat = state64.copy()
            flat.layout = replace(flat.layout, **{f"{side}_coef": np.zeros_like(getattr(flat.layout, f"{side}_coef"))})
            assert np.abs(attend_reference(q64, flat, scale) - out64).max() > 2 * tol, side
    return tol


# ----------------------------------------------------------------------------- declaration


def test_every_mixed_pair_is_declared_and_compiled():
    """The declaration lists every "key/value" pair of different formats, and each pair has a plain
    and a pre-RoPE instantiation at every rank tile and dtype (the list nvcc compiles)."""
    declared = CupyBackend().capabilities.coefficient_formats
    assert set(MIXED_FORMATS) <= set(declared) and len(MIXED_FORMATS) == 12
    names = set(_kernels.name_expressions()[_kernels.DECODE_SOURCE])
    for dtype in _kernels.CUDA_TYPES:
        for k, v in PAIRS:
            for rt in _kernels.RANK_TILES:
                cfg = _kernels.find_config(dtype, KIND[k], 48, 40, rt, rt, KIND[v])
                rope = _kernels.find_rope_config(dtype, KIND[k], rt, rt, KIND[v])
                assert cfg.rank_tile == rt and (cfg.coef, cfg.value_coef) == (KIND[k], KIND[v])
                assert cfg.decode_name in names and rope.name in names


def test_mixed_shared_memory_formula():
    """A uniform pair gives the formula's old numbers; a mixed pair's tiles hold a key row of the
    key format beside a value row of the value format."""
    f, i8, i4, i2 = (_kernels.coef_cuda_type("float32", k) for k in ("same", "int8", "int4", "int2"))
    for rt in _kernels.RANK_TILES:
        for c in (f, i8, i4, i2):
            assert _kernels.decode_shared_bytes(4, 128, 128, rt, c) == _kernels.decode_shared_bytes(4, 128, 128, rt, c, c)
    # rank tile 32, int4 keys, int8 values: 64-token tiles (rows 32 B and 48 B), two stages;
    # per stage 64 value scales (no key scale: int4 keys carry group scales in global memory)
    tt, stages = _kernels.decode_tiles(32, 4, 8)
    assert (tt, stages) == (64, 2)
    tiles = stages * tt * (32 + 48) + 4 * (stages * tt * 1 + stages * tt + tt * 33)
    assert _kernels.decode_shared_bytes(1, 64, 64, 32, i4, i8) == tiles + 4 * (64 + 64 + tt + 64 + 4)


@pytest.mark.parametrize("pair", PAIRS, ids=_ids(PAIRS))
def test_mixed_attention_is_accepted(pair):
    """No refusal of the format pair (the call's reasons are about the host arrays only), and
    appends are refused before any change when a side is int4/int2."""
    from tests.test_cupy_backend import FakeCupyArray

    state = mixed_state(pair, T=20, sinks=0, window=0)
    q = FakeCupyArray(np.zeros((1, 4, 32), dtype=np.float64))
    reasons = CupyBackend().not_supported_reasons(q, state)
    assert not any("coefficients" in r for r in reasons), reasons
    if "int4" in pair or "int2" in pair:
        before = state.layout.num_tokens
        with pytest.raises(NotImplementedError, match="cannot append"):
            CupyBackend().append(state, np.zeros((2, 1, 32)), np.zeros((2, 1, 24)))
        assert state.layout.num_tokens == before


# ----------------------------------------------------------------------------- kernel logic on the host


@needs_emulation
@pytest.mark.parametrize("pair", PAIRS, ids=_ids(PAIRS))
def test_emulated_mixed_static_with_sinks_and_window(lib, pair):
    """Plain decode (spec A3) with keys in one format and values in another: d = 32, d_v = 24 (the
    run-time head-size instantiation), ranks 19 (odd: a half-filled last low-bit byte) and 13,
    GQA group 2, 75 compressed tokens (int4/int2 keys: groups of 8, the last 3 the float tail) in
    splits of 32 crossing key groups and the tail, 2 sinks and a 5-token window merged with them."""
    state = mixed_state(pair, seed=PAIRS.index(pair))
    q = np.random.default_rng(100 + PAIRS.index(pair)).standard_normal((1, 4, 32))
    _check(lib, state, q, None, "float32", (3, 32))


@needs_emulation
@pytest.mark.parametrize("pair", PAIRS, ids=_ids(PAIRS))
def test_emulated_mixed_rope_with_sinks_and_window(lib, pair):
    """Pre-RoPE decode (spec/rope.md P3) with a format per side: keys rebuilt from their own format
    (low-bit keys dequantised per tile) and rotated from position S = 2 (spec/window.md W10),
    values in theirs; d = 32, d_v = 24, GQA 2, sinks and window, splits of 32."""
    state = mixed_state(pair, rope=_rope(32), seed=20 + PAIRS.index(pair))
    q = np.random.default_rng(200 + PAIRS.index(pair)).standard_normal((1, 4, 32))
    tol = _check(lib, state, q, None, "float32", (3, 32))
    unrotated = state.copy()
    unrotated.policy = replace(unrotated.policy, rope=None)
    assert np.abs(attend_reference(q, unrotated, None) - attend_reference(q, state, None)).max() > 2 * tol


@needs_emulation
@pytest.mark.parametrize("pair", PAIRS, ids=_ids(PAIRS))
def test_emulated_mixed_chunks(lib, pair):
    """Adaptive chunks with different bases (spec A7), batch 2, MHA, per-head ranks; 16-token key
    groups straddle the 24-token chunks and the 32-token splits."""
    state = chunked_mixed_state(pair, seed=40 + PAIRS.index(pair))
    q = np.random.default_rng(300 + PAIRS.index(pair)).standard_normal((2, 2, 32))
    _check(lib, state, q, 0.3, "float32", (3, 32), codes_matter=False)


@needs_emulation
@pytest.mark.parametrize("pair", [("int4", "int8"), ("float", "int2")], ids=_ids([("int4", "int8"), ("float", "int2")]))
def test_emulated_mixed_bfloat16(lib, pair):
    """bfloat16 storage (q, bases, float coefficients, the key tail), float32 accumulation."""
    state = mixed_state(pair, seed=60)
    q = np.random.default_rng(61).standard_normal((1, 4, 32))
    _check(lib, state, q, None, "bfloat16", (2, 64), codes_matter=False)


@needs_emulation
def test_emulated_mixed_rope_bfloat16(lib):
    state = mixed_state(("int4", "int8"), rope=_rope(32), seed=62)
    q = np.random.default_rng(63).standard_normal((1, 4, 32))
    _check(lib, state, q, None, "bfloat16", (2, 64), codes_matter=False)


@needs_emulation
@pytest.mark.parametrize("pair", [("int4", "float"), ("int8", "int2")], ids=_ids([("int4", "float"), ("int8", "int2")]))
def test_emulated_mixed_rank_tile_64(lib, pair):
    """Ranks 40 and 36 (rank tile 64; int4 keys beside float values take one stage of 32-token
    tiles), d = d_v = 64, automatic splits, no exact tokens."""
    state = mixed_state(pair, d=64, d_v=64, rank_k=40, rank_v=36, T=50, sinks=0, window=0, group_size=32, seed=64)
    q = np.random.default_rng(65).standard_normal((1, 2, 64))
    _check(lib, state, q, None, "float32", None, codes_matter=False)


@needs_emulation
@pytest.mark.parametrize("pair", [("int4", "int8"), ("int2", "float"), ("int4", "int4")], ids=_ids([("int4", "int8"), ("int2", "float"), ("int4", "int4")]))
def test_emulated_low_bit_keys_of_a_copy_cut_to_its_live_groups(lib, pair):
    """``state.to(...)`` keeps the live rows only: T = 300 coefficient rows but 300 // 8 = 37 key
    groups (the layout allocates ceil(300 / 8) = 38). The kernels index the group scales by their
    own row count (key_groups_cap), not by ceil(T_cap / G): deriving it read head 1's scales from
    the wrong rows (found on the GPU: errors of 1.2 and NaN)."""
    state = mixed_state(pair, T=300, sinks=0, window=0, seed=70) if pair[0] != pair[1] else None
    if state is None:
        rng = np.random.default_rng(70)
        basis = calibrate(rng.standard_normal((2, 256, 32)), rng.standard_normal((2, 256, 24)), rank_k=19, rank_v=13, gamma="paper")
        state = SubspaceState.static(basis, dtype=np.float64, coefficients=pair[0], group_size=8)
        state.append(rng.standard_normal((2, 300, 32)), rng.standard_normal((2, 300, 24)))
    cut = state.to("numpy", dtype=np.float64)
    assert cut.layout.key_group_scale.shape[2] == 37 and cut.layout.key_coef.shape[2] == 300
    q = np.random.default_rng(71).standard_normal((1, 4, 32))
    _check(lib, cut, q, None, "float32", (3, 128), codes_matter=False)


# ----------------------------------------------------------------------------- on a GPU

AVAILABLE = CupyBackend().availability()
needs_gpu = pytest.mark.skipif(not AVAILABLE, reason=f"cupy backend unavailable: {AVAILABLE.reason}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "pre-rope"])
@pytest.mark.parametrize("pair", PAIRS, ids=_ids(PAIRS))
def test_gpu_mixed_pairs_match_oracle(pair, rope):
    """The public attend on the GPU (NVRTC-compiled KeyT/ValT instantiations, one split launch, the
    exact partial and the merge) over a state moved to CuPy, against the float64 oracle within the
    harness's tolerance rule: every pair, plain and pre-RoPE, GQA 2, d != d_v, sinks and window."""
    import cupy

    import subspace_ref
    from subspace_ref.arrays import to_numpy
    from tests.differential.tolerance import reference_error, tolerance

    i = PAIRS.index(pair)
    state = mixed_state(pair, d=64, d_v=48, rank_k=19, rank_v=13, T=300, rope=_rope(64) if rope else None, seed=80 + i)
    q = np.random.default_rng(400 + i).standard_normal((1, 4, 64))
    out64 = attend_reference(q, state, None)
    on_gpu = state.to("cupy", dtype=np.float32)
    assert CupyBackend().not_supported_reasons(cupy.asarray(q[0], dtype=cupy.float32), on_gpu) == []
    out = to_numpy(subspace_ref.attend(cupy.asarray(q[0], dtype=cupy.float32), on_gpu, backend="cupy")).astype(np.float64)
    err = float(np.abs(out - out64[0]).max())
    tol = tolerance(reference_error(state, q, None, out64, "float32"), out64, "float32")
    assert err <= tol, f"max |gpu - oracle64| = {err:.3g} > tol {tol:.3g}"
