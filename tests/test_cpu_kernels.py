"""The torch backend's CPU kernels for quantised coefficients (backends/subspace_ref_torch/kernels/):
built wherever a C compiler is; the decode products (coefficient_products.c, spec R14), used by
attend on one-chunk int8/int4/int2 states, within the harness's derived tolerance of the float64
oracle, as is the torch-operations path they replace; the int4/int2 stores (quantized_stores.c,
spec A10, spec/quantization.md Q1-Q2), used by appends to CPU states, bit for bit the other paths'."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

import subspace_ref as sr
from subspace_ref.formats import MIXED_FORMATS
from subspace_ref.rope import RopeParams
from tests.differential.tolerance import reference_error, tolerance

#: moves every case's data (a sweep over seeds: SUBSPACE_REF_TEST_SEED=k)
SEED_OFFSET = int(os.environ.get("SUBSPACE_REF_TEST_SEED", "0"))

torch = pytest.importorskip("torch")
cpu_kernels = pytest.importorskip("subspace_ref_torch.cpu_kernels")
kernel_library = pytest.importorskip("subspace_ref_torch.kernel_library")
kernel_stores = pytest.importorskip("subspace_ref_torch.kernel_stores")
torch_maps = pytest.importorskip("subspace_ref_torch.maps")
torch_plan = pytest.importorskip("subspace_ref_torch.plan")


def test_the_kernels_build_where_a_c_compiler_is():
    """A build failure must fail here, not quietly send every call down the slower path."""
    if os.environ.get("SUBSPACE_REF_CPU_KERNELS") == "0":
        pytest.skip("disabled by SUBSPACE_REF_CPU_KERNELS=0")
    if kernel_library.compiler() is None:
        pytest.skip("no C compiler on this machine: attend dequantises with torch operations")
    ok, why = kernel_library.library_status()
    assert ok, why


def _state(coefficients: str, T: int, window: int, ranks: tuple[int, int], rng, d_v: int = 96, sinks: int = 0) -> sr.SubspaceState:
    """Two sequences, 3 KV heads, d = 96 (values of d_v), groups of 16 keys with an unfinished one."""
    H, d = 3, 96
    r, r_v = ranks
    B = np.linalg.qr(rng.standard_normal((H, d, r)))[0].transpose(0, 2, 1)
    E = np.linalg.qr(rng.standard_normal((H, d_v, r_v)))[0].transpose(0, 2, 1)
    state = sr.SubspaceState.static(sr.StaticBasis.from_bases(B, E), coefficients=coefficients, group_size=16, window=window, sinks=sinks, batch=2)
    keys = rng.standard_normal((2, H, T, d)) * 3
    state.append(keys, rng.standard_normal((2, H, T, d_v)))
    return state


#: the builds the kernel tests run on besides the native one: "portable" for an x86-64 CPU without
#: AVX-512 (x86-64-v3: the 8-lane AVX2 register paths), "scalar" for one without AVX2 either
#: (x86-64: the portable loops, which other architectures run), so that every path is tested on
#: a machine that has AVX-512 or AVX2
MARCH = {"portable": "x86-64-v3", "scalar": "x86-64"}


def _library_for(kind: str):
    """(the kernels built with -march=MARCH[kind], "") or (None, why) where that build is
    impossible (another architecture, no compiler)."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64") or kernel_library.compiler() is None:
        return None, f"not an x86-64 machine with a C compiler ({platform.machine()})"
    march = MARCH[kind]
    flags = [f for f in kernel_library.FLAGS if not f.startswith("-march")] + [f"-march={march}"]
    try:
        return kernel_library.build(flags, f"coefficient_products_{march.replace('-', '_')}"), ""
    except (OSError, RuntimeError) as e:
        return None, f"the {march} build failed: {e}"


@pytest.fixture(scope="module")
def portable_library():
    return _library_for("portable")


@pytest.fixture(scope="module")
def scalar_library():
    return _library_for("scalar")


@pytest.mark.parametrize("coefficients", ["int8", "int4", "int2"])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("ranks", [(11, 9), (32, 16), (16, 24), (80, 48)], ids=["r11-9", "r32-16", "r16-24", "r80-48"])
@pytest.mark.parametrize(
    "kernels", ["native", "portable", "scalar", False], ids=["kernels", "portable-kernels", "scalar-kernels", "torch-ops"]
)
def test_attend_within_the_derived_tolerance(coefficients, window, group, ranks, kernels, monkeypatch, request):
    """T = 2100: three value tiles (VALUE_TILE = 1024), blocks of 16 tokens and a remainder, and a
    trailing partial key group; a window makes the weights a strided view. Ranks 11 and 9 fill no
    vector register and end inside a byte (int4 / int2 padding: the kernels' scalar loops); 32
    and 16 (rows of 4-32 bytes) take the in-register chunks; 16 and 24 the chunks that span
    planes (int2 keys: rows of 4 bytes), the operand permutes for planes narrower than a vector
    and value rows of 8 lanes but not 16; 80 and 48 the widened 16-token blocks (rows past 64
    values). With ``kernels`` the kernels must serve the call (logits, softmax and value sums in
    one); "portable": built for AVX2 without AVX-512, their 8-lane register paths; "scalar":
    built without either, their portable loops (a sequential sum of a tile's softmax weights
    there reached 1.8x the tolerance before 2026-11-25)."""
    if kernels and not kernel_library.library_status()[0]:
        pytest.skip(f"CPU kernels unavailable: {kernel_library.library_status()[1]}")
    if kernels in MARCH:
        library, why = request.getfixturevalue(f"{kernels}_library")
        if library is None:
            pytest.skip(why)
        monkeypatch.setattr(kernel_library, "_library", library)
    rng = np.random.default_rng(zlib.crc32(repr((coefficients, window, group, ranks)).encode()) + SEED_OFFSET)
    state = _state(coefficients, 2100, window, ranks, rng)
    q = rng.standard_normal((2, 3 * group, 96)) * 2
    out64 = sr.attend(q, state)
    calls = []
    if kernels:
        real = cpu_kernels.KernelCall.__call__
        monkeypatch.setattr(cpu_kernels.KernelCall, "__call__", lambda self, *a, **k: calls.append(a) or real(self, *a, **k))
    else:
        monkeypatch.setattr(kernel_library, "_library", None)
        monkeypatch.setattr(kernel_library, "_failure", "disabled by the test")
    got = sr.attend(torch.from_numpy(q).float(), state.to("torch", dtype=torch.float32), backend="torch").double().numpy()
    err = float(np.abs(got - out64).max())
    assert err <= tolerance(reference_error(state, q, None, out64, "float32"), out64, "float32")
    assert len(calls) == (1 if kernels else 0)


#: ranks whose int4 / int2 rows take spec/quantization.md Q6's centred form (spec/roofline.md R14
#: steps 2 and 4: ``centred_rows``, rows of whole vectors of bytes, with one query head per KV
#: head) in the kernels' 16-lane (AVX-512) and 8-lane (AVX2) builds alike, so that every build
#: with vector registers runs that form natively, not only the x86-64-v3 build on an AVX-512 host:
#: int4 keys of r = 32 (16-byte rows, <= 4 vectors in both builds), int4 values of r_v = 32 and 64
#: and int2 values of r_v = 64 (16 or 32-byte rows); int2 keys take it at r = 64 with 16 lanes
#: and r = 32 with 8 (rows of 16 / 8 bytes, at most 4 vectors), int2 values of r_v = 32 with 8.
CENTRED_RANKS = {"r32-64": (32, 64), "r64-32": (64, 32)}


@pytest.mark.parametrize("coefficients", ["int4", "int2"])
@pytest.mark.parametrize("ranks", list(CENTRED_RANKS.values()), ids=list(CENTRED_RANKS))
@pytest.mark.parametrize("exact", [(0, 0), (2, 5)], ids=["compressed-only", "sinks-and-window"])
@pytest.mark.usefixtures("either_library")
def test_centred_rows_within_the_derived_tolerance(coefficients, ranks, exact, monkeypatch):
    """Q6's centred form in every build that has it: the codes minus the middle code as signed
    bytes (``centred_planes``; in the logits a group's ``q*s / F``, in the value sums ``(w s) / F``
    with ``centred_unscale``) and the constant terms (the logits' ``q . (z + M s)``, the value
    blocks' ``sum_t w_t (z_t + M s_t)`` offset), over T = 2100 tokens: three value tiles, each
    ending on a block whose codes the block before put in order, and a partial key group. One
    query head per KV head (the centred form's condition). The build without vector registers
    ("scalar-kernels", -march=x86-64) has no centred form at all: there the same cases check its
    portable loops. Within the derived tolerance of the float64 oracle, in one kernel call."""
    sinks, window = exact
    rng = np.random.default_rng(zlib.crc32(repr(("centred", coefficients, ranks, exact)).encode()) + SEED_OFFSET)
    state = _state(coefficients, 2100, window, ranks, rng, sinks=sinks)
    q = rng.standard_normal((2, 3, 96)) * 2
    out64 = sr.attend(q, state)
    _assert_one_kernel_call_within_tolerance(state, q, out64, monkeypatch)


#: value ranks whose rows fill no whole number of 16-lane vectors, read by a chunk plan in the
#: 16-lane build (``planned_chunk``): int8 rows of 20 and 40 bytes (a masked last chunk), int4 / int2
#: rows of 5-36 bytes whose chunks span planes, rows past 16 bytes reading a plane's bytes in place
PLANNED_VALUE_RANKS = {"r16-20": (16, 20), "r16-28": (16, 28), "r16-40": (16, 40), "r16-72": (16, 72)}


@pytest.mark.parametrize("coefficients", ["int8", "int4", "int2"])
@pytest.mark.parametrize("ranks", list(PLANNED_VALUE_RANKS.values()), ids=list(PLANNED_VALUE_RANKS))
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.usefixtures("either_library")
def test_planned_value_rows_within_the_derived_tolerance(coefficients, ranks, group, monkeypatch):
    """Value rows that are not whole vectors take the 16-token register blocks in every build
    that has them (one query head per KV head: straight from the codes; two: through the widened
    block), their sums' last vector added to the tile's in part. T = 1100: two value tiles and a
    remainder of 12 tokens. Within the derived tolerance of the float64 oracle, in one kernel call."""
    rng = np.random.default_rng(zlib.crc32(repr(("planned", coefficients, ranks, group)).encode()) + SEED_OFFSET)
    state = _state(coefficients, 1100, 0, ranks, rng)
    q = rng.standard_normal((2, 3 * group, 96)) * 2
    out64 = sr.attend(q, state)
    _assert_one_kernel_call_within_tolerance(state, q, out64, monkeypatch)


def _assert_one_kernel_call_within_tolerance(state, q, out64, monkeypatch) -> None:
    """The torch float32 attend of ``q`` over ``state`` is one call of the CPU kernels and lies within
    the derived tolerance (tests/differential/tolerance.py) of the float64 oracle's ``out64``."""
    calls = []
    real = cpu_kernels.KernelCall.__call__
    monkeypatch.setattr(cpu_kernels.KernelCall, "__call__", lambda self, *a, **k: calls.append(a) or real(self, *a, **k))
    got = sr.attend(torch.from_numpy(q).float(), state.to("torch", dtype=torch.float32), backend="torch").double().numpy()
    assert len(calls) == 1
    err = float(np.abs(got - out64).max())
    assert err <= tolerance(reference_error(state, q, None, out64, "float32"), out64, "float32")


@pytest.mark.parametrize("coefficients", MIXED_FORMATS)
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("ranks", [(11, 9), (32, 16)], ids=["r11-9", "r32-16"])
@pytest.mark.usefixtures("either_library")
def test_mixed_formats_take_the_kernel_within_the_derived_tolerance(coefficients, window, ranks, monkeypatch):
    """Keys and values in different formats (spec/quantization.md Q0: float32, int8, int4, int2
    per side): the plan routes the call to the C kernel, for the state's life (the decode route),
    and its one call lies within the derived tolerance of the float64 oracle. T = 1100: two value
    tiles and an unfinished key group of 12."""
    rng = np.random.default_rng(zlib.crc32(repr(("mixed", coefficients, window, ranks)).encode()) + SEED_OFFSET)
    state = _state(coefficients, 1100, window, ranks, rng, sinks=2 if window else 0)
    q = rng.standard_normal((2, 3 * 2, 96)) * 2
    torch_state = state.to("torch", dtype=torch.float32)
    route = torch_plan.plan_attend(torch.from_numpy(q).float(), torch_state)
    assert route.way is torch_plan.Way.KERNEL and route.lasting, route
    out64 = sr.attend(q, state)
    _assert_one_kernel_call_within_tolerance(state, q, out64, monkeypatch)
    assert sr.get_backend("torch").attend_route(torch.from_numpy(q).float(), torch_state) is cpu_kernels.kernel_attend


def test_the_plan_names_the_route_and_why():
    """``plan_attend`` is the one decision: float64 work and float sides stored in a half dtype
    take the general path (int4 / int2 sides still read by the kernels where the work is
    float32), a float32 mixed state the kernel, for the state's life."""
    if not kernel_library.library_status()[0]:
        pytest.skip(f"CPU kernels unavailable: {kernel_library.library_status()[1]}")
    rng = np.random.default_rng(5 + SEED_OFFSET)
    state = _state("float/int4", 40, 0, (11, 9), rng)
    q = torch.from_numpy(rng.standard_normal((2, 6, 96)))
    cases = {torch.float32: (torch_plan.Way.KERNEL, False), torch.float64: (torch_plan.Way.GENERAL, False), torch.float16: (torch_plan.Way.GENERAL, True)}
    for dtype, (way, rows) in cases.items():
        route = torch_plan.plan_attend(q.to(dtype), state.to("torch", dtype=dtype))
        assert (route.way, route.kernel_rows) == (way, rows), (dtype, route)
        assert route.reason


@pytest.mark.parametrize("coefficients", ["int8", "int4", "int2"])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.usefixtures("either_library")
def test_exact_tokens_with_values_of_another_size(coefficients, group, monkeypatch):
    """Sinks and a recent window (spec/window.md W3, W8) in the kernels' call with d = 96 and
    d_v = 40: the exact tokens' logits are scaled by 1/sqrt(d), never 1/sqrt(d_v), their keys
    read in rows of d and their values in rows of d_v, the output has d_v columns. Within the
    derived tolerance of the float64 oracle, in one kernel call."""
    rng = np.random.default_rng(zlib.crc32(repr(("d_v", coefficients, group)).encode()) + SEED_OFFSET)
    state = _state(coefficients, 300, 7, (11, 9), rng, d_v=40, sinks=3)
    q = rng.standard_normal((2, 3 * group, 96)) * 2
    out64 = sr.attend(q, state)
    assert out64.shape == (2, 3 * group, 40)
    _assert_one_kernel_call_within_tolerance(state, q, out64, monkeypatch)


def test_beyond_the_kernel_limits_is_a_clear_error():
    if not kernel_library.library_status()[0]:
        pytest.skip(f"CPU kernels unavailable: {kernel_library.library_status()[1]}")
    state = _state("int8", 8, 0, (4, 4), np.random.default_rng(0)).to("torch", dtype=torch.float32)
    maps = torch_maps.one_chunk_maps(state, 96, None, torch.float32)
    with pytest.raises(ValueError, match="query heads per KV head <= 64"):
        cpu_kernels.KernelCall.of(state.layout, maps[0], maps[1])(torch.zeros((2, 3 * 65, 96)), state.layout, 1024)


@pytest.fixture(params=["native", "portable", "scalar"], ids=["kernels", "portable-kernels", "scalar-kernels"])
def either_library(request, monkeypatch):
    """Runs a test on the kernels as built here and on their builds for AVX2 and for neither."""
    if not kernel_library.library_status()[0]:
        pytest.skip(f"CPU kernels unavailable: {kernel_library.library_status()[1]}")
    if request.param in MARCH:
        library, why = request.getfixturevalue(f"{request.param}_library")
        if library is None:
            pytest.skip(why)
        monkeypatch.setattr(kernel_library, "_library", library)


@pytest.mark.usefixtures("either_library")
def test_the_softmax_exponential_is_within_one_ulp():
    """The kernels' own e^x (x <= 0: logit minus the maximum) against float64, over the whole
    range where float32 results are normal, and 0 below it; NaN stays NaN."""
    if not kernel_library.library_status()[0]:
        pytest.skip(f"CPU kernels unavailable: {kernel_library.library_status()[1]}")
    x = torch.cat([torch.linspace(-87.3, 0.0, 400_003), torch.tensor([-1e4, -float("inf"), float("nan")])])
    got = cpu_kernels.softmax_exp(x).double().numpy()
    exact = np.exp(x.double().numpy())
    normal = exact >= np.finfo(np.float32).tiny
    ulps = np.abs(got[normal] - exact[normal]) / np.spacing(exact[normal].astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 1.0
    assert got[-3] == 0.0 and got[-2] == 0.0 and np.isnan(got[-1])


@pytest.mark.parametrize("coefficients", ["int4", "int2"])
@pytest.mark.parametrize("ranks", [(11, 9), (32, 16), (16, 24), (80, 48)], ids=["r11-9", "r32-16", "r16-24", "r80-48"])
@pytest.mark.usefixtures("either_library")
def test_low_bit_rows_read_bit_for_bit_as_the_oracle(coefficients, ranks):
    """The kernels' tile reading (pre-RoPE keys are rebuilt from it, and every torch-operations
    product on a CPU reads it) against spec Q2's own reading, ``quantization.read_low_bit``: the
    same float32 numbers, for ranges inside groups, across them and into the unfinished group's
    float tail, for keys and values, ranks that end inside a byte and ranks past 64 columns."""
    if not kernel_library.library_status()[0]:
        pytest.skip(f"CPU kernels unavailable: {kernel_library.library_status()[1]}")
    from subspace_ref.quantization import read_low_bit

    rng = np.random.default_rng(zlib.crc32(repr((coefficients, ranks)).encode()) + SEED_OFFSET)
    lay = _state(coefficients, 150, 0, ranks, rng).to("torch", dtype=torch.float32).layout  # groups of 16: 9 whole, 6 in the tail
    for which in ("key", "value"):
        for a, b in [(0, 150), (5, 37), (140, 150), (144, 150), (0, 144), (17, 17)]:
            want = read_low_bit(lay, which, a, b, torch.float32, lay.num_tokens)
            got = cpu_kernels.low_bit_rows(lay, which, a, b)
            assert got.shape == want.shape and torch.equal(got, want), (which, a, b)


@pytest.mark.parametrize("coefficients", ["int8", "int4"])
def test_a_decode_loop_reads_every_append_and_keeps_one_binding(coefficients):
    """What the kernels hold between calls is addresses and strides only (``kernel_sides``, and
    the call prepared over them, ``kernel_call``): a decode loop appends one token and attends,
    crossing key-group ends and a growth of the arrays into new ones; every step must read the
    tokens appended so far (within the derived tolerance of the oracle over the same stored
    state), and the layout must keep one binding of each, not one per token count. (The oracle's own appends would store other codes where float32
    projections round across a quantisation step: the appends are compared elsewhere.)"""
    if not kernel_library.library_status()[0]:
        pytest.skip(f"CPU kernels unavailable: {kernel_library.library_status()[1]}")
    rng = np.random.default_rng(zlib.crc32(coefficients.encode()) + SEED_OFFSET)
    state = _state(coefficients, 40, 0, (11, 9), rng).to("torch", dtype=torch.float32)  # arrays of exactly 40 rows: the first append grows them
    sr.attend(torch.zeros(2, 3, 96), state, backend="torch")
    addresses = {state.layout.key_coef.data_ptr()}
    for step in range(40):
        state.append(torch.from_numpy(rng.standard_normal((2, 3, 96)) * 3).float(), torch.from_numpy(rng.standard_normal((2, 3, 96))).float())
        q = rng.standard_normal((2, 3, 96)) * 2
        oracle = state.to("numpy", dtype="float64")
        out64 = sr.attend(q, oracle)
        got = sr.attend(torch.from_numpy(q).float(), state, backend="torch").double().numpy()
        assert np.abs(got - out64).max() <= tolerance(reference_error(oracle, q, None, out64, "float32"), out64, "float32"), step
        kernel_entries = [key for key in state.layout._derived if "kernel" in str(key)]
        assert kernel_entries == ["kernel_sides", ("kernel_call", 96, 1 / np.sqrt(96))], kernel_entries
        addresses.add(state.layout.key_coef.data_ptr())
    assert len(addresses) > 1, "the loop must cross a growth of the coefficient arrays"


@pytest.mark.parametrize("coefficients", ["int8", "int4"])
def test_the_prepared_call_rereads_bases_gamma_and_scale_after_writes(coefficients):
    """The kernels' call is prepared once (``kernel_call``) and found by one lookup per step:
    an in-place write to the bases or gamma, an append and another logit scale must each show
    in the next result (a stale call fails here), within the derived tolerance of the oracle
    over the same stored state."""
    if not kernel_library.library_status()[0]:
        pytest.skip(f"CPU kernels unavailable: {kernel_library.library_status()[1]}")
    rng = np.random.default_rng(zlib.crc32(coefficients.encode()) + 3 + SEED_OFFSET)
    state = _state(coefficients, 70, 0, (11, 9), rng).to("torch", dtype=torch.float32)
    q = rng.standard_normal((2, 3, 96)) * 2

    def check(scale=None):
        oracle = state.to("numpy", dtype="float64")
        out64 = sr.attend(q, oracle, scale=scale)
        got = sr.attend(torch.from_numpy(q).float(), state, backend="torch", scale=scale).double().numpy()
        assert np.abs(got - out64).max() <= tolerance(reference_error(oracle, q, scale, out64, "float32"), out64, "float32")
        return got

    first = check()
    state.layout.gamma.mul_(1.7)
    second = check()
    state.layout.key_bases[1, 2, 0, 3] *= -1
    state.layout.value_bases[0, 1, 0, 2] *= 0.5
    third = check()
    state.append(torch.from_numpy(rng.standard_normal((2, 3, 96)) * 3).float(), torch.from_numpy(rng.standard_normal((2, 3, 96))).float())
    check()
    check(scale=0.3)
    assert not np.array_equal(first, second) and not np.array_equal(second, third)


def test_a_deep_copy_attends_over_its_own_arrays():
    """A copy of a state the kernels have served (beam search deep-copies caches) must not
    inherit the original's kernel addresses: it attends over its own arrays, and appends to
    either leave the other alone."""
    if not kernel_library.library_status()[0]:
        pytest.skip(f"CPU kernels unavailable: {kernel_library.library_status()[1]}")
    import copy

    rng = np.random.default_rng(7 + SEED_OFFSET)
    state = _state("int4", 50, 0, (11, 9), rng).to("torch", dtype=torch.float32)
    q = torch.from_numpy(rng.standard_normal((2, 3, 96))).float()
    before = sr.attend(q, state, backend="torch")
    twin = copy.deepcopy(state)
    assert torch.equal(sr.attend(q, twin, backend="torch"), before)
    twin.append(torch.from_numpy(rng.standard_normal((2, 3, 96)) * 3).float(), torch.from_numpy(rng.standard_normal((2, 3, 96))).float())
    assert torch.equal(sr.attend(q, state, backend="torch"), before)
    assert not torch.equal(sr.attend(q, twin, backend="torch"), before)


def _strided(codes: "torch.Tensor") -> "torch.Tensor":
    """The same codes in rows that are not back to back (a view of a twice-as-wide array)."""
    wide = torch.zeros(codes.shape[:3] + (2 * codes.shape[3],), dtype=codes.dtype)
    wide[..., : codes.shape[3]] = codes
    return wide[..., : codes.shape[3]]


@pytest.mark.parametrize("coefficients", ["int8", "int4"])
def test_arrays_the_kernels_cannot_read_in_place_take_the_torch_path(coefficients):
    """Coefficient rows that are not back to back (a strided view standing for the stored
    array) are refused by the kernels, not copied behind the appends' back: attend takes the
    torch-operations path, within the same tolerance."""
    if not kernel_library.library_status()[0]:
        pytest.skip(f"CPU kernels unavailable: {kernel_library.library_status()[1]}")
    from dataclasses import replace

    rng = np.random.default_rng(zlib.crc32(coefficients.encode()) + 1 + SEED_OFFSET)
    oracle = _state(coefficients, 300, 0, (11, 9), rng)
    state = oracle.to("torch", dtype=torch.float32)
    state.layout = replace(state.layout, key_coef=_strided(state.layout.key_coef), _derived={})
    q = rng.standard_normal((2, 3, 96)) * 2
    out64 = sr.attend(q, oracle)
    assert kernel_library.kernel_sides(state.layout) is None
    assert torch_plan.plan_attend(torch.from_numpy(q).float(), state).way is torch_plan.Way.GENERAL
    got = sr.attend(torch.from_numpy(q).float(), state, backend="torch").double().numpy()
    assert np.abs(got - out64).max() <= tolerance(reference_error(oracle, q, None, out64, "float32"), out64, "float32")


def test_attend_routes_decode_calls_straight_to_the_kernels():
    """``attend`` asks the torch backend once per admitted query kind for its route
    (``Backend.attend_route``): the kernels' for a one-chunk quantised state, with exact tokens
    (sinks, window: they join the kernels' softmax) or without, batched or not, and none for a
    state they do not serve; routed calls give what the
    general path gives, and a route that no longer serves (arrays replaced by ones the kernels
    cannot read in place) hands the call back to it."""
    if not kernel_library.library_status()[0]:
        pytest.skip(f"CPU kernels unavailable: {kernel_library.library_status()[1]}")
    from dataclasses import replace

    rng = np.random.default_rng(11 + SEED_OFFSET)
    H, d, r = 3, 96, 11
    B = np.linalg.qr(rng.standard_normal((H, d, r)))[0].transpose(0, 2, 1)
    basis = sr.StaticBasis.from_bases(B, B)
    keys, values = rng.standard_normal((H, 70, d)) * 3, rng.standard_normal((H, 70, d))
    q = torch.from_numpy(rng.standard_normal((2 * H, d))).float()
    oracles = {}
    for coefficients, window, sinks, routed in (("int4", 0, 0, True), ("int8", 0, 0, True), ("float", 0, 0, False), ("int4", 5, 0, True), ("int8", 3, 2, True)):
        oracle = oracles[coefficients, window] = sr.SubspaceState.static(basis, coefficients=coefficients, group_size=16, window=window, sinks=sinks)
        oracle.append(keys, values)
        state = oracle.to("torch", dtype=torch.float32)
        first = sr.attend(q, state, backend="torch")
        assert list(state.admitted.values()) == [cpu_kernels.kernel_attend if routed else None], coefficients
        general = sr.get_backend("torch").attend(q[None], state, None)[0]
        assert torch.equal(first, general) and torch.equal(sr.attend(q, state, backend="torch"), general)
        out64 = sr.attend(q.double().numpy(), oracle)
        assert np.abs(first.double().numpy() - out64).max() <= tolerance(reference_error(oracle, q.double().numpy()[None], None, out64[None], "float32"), out64, "float32")
    state = oracles["int4", 0].to("torch", dtype=torch.float32)
    sr.attend(q, state, backend="torch")
    assert list(state.admitted.values()) == [cpu_kernels.kernel_attend]
    state.layout = replace(state.layout, key_coef=_strided(state.layout.key_coef))
    assert cpu_kernels.kernel_attend(q, state, None) is None
    torch.testing.assert_close(sr.attend(q, state, backend="torch"), sr.get_backend("torch").attend(q[None], state, None)[0])


def test_each_call_returns_its_own_output():
    """The kernels' outputs are handed out from blocks allocated several at a time
    (``KernelCall._output``): an output kept across later calls (a decode loop stacking its
    steps) must keep its values, no two calls may share memory, and an output of a call
    outside inference mode must take in-place updates there although earlier calls ran in
    inference mode."""
    if not kernel_library.library_status()[0]:
        pytest.skip(f"CPU kernels unavailable: {kernel_library.library_status()[1]}")
    rng = np.random.default_rng(29 + SEED_OFFSET)
    state = _state("int4", 40, 0, (11, 9), rng).to("torch", dtype=torch.float32)
    queries = [torch.from_numpy(rng.standard_normal((2, 3, 96))).float() for _ in range(2 * cpu_kernels.OUTPUTS_PER_BLOCK + 1)]
    with torch.inference_mode():
        outs = [sr.attend(q, state, backend="torch") for q in queries]
    outside = sr.attend(queries[1], state, backend="torch")
    assert not outside.is_inference()
    outside += 1.0
    kept = [out.clone() for out in outs]
    for _ in range(cpu_kernels.OUTPUTS_PER_BLOCK):
        sr.attend(queries[0], state, backend="torch")
    for out, want, q in zip(outs, kept, queries):
        assert torch.equal(out, want) and torch.equal(out, sr.get_backend("torch").attend(q, state, None))
    assert len({out.data_ptr() for out in outs}) == len(outs)


@pytest.mark.parametrize("group_size", [16, 32, 24])
@pytest.mark.usefixtures("either_library")
def test_int4_keys_of_sixteen_byte_rows_within_the_derived_tolerance(group_size):
    """Int4 keys of r = 32 (16-byte rows: the in-register chunks of the logits) and one query
    head per KV head, the decode case of docs/benchmarks.md, at the default group of 32 tokens
    and at groups of 16 and 24: every build within the derived tolerance over three value tiles
    and a partial key group."""
    rng = np.random.default_rng(zlib.crc32(repr(("lanes", group_size)).encode()) + SEED_OFFSET)
    H, d, r, r_v = 3, 96, 32, 32
    B = np.linalg.qr(rng.standard_normal((H, d, r)))[0].transpose(0, 2, 1)
    E = np.linalg.qr(rng.standard_normal((H, d, r_v)))[0].transpose(0, 2, 1)
    state = sr.SubspaceState.static(sr.StaticBasis.from_bases(B, E), coefficients="int4", group_size=group_size, batch=2)
    state.append(rng.standard_normal((2, H, 2100, d)) * 3, rng.standard_normal((2, H, 2100, d)))
    q = rng.standard_normal((2, H, d)) * 2
    out64 = sr.attend(q, state)
    got = sr.attend(torch.from_numpy(q).float(), state.to("torch", dtype=torch.float32), backend="torch").double().numpy()
    assert np.abs(got - out64).max() <= tolerance(reference_error(state, q, None, out64, "float32"), out64, "float32")


#: the rotations of the pre-RoPE kernel tests: Llama's rotate-half over every dim, and GPT-J's
#: interleaved planes over 80 of 96 dims (partial rotary: 8 fixed dims) with an attention scaling
ROTATIONS = {
    "half": lambda: RopeParams(1.0 / 10000.0 ** (np.arange(0, 96, 2) / 96)),
    "interleaved-partial-scaled": lambda: RopeParams(1.0 / 500.0 ** (np.arange(0, 80, 2) / 80), layout="interleaved", attention_scaling=1.2),
}


@pytest.mark.parametrize("coefficients", ["float", "int8", "int4", "int2"])
@pytest.mark.parametrize(
    "rotation, ranks", [("half", (32, 16)), ("interleaved-partial-scaled", (11, 9))], ids=["half-r32-16", "interleaved-partial-scaled-r11-9"]
)
@pytest.mark.parametrize("exact", [(0, 0), (4, 16)], ids=["compressed-only", "sinks-and-window"])
@pytest.mark.usefixtures("either_library")
def test_pre_rope_attend_within_the_derived_tolerance(coefficients, rotation, ranks, exact, monkeypatch):
    """Spec/rope.md P3 in the kernels (coefficient_attention with a rope_keys): each key rebuilt
    from its codes, turned to its position and dotted, in one call with the softmax and value
    sums. T = 1100: 69 blocks of 16 positions, so the blocks' base angles run past a reseed
    (every 64 blocks), and a trailing partial key group read from the float tail. Float
    coefficients are read as float32 rows. With sinks
    the compressed tokens sit at positions S.. (spec/window.md W10) and the exact tokens share
    the softmax (W3). Ranks 32 / 16 take the whole-vector rows, 11 / 9 rows that end inside a
    byte. Every build within the derived tolerance of the float64 oracle."""
    sinks, window = exact
    rng = np.random.default_rng(zlib.crc32(repr(("rope", coefficients, rotation, exact)).encode()) + SEED_OFFSET)
    H, d, T = 3, 96, 1100
    r, r_v = ranks
    B = np.linalg.qr(rng.standard_normal((H, d, r)))[0].transpose(0, 2, 1)
    E = np.linalg.qr(rng.standard_normal((H, d, r_v)))[0].transpose(0, 2, 1)
    basis = sr.StaticBasis.from_bases(B, E)
    state = sr.SubspaceState.static(basis, coefficients=coefficients, group_size=16, rope=ROTATIONS[rotation](), sinks=sinks, window=window, batch=2)
    state.append(rng.standard_normal((2, H, T, d)) * 3, rng.standard_normal((2, H, T, d)))
    q = rng.standard_normal((2, 2 * H, d)) * 2
    out64 = sr.attend(q, state)
    calls = []
    real = cpu_kernels.KernelCall.__call__
    monkeypatch.setattr(cpu_kernels.KernelCall, "__call__", lambda self, *a, **k: calls.append(self.rope) or real(self, *a, **k))
    got = sr.attend(torch.from_numpy(q).float(), state.to("torch", dtype=torch.float32), backend="torch").double().numpy()
    assert len(calls) == 1 and calls[0] is not None  # the kernels served it, keys rotated
    err = float(np.abs(got - out64).max())
    assert err <= tolerance(reference_error(state, q, None, out64, "float32"), out64, "float32")


# ---------------------------------------------------------------- stores (kernels/quantized_stores.c)

def _coordinate_state(coefficients: str, rank: int, group: int) -> sr.SubspaceState:
    """A float32 torch state, one sequence, 2 KV heads, d = 40, whose bases are the first
    ``rank`` coordinate axes: a token's coefficients are its first ``rank`` entries exactly (a
    matmul with 0 / 1 weights rounds nothing), so that a test sets the numbers quantised."""
    H, d = 2, 40
    B = np.broadcast_to(np.eye(d)[:rank], (H, rank, d)).copy()
    state = sr.SubspaceState.static(sr.StaticBasis.from_bases(B, B), coefficients=coefficients, group_size=group)
    return state.to("torch", dtype=torch.float32)


def _edge_tokens(rng, n: int, rank: int) -> np.ndarray:
    """(2, n, 40) float32 tokens whose coefficients stress spec Q1's roundings: magnitudes from
    1e-9 to 6.5e4, all-zero and constant rows, minima on float16 values, on midpoints between
    two (ties of the rounding to nearest, then the step down) and on float16's subnormals, and
    the range's ends +-65504, and rows whose int8 codes c / s fall on ties."""
    halves = rng.integers(1, 0x7BFF, size=4096).astype(np.uint16).view(np.float16).astype(np.float64)
    upper = np.nextafter(halves.astype(np.float16), np.float16(np.inf)).astype(np.float64)
    special = np.concatenate([halves, (halves + upper) / 2, np.arange(1, 1100) * 2.0**-24, [65504.0, 6.0e4]])
    x = np.zeros((2, n, 40))
    for h in range(2):
        for t in range(n):
            kind = rng.integers(8)
            if kind == 0:
                continue  # zeros: scale 0
            if kind == 1:
                x[h, t, :rank] = rng.choice(special) * rng.choice([-1, 1])  # constant
                continue
            row = rng.standard_normal(rank) * 10.0 ** rng.uniform(-9, 4.5)
            if kind == 2:  # int8 ties: max 127 2^e, so s = 2^e and c / s = m + 1/2
                row = np.concatenate([[127.0], rng.integers(-126, 126, rank - 1) + 0.5]) * 2.0 ** rng.integers(-20, 8) * rng.choice([-1, 1])
            if kind >= 5:  # the minimum on a special value, the others above it
                row = rng.choice(special) * rng.choice([-1, 1]) + np.abs(row)
            x[h, t, :rank] = np.clip(row, -65504, 65504)
    return x.astype(np.float32)


def _stored(state) -> dict:
    """Every array a low-bit store writes; of the key tail, the rows holding keys (the rest is
    never read: the oracle's fresh tail is the old one times 0, whose zeros may be negative)."""
    lay = state.layout
    if not lay.low_bits:
        return {name: getattr(lay, name).clone() for name in ("key_coef", "key_scale", "value_coef", "value_scale")} | {"num_tokens": lay.num_tokens}
    names = ("key_coef", "key_group_scale", "key_group_zero", "value_coef", "value_token_scale", "value_token_zero")
    live_tail = lay.key_tail[:, :, : lay.num_tokens % lay.group]
    return {name: getattr(lay, name).clone() for name in names} | {"key_tail": live_tail.clone(), "num_tokens": lay.num_tokens}


@pytest.mark.parametrize("coefficients", ["int8", "int4", "int2"])
@pytest.mark.parametrize("rank", [11, 32], ids=["r11", "r32"])
@pytest.mark.usefixtures("either_library")
def test_low_bit_stores_write_the_oracles_bits(coefficients, rank, monkeypatch):
    """Spec A10's and Q2's stores by the kernels (``kernel_stores.store_quantized`` after a block's
    matmul, ``kernel_stores.static_append`` for a decode step's few tokens: what a CPU state's
    appends use) against the array operations (``subspace_ref.quantization.quantize_rows``, the oracle's
    ``quantization.store_low_bit``) on the same tokens:
    every code, scale, zero point and tail row the same bits, appended one token at a time across
    a key group's end, as a block completing two groups, and after it, at a rank ending inside a
    byte (11) and a whole one; edge values (_edge_tokens) decide the roundings (int8: ties of
    c / s)."""
    rng = np.random.default_rng(zlib.crc32(repr((coefficients, rank)).encode()) + SEED_OFFSET)
    tokens = torch.from_numpy(_edge_tokens(rng, 62, rank))
    values = torch.from_numpy(_edge_tokens(rng, 62, rank))
    runs = {}
    for kernels in (True, False):
        if not kernels:
            monkeypatch.setattr(kernel_stores, "store_quantized", lambda *args: False)
            monkeypatch.setattr(kernel_stores, "static_append", lambda *args: False)
        state = _coordinate_state(coefficients, rank, 16)
        for a, b in [(t, t + 1) for t in range(20)] + [(20, 57)] + [(t, t + 1) for t in range(57, 62)]:
            state.append(tokens[:, a:b], values[:, a:b])
        runs[kernels] = _stored(state)
    for name, want in runs[False].items():
        got = runs[True][name]
        same = got == want if name == "num_tokens" else (got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)))
        assert same, name


@pytest.mark.parametrize("which", ["key", "value"])
def test_a_store_beyond_float16s_range_raises_and_changes_nothing(which):
    """Coefficients over 65504 have no float16 scale: the kernels' store raises the oracle's
    ValueError before writing anything (keys: when their group completes, as the oracle's), and
    the state keeps every array and its token count."""
    if not kernel_library.library_status()[0]:
        pytest.skip(f"CPU kernels unavailable: {kernel_library.library_status()[1]}")
    state = _coordinate_state("int4", 8, 16)
    small = torch.ones(2, 15, 40)
    big = small.clone()
    big[1, 0, 2] = 7.0e4
    if which == "key":
        state.append(big, small)  # held in the float tail: no group complete yet
    before = _stored(state)
    with pytest.raises(ValueError, match=r"\|c\| <= 65504"):
        state.append(small[:, :1], big[:, :1] if which == "value" else small[:, :1])
    after = _stored(state)
    for name, want in before.items():
        assert (after[name] == want) if name == "num_tokens" else torch.equal(after[name], want), name


@pytest.mark.parametrize("coefficients", ["float", "int8", "int4", "int2"])
@pytest.mark.parametrize("rotation", [None, "half", "interleaved-partial-scaled"], ids=["post-rope", "half", "interleaved-partial-scaled"])
@pytest.mark.parametrize("exact", [(0, 0), (4, 16)], ids=["compressed-only", "sinks-and-window"])
@pytest.mark.usefixtures("either_library")
def test_decode_appends_in_the_kernels(coefficients, rotation, exact, monkeypatch):
    """Spec A6 by ``kernel_stores.static_append`` (a decode step's tokens: projection, for
    pre-RoPE keys the un-rotation from position S + t (spec/rope.md P2 step 1, spec/window.md
    W10), the stores), two sequences, one token at a time and in blocks of 3 and 16 after a
    prefill the torch path appends: against the same appends by the torch operations, every
    code, scale and tail entry the same but where a float32 rounding of the projection (the two
    sum in different orders) crosses a quantiser boundary -- at most 1 in 200 -- or moves a scale
    or zero point by a float16 (or float32) step, float coefficients within 1e-5 of the largest --
    and against the
    float64 oracle the reconstruction within one quantiser step of the largest coefficient
    (as the harness's float32 appends: a rounding moves a code by one step)."""
    sinks, window = exact
    rng = np.random.default_rng(zlib.crc32(repr(("append", coefficients, rotation, exact)).encode()) + SEED_OFFSET)
    H, d, r, r_v = 3, 96, 24, 13
    B = np.linalg.qr(rng.standard_normal((H, d, r)))[0].transpose(0, 2, 1)
    E = np.linalg.qr(rng.standard_normal((H, d, r_v)))[0].transpose(0, 2, 1)
    rope = None if rotation is None else ROTATIONS[rotation]()
    oracle = sr.SubspaceState.static(sr.StaticBasis.from_bases(B, E), coefficients=coefficients, group_size=16, rope=rope, sinks=sinks, window=window, batch=2)
    keys, values = rng.standard_normal((2, H, 130, d)) * 3, rng.standard_normal((2, H, 130, d))
    blocks = [(0, 60)] + [(t, t + 1) for t in range(60, 100)] + [(100, 103), (103, 119)] + [(t, t + 1) for t in range(119, 130)]
    served = []
    real = kernel_stores.static_append
    runs = {}
    for kernels in (True, False):
        if kernels:
            monkeypatch.setattr(kernel_stores, "static_append", lambda *a: served.append(real(*a)) or served[-1])
        else:
            monkeypatch.setattr(kernel_stores, "static_append", lambda *a: False)
        state = oracle.to("torch", dtype=torch.float32)
        for a, b in blocks:
            state.append(torch.from_numpy(keys[:, :, a:b]).float(), torch.from_numpy(values[:, :, a:b]).float())
        runs[kernels] = state
    assert served.count(True) == len(blocks) - 1  # every block but the prefill, in the kernels
    for a, b in blocks:
        oracle.append(keys[:, :, a:b].astype(np.float32).astype(np.float64), values[:, :, a:b].astype(np.float32).astype(np.float64))
    if coefficients == "float":  # float32 rows as projected: the two sums' rounding apart
        for name in ("key_coef", "value_coef"):
            x, y = (getattr(runs[k].layout, name)[:, :, : runs[k].num_tokens].double() for k in (True, False))
            assert float((x - y).abs().max()) <= 1e-5 * float(y.abs().max()), name
    got, want = ({}, {}) if coefficients == "float" else (_stored(runs[True]), _stored(runs[False]))
    for name in want:
        if name == "num_tokens":
            assert got[name] == want[name]
            continue
        if not got[name].is_floating_point():  # codes
            differ = float((got[name] != want[name]).double().mean())
            assert differ <= 1 / 200, (name, differ)
            continue
        # scales, zero points, tail rows: the coefficients' extremes and the coefficients themselves
        x, y = got[name].double(), want[name].double()
        assert bool(((x - y).abs() <= 2.0**-9 * y.abs()).all()), name
    step = {"float": 1e-4, "int8": 1 / 127, "int4": 2 / 15, "int2": 2 / 3}[coefficients]  # float: the harness's float32 appends
    for name, x, y in zip(("K_hat", "V_hat"), runs[True].reconstruct(), oracle.reconstruct()):
        err, largest = np.abs(np.asarray(x, dtype=np.float64) - y).max(), np.abs(y).max()
        assert err <= step * largest, (name, err, largest)
