"""The Triton kernels (spec A2, A3, A3.2; A6/A7 projection) and ``TritonBackend``.

Each kernel and its pure-torch ``*_reference`` run through the same test classes (the ``impl``
fixture), against the float64 NumPy oracle, at odd shapes: T not a multiple of the tile, ranks
that are not powers of two, d in {64, 80, 128}, GQA groups below and above 16, chunks of one
token, hundreds of chunks, splits that straddle chunks and chunks that straddle splits, empty
splits, spare capacity poisoned with NaN / -1.

Without a GPU the kernels run on Triton's CPU interpreter, at shapes small enough for it, twice:
as the backend launches them there (float32 products of the 16-bit parts, all of d at once), and
as a GPU would (``gpu-numerics``): the 16-bit tensor-core paths (``NATIVE16``, ``Q_NATIVE``,
``NATIVE``), the 32-column slices of d (``BLOCK_D``) and the GPU's float32 -> bfloat16 rounding,
with the interpreter's bfloat16 ``tl.dot`` (which multiplies the bit patterns) and its truncating
bfloat16 cast replaced for the test by what the hardware computes (:func:`gpu_numerics`), so the
first GPU run is not the first execution of that arithmetic. When
no CUDA device is present and TRITON_INTERPRET is not set, this module sets it while it imports
the kernels (Triton reads it when a kernel is decorated) and around each of its own tests, and
restores the environment otherwise, so other test modules see the environment they were given.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.triton_interpreter import _interpreter_environment, load_kernels  # noqa: F401  (an autouse fixture)

torch = pytest.importorskip("torch")
_AVAILABLE, DEVICE, (_tl, decode, project) = load_kernels("_tl", "decode", "project")

import subspace_ref as sr  # noqa: E402
from subspace_ref.formats import MIXED_FORMATS  # noqa: E402
from subspace_ref.layout import PackedLayout  # noqa: E402
from subspace_ref.numpy_backend import attend_reference  # noqa: E402
from subspace_ref.policies.online_run import relative_residual  # noqa: E402
from subspace_ref.policies import AdaptivePolicy  # noqa: E402
from subspace_ref.state import SubspaceState  # noqa: E402
from subspace_ref_triton import TritonBackend  # noqa: E402
from subspace_ref_triton import backend as backend_module  # noqa: E402
from subspace_ref_triton._common import interpreting  # noqa: E402
from tests.differential.tolerance import reference_error  # noqa: E402
from tests.triton_numerics import gpu_numerics  # noqa: E402

pytestmark = pytest.mark.skipif(not _AVAILABLE, reason=f"triton backend unavailable: {_AVAILABLE.reason}")



DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _t(x, dtype=torch.float64):
    return torch.as_tensor(np.ascontiguousarray(x)).to(device=DEVICE, dtype=dtype)


def _f64(x) -> np.ndarray:
    return x.detach().to("cpu", torch.float64).numpy()


# ------------------------------------------------------------------------------- layouts


def random_layout(rng, N, H, T, d, d_v, r, r_v, starts, dtype, gamma=None, zero_rows=True, int8=False, scale_spread=0.0):
    """A torch layout (spec A9) over the given chunk starts, one list per (sequence, head) in
    order, with spare capacity (3 rows, 2 chunk slots) poisoned: NaN coefficients and bases
    (int8: NaN scales), chunk starts -1. ``int8``: coefficients quantised per token (spec A10),
    token magnitudes spread over 10^(+-scale_spread). Returns (torch layout, float64 NumPy layout
    of the same rounded values)."""
    J = max(len(s) for s in starts)
    Jc, Tc = J + 2, T + 3
    key_coef = rng.standard_normal((N, H, Tc, r))
    value_coef = rng.standard_normal((N, H, Tc, r_v))
    key_bases = np.swapaxes(np.linalg.qr(rng.standard_normal((N, H, Jc, d, r)))[0], -1, -2).copy()
    value_bases = np.swapaxes(np.linalg.qr(rng.standard_normal((N, H, Jc, d_v, r_v)))[0], -1, -2).copy()
    if zero_rows and r > 1:  # per-head ranks: zero rows pad head 0 (spec A9)
        key_bases[:, 0, :, r - 1] = 0
        key_coef[:, 0, :, r - 1] = 0
    chunk_starts = np.full((N, H, Jc), -1, dtype=np.int64)
    num_chunks = np.zeros((N, H), dtype=np.int64)
    for i, s in enumerate(starts):
        n, h = divmod(i, H)
        chunk_starts[n, h, : len(s)] = s
        num_chunks[n, h] = len(s)
        key_bases[n, h, len(s) :] = np.nan
        value_bases[n, h, len(s) :] = np.nan
    gamma = rng.uniform(0.5, 1.5, H) if gamma is None else np.broadcast_to(gamma, (H,))
    tdt = DTYPES[dtype]
    scales = {}
    if int8:
        from subspace_ref.quantization import quantize_rows

        coefs = []
        for x in (key_coef, value_coef):
            x = x[:, :, :T] * 10.0 ** rng.uniform(-scale_spread, scale_spread, (N, H, T, 1))
            q, s = quantize_rows(x)
            coefs.append(np.concatenate([q, np.full((N, H, Tc - T, x.shape[-1]), 127, np.int8)], axis=2))
            scales[len(scales)] = np.concatenate([s, np.full((N, H, Tc - T), np.nan, np.float32)], axis=2)
        key_coef, value_coef = coefs
        scales = dict(key_scale=_t(scales[0], torch.float32), value_scale=_t(scales[1], torch.float32), key_format="int8", value_format="int8")
        cdt = torch.int8
    else:
        key_coef[:, :, T:] = np.nan
        value_coef[:, :, T:] = np.nan
        cdt = tdt
    lay = PackedLayout(
        _t(key_coef, cdt),
        _t(value_coef, cdt),
        _t(key_bases, tdt),
        _t(value_bases, tdt),
        _t(chunk_starts, torch.int64),
        _t(num_chunks, torch.int64),
        _t(gamma, tdt),
        T,
        **scales,
    )
    lay64 = lay.map_arrays(lambda _, x: x.cpu().to(torch.float64).numpy() if x.is_floating_point() else x.cpu().numpy())
    return lay, lay64


def numpy_state(lay64: PackedLayout, work=np.float64) -> SubspaceState:
    """A NumPy state over a float64 layout's values, in ``work``."""
    N, H = lay64.key_coef.shape[:2]
    r, r_v = lay64.key_coef.shape[3], lay64.value_coef.shape[3]
    lay = lay64.map_arrays(lambda _, x: x.astype(work) if x.dtype.kind == "f" else x)
    policy = AdaptivePolicy((r,) * H, (r_v,) * H, r + 1, r_v + 1, 0.5, 0.5, 10**9, 0)
    return SubspaceState(policy, lay, None, True, "numpy")


def oracle(q64: np.ndarray, lay64: PackedLayout, scale: float | None, work=np.float64) -> np.ndarray:
    """The NumPy oracle (spec A3) over a float64 layout, computed in ``work``."""
    return attend_reference(q64.astype(work), numpy_state(lay64, work), scale).astype(np.float64)


def make_q(rng, N, Hq, d, lay64, max_logit=None, scale=None):
    """Queries, optionally rescaled so that the largest |logit| equals ``max_logit``."""
    q = rng.standard_normal((N, Hq, d))
    if max_logit is not None:
        H = lay64.key_coef.shape[1]
        g = Hq // H
        s = 1 / np.sqrt(d) if scale is None else scale
        big = 0.0
        for n in range(N):
            for h in range(H):
                for j in range(int(lay64.num_chunks[n, h])):
                    a = int(lay64.chunk_starts[n, h, j])
                    b = int(lay64.chunk_starts[n, h, j + 1]) if j + 1 < lay64.num_chunks[n, h] else lay64.num_tokens
                    qt = q[n, h * g : (h + 1) * g] @ lay64.key_bases[n, h, j].T
                    big = max(big, np.abs(lay64.gamma[h] * s * qt @ lay64.key_coef[n, h, a:b].T).max(initial=0.0))
        q *= max_logit / big
    return q


def chunked(T: int, *cuts: int) -> list[int]:
    return sorted({0, *[c for c in cuts if 0 < c < T]})


# (name, N, H, group, T, d, d_v, r, r_v, starts per (n, h), split_len, num_splits)
DECODE_CASES = [
    ("d64-static-oddT", 2, 2, 4, 150, 64, 64, 5, 7, [[0]] * 4, None, None),
    ("d64-static-split40", 1, 2, 4, 150, 64, 64, 5, 7, [[0]] * 2, 40, None),
    ("d80-straddle", 1, 2, 3, 97, 80, 80, 12, 9, [chunked(97, 1, 2, 30, 64, 65, 96), chunked(97, 50)], 16, None),
    ("d128-gqa1", 2, 1, 1, 70, 128, 128, 32, 17, [chunked(70, 33), [0]], None, None),
    ("dv-differs", 1, 1, 2, 45, 64, 80, 6, 10, [chunked(45, 20)], 32, None),
    ("one-token-chunks", 1, 1, 2, 24, 64, 64, 3, 3, [list(range(24))], 7, None),
    ("hundreds-of-chunks", 1, 1, 2, 300, 64, 64, 4, 6, [sorted({0, *range(0, 300, 2), *range(1, 120, 3)})], 128, None),
    ("gqa20-padded-to-32", 1, 1, 20, 33, 64, 64, 8, 8, [chunked(33, 16)], None, None),
    ("empty-splits", 1, 2, 2, 20, 64, 64, 5, 5, [chunked(20, 3), chunked(20, 17)], 16, 5),
    ("T1", 1, 1, 4, 1, 80, 80, 3, 2, [[0]], None, None),
]
DECODE_IDS = [c[0] for c in DECODE_CASES]




def _as_on_gpu(launch):
    """``launch`` with the constexprs a GPU launch has where the interpreter's differ."""
    c = launch.constexprs
    sixteen = (torch.float16, torch.bfloat16)
    if "PARTS" in c:  # decode split kernel: q (arg 0) and the key bases (arg 3)
        c.update(NATIVE16=c["PARTS"] > 1, Q_NATIVE=c["PARTS"] > 1 and launch.args[0].dtype == launch.args[3].dtype, BLOCK_D=min(32, c["D"]))
    if "NATIVE" in c:  # projection: keys (arg 0) and key bases (arg 2)
        c.update(
            NATIVE=launch.args[0].dtype == launch.args[2].dtype and launch.args[0].dtype in sixteen,
            BLOCK_DK=min(32, c["D"]),
            BLOCK_DV=min(32, c["DV"]),
            MANUAL_BF16_K=False,
            MANUAL_BF16_V=False,
        )
    if "MANUAL_BF16" in c:
        c["MANUAL_BF16"] = False
    launch.run()


def gpu_partials(q, layout, scale, split_len, num_splits=None):
    launch, out = decode.split_launch(q, layout, scale, split_len, num_splits)
    _as_on_gpu(launch)
    return out


def gpu_merge(m, z, o, dtype):
    launch, out = decode.merge_launch(m, z, o, dtype)
    _as_on_gpu(launch)
    return out


def gpu_attend(q, layout, scale=None, split_len=None, num_splits=None):
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else float(scale)
    if split_len is None:
        split_len = decode.default_split_len(int(layout.num_tokens), q.shape[0] * layout.key_coef.shape[1], q.device)
    return gpu_merge(*gpu_partials(q, layout, scale, split_len, num_splits), q.dtype)


def gpu_project(keys, values, key_bases, value_bases, chunk, out_key, out_value, residuals=False, out_key_scale=None, out_value_scale=None, out_row=None):
    launch, rho = project.project_launch(keys, values, key_bases, value_bases, chunk, out_key, out_value, residuals, out_key_scale, out_value_scale, out_row)
    if launch is not None:
        _as_on_gpu(launch)
    return rho


@pytest.fixture(params=["kernel", "gpu-numerics", "reference"])
def impl(request):
    """The Triton kernels as launched here, as launched on a GPU (:func:`gpu_numerics`; on a GPU
    that is the plain kernel), or their pure-torch references: the same tests run against all."""
    if request.param == "kernel" or (request.param == "gpu-numerics" and not interpreting()):
        return dict(attend=decode.decode_attention, partials=decode.decode_partials, merge=decode.merge_partials, project=project.project_append)
    if request.param == "gpu-numerics":
        request.getfixturevalue("_interpreter_environment")
        stack = contextlib.ExitStack()
        stack.enter_context(gpu_numerics(request.getfixturevalue("monkeypatch")))
        request.addfinalizer(stack.close)
        return dict(attend=gpu_attend, partials=gpu_partials, merge=gpu_merge, project=gpu_project)
    return dict(
        attend=decode.decode_attention_reference,
        partials=decode.decode_partials_reference,
        merge=decode.merge_partials_reference,
        project=project.project_append_reference,
    )


class TestDecodeAttention:
    """decode_attention (spec A3 with the flash-decoding split of A3.2) against the oracle."""

    @staticmethod
    def _run(impl, rng, case, dtype="float32", q_dtype=torch.float32, max_logit=None, scale=None, **layout_options):
        name, N, H, g, T, d, d_v, r, r_v, starts, split_len, num_splits = case
        lay, lay64 = random_layout(rng, N, H, T, d, d_v, r, r_v, starts, dtype, **layout_options)
        q64 = make_q(rng, N, H * g, d, lay64, max_logit, scale)
        q = _t(q64, q_dtype)
        q64 = _f64(q)  # the oracle sees the rounded queries
        out = impl["attend"](q, lay, scale, split_len=split_len, num_splits=num_splits)
        assert out.dtype == q_dtype and out.shape == (N, H * g, d_v) and out.device.type == DEVICE
        want = oracle(q64, lay64, scale)
        # The oracle's own float32 error sets the scale (summation order differs, nothing else):
        # the largest over equally valid roundings of the inputs (tests/differential/tolerance.py,
        # the harness's one rule: with large logits one rounding is a 2-10x lucky draw).
        err32 = reference_error(numpy_state(lay64), q64, scale, want, "float32")
        return _f64(out), want, err32

    @pytest.mark.parametrize("case", DECODE_CASES, ids=DECODE_IDS)
    def test_float32_matches_oracle(self, impl, rng, case):
        got, want, err32 = self._run(impl, rng, case)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=0, atol=4 * err32 + 1e-6 * np.abs(want).max())

    @pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
    @pytest.mark.parametrize("case", [DECODE_CASES[0], DECODE_CASES[2], DECODE_CASES[5]], ids=[DECODE_IDS[0], DECODE_IDS[2], DECODE_IDS[5]])
    def test_half_states_accumulate_in_float32(self, impl, rng, case, dtype):
        """16-bit coefficients and bases, float32 q: float32 accuracy on the rounded values
        (the kernel's hi/lo split products must not round q~ or the weights to 16 bits)."""
        got, want, err32 = self._run(impl, rng, case, dtype)
        np.testing.assert_allclose(got, want, rtol=0, atol=4 * err32 + 1e-6 * np.abs(want).max())

    @pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
    def test_huge_logits(self, impl, rng, dtype):
        """max |logit| = 1e4 with a float32 q over a 16-bit state: the running max keeps every
        exponent <= 0, and q~ is rescaled before being cut into float16 parts."""
        case = ("huge", 1, 2, 4, 90, 64, 64, 7, 5, [chunked(90, 10, 40), chunked(90, 70)], 32, None)
        got, want, err32 = self._run(impl, rng, case, dtype, max_logit=1e4, scale=0.3)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=0, atol=4 * err32 + 1e-6 * np.abs(want).max())

    @pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
    @pytest.mark.parametrize("case", [DECODE_CASES[2], DECODE_CASES[9]], ids=[DECODE_IDS[2], DECODE_IDS[9]])
    def test_int8_coefficients(self, impl, rng, case, dtype):
        """Spec A10: int8 coefficients with per-token scales, dequantised in the kernel; token
        magnitudes over 10^-3..10^3 (the value scales are folded into the weights, which are
        rescaled for the 16-bit parts)."""
        got, want, err32 = self._run(impl, rng, case, dtype, int8=True, scale_spread=3.0)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=0, atol=4 * err32 + 1e-6 * np.abs(want).max())

    @pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16])
    def test_output_has_q_dtype(self, impl, rng, q_dtype):
        dtype = "float16" if q_dtype == torch.float16 else "bfloat16"
        case = ("qdtype", 1, 1, 2, 50, 64, 64, 5, 5, [chunked(50, 25)], 16, None)
        got, want, _ = self._run(impl, rng, case, dtype, q_dtype=q_dtype)
        eps = 2.0**-10 if q_dtype == torch.float16 else 2.0**-7
        np.testing.assert_allclose(got, want, rtol=0, atol=eps * np.abs(want).max())


def poison_low_bit(lay, spare: int = 5):
    """``lay`` (a low-bit torch layout, spec/quantization.md Q2) with ``spare`` rows of capacity
    past T poisoned: codes 0xFF, NaN scales and zero points for every group that is not complete
    (the unfinished one included: its keys are in key_tail) and every spare token, NaN tail rows
    past the unfinished group's tokens. A kernel reading anything the spec does not let it read
    returns NaN."""
    T, G = int(lay.num_tokens), int(lay.group)
    lay = lay.with_capacity(T + spare, lay.key_bases.shape[2])
    lay.key_coef[:, :, T:] = 0xFF
    lay.value_coef[:, :, T:] = 0xFF
    lay.key_group_scale[:, :, T // G :] = float("nan")
    lay.key_group_zero[:, :, T // G :] = float("nan")
    lay.value_token_scale[:, :, T:] = float("nan")
    lay.value_token_zero[:, :, T:] = float("nan")
    tail = lay.key_tail.clone()
    tail[:, :, T - T // G * G :] = float("nan")
    lay.key_tail = tail
    return lay


# (name, kind, N, H, g, d, d_v, r, r_v, T, G, split_len): key groups with an unfinished tail,
# T below one group (the tail alone), tiles straddling groups (G = 24 is not a tile multiple),
# many chunks (adaptive, chunks of 16), splits straddling chunks and groups
LOW_BIT_CASES = [
    ("static-gqa4-tail", "static", 2, 2, 4, 64, 48, 7, 5, 45, 8, 16),
    ("static-tail_only", "static", 1, 2, 2, 32, 32, 6, 6, 5, 8, 16),
    ("static-G24-splits", "static", 1, 2, 2, 32, 32, 5, 4, 100, 24, 32),
    ("adaptive-chunks", "adaptive", 1, 2, 3, 32, 24, 4, 5, 70, 16, 32),
    # Q6's centred form (decode.centred_int4), int4/int2 read as 32-bit words (power-of-two ranks >= 8):
    # group-aligned tiles, splits that start inside a group, the tail after the coded groups (chunks: adaptive-chunks)
    ("static-G32-words-tail", "static", 1, 2, 4, 64, 48, 32, 16, 150, 32, 48),
    ("static-G16-words", "static", 1, 2, 2, 64, 64, 16, 16, 100, 16, 40),
]


def _coded_state(rng, case, coefficients: str):
    """The NumPy state of a low-bit or mixed-format case (name, kind, N, H, g, d, d_v, r, r_v, T,
    G, split_len): static bases or adaptive chunks (more than 2 per head), T tokens appended,
    key channels of very different sizes (per-channel scales matter: KIVI's outliers)."""
    name, kind, N, H, g, d, d_v, r, r_v, T, G, split_len = case
    if kind == "static":
        B = np.stack([np.linalg.qr(rng.standard_normal((d, r)))[0].T for _ in range(H)])
        E = np.stack([np.linalg.qr(rng.standard_normal((d_v, r_v)))[0].T for _ in range(H)])
        state = sr.SubspaceState.static(sr.StaticBasis.from_bases(B, E, rng.uniform(0.5, 1.5, H)), batch=N, coefficients=coefficients, group_size=G)
    else:
        state = sr.SubspaceState.adaptive(
            H, d, d_v, rank_k=r, rank_v=r_v, tau_k=0.6, tau_v=0.6, max_chunk=16, batch=N, coefficients=coefficients, group_size=G, gamma=rng.uniform(0.5, 1.5, H)
        )
    state.append(rng.standard_normal((N, H, T, d)) * 10.0 ** rng.uniform(-1, 1, d), rng.standard_normal((N, H, T, d_v)))
    if kind == "adaptive":
        assert state.layout.num_chunks.min() > 2
    return state


class TestLowBitDecode:
    """int4/int2 coefficients (spec/quantization.md Q1-Q2) unpacked and dequantised in the split
    kernel: keys from their group's codes (per channel scale and zero point) or from the float
    tail, values per token; states built by the oracle's append, compared with the float64
    oracle on the same state within the harness's derived tolerance (tests/differential/
    tolerance.py: FACTOR x the oracle's own error in the state's dtype, which reads the
    coefficients rounded to that dtype as the 16-bit kernels do, + the floor)."""

    @pytest.mark.parametrize("bits", ["int4", "int2"])
    @pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
    @pytest.mark.parametrize("case", LOW_BIT_CASES, ids=[c[0] for c in LOW_BIT_CASES])
    def test_matches_oracle(self, impl, rng, case, dtype, bits):
        from tests.differential.tolerance import tolerance

        name, kind, N, H, g, d, d_v, r, r_v, T, G, split_len = case
        state = _coded_state(rng, case, bits)
        lay = poison_low_bit(state.to("triton", device=DEVICE, dtype=dtype).layout)
        assert lay.low_bits == int(bits[3:]) and lay.key_coef.dtype == torch.uint8
        q = _t(rng.standard_normal((N, H * g, d)), torch.float32)
        state64 = state.to("numpy", dtype=np.float64)  # the state's own values: its dtype's tail, float16 scales
        q64 = _f64(q)
        want = attend_reference(q64, state64, None)
        out = impl["attend"](q, lay, None, split_len=split_len)
        got = _f64(out)
        assert np.isfinite(got).all()
        ref = reference_error(state64, q64, None, want, dtype)
        err = np.abs(got - want).max()
        assert err <= tolerance(ref, want, dtype), (err, ref)


CENTRED_CASES = [c for c in LOW_BIT_CASES if "words" in c[0]] + [
    # long splits: whole key groups two at a time (decode PAIRS), an odd whole group left over, edge tiles
    ("static-G16-words-pairs", "static", 1, 2, 4, 64, 48, 32, 16, 230, 16, 112),
    ("static-G16-words-pairs-g3", "static", 1, 1, 3, 32, 32, 16, 32, 200, 16, 72),
    ("static-G16-words-pairs-r32", "static", 1, 2, 4, 64, 64, 32, 32, 230, 16, 112),  # int2: 8-byte code rows (WIDE_CODES)
]


class TestCentredForms:
    """int4's and int2's centred form (spec/quantization.md Q6) in both product orientations of the split
    kernel: the tile's tokens on the MMA's M dimension (``TOKENS_M``, the default: interior tiles
    unmasked, the partial first and last tiles of a split masked after them) and the query heads on
    M (``split_launch(..., tokens_m=False)``, kept for timing). Same oracle and tolerance as
    :class:`TestLowBitDecode`; the splits of the cases start and end inside key groups."""

    @pytest.mark.parametrize("bits", ["int4", "int2"])
    @pytest.mark.parametrize("tokens_m", [True, False])
    @pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
    @pytest.mark.parametrize("case", CENTRED_CASES, ids=[c[0] for c in CENTRED_CASES])
    def test_matches_oracle(self, impl, rng, case, dtype, tokens_m, bits, monkeypatch):
        monkeypatch.setattr(decode, "TOKENS_M_DEFAULT", tokens_m)
        launches = []
        real = decode.split_launch

        def spy(*a, **kw):
            launch, out = real(*a, **kw)
            launches.append(launch.constexprs)
            return launch, out

        monkeypatch.setattr(decode, "split_launch", spy)
        TestLowBitDecode().test_matches_oracle(impl, rng, case, dtype, bits)
        assert launches or impl["attend"] is decode.decode_attention_reference
        assert all(c["CENTRED"] and c["TOKENS_M"] == tokens_m for c in launches)


def poison_sides(lay, spare: int = 5):
    """``lay`` (a torch layout whose sides may store different formats, spec/quantization.md Q0)
    with ``spare`` rows of capacity past T poisoned per side as its format stores it: float
    coefficients NaN; int8 codes 127 with NaN scales; int4/int2 as :func:`poison_low_bit`."""
    T = int(lay.num_tokens)
    lay = lay.with_capacity(T + spare, lay.key_bases.shape[2])
    for which in ("key", "value"):
        fmt = lay.side_format(which)
        coef = getattr(lay, f"{which}_coef")
        if fmt.low_bits:
            coef[:, :, T:] = 0xFF
            if which == "key":
                G = int(lay.group)
                lay.key_group_scale[:, :, T // G :] = float("nan")
                lay.key_group_zero[:, :, T // G :] = float("nan")
                tail = lay.key_tail.clone()
                tail[:, :, T - T // G * G :] = float("nan")
                lay.key_tail = tail
            else:
                lay.value_token_scale[:, :, T:] = float("nan")
                lay.value_token_zero[:, :, T:] = float("nan")
        elif fmt.per_token_scale:
            coef[:, :, T:] = 127
            getattr(lay, f"{which}_scale")[:, :, T:] = float("nan")
        else:
            coef[:, :, T:] = float("nan")
    return lay


# (name, kind, N, H, g, d, d_v, r, r_v, T, G, split_len): key groups and a float tail, several
# splits; many chunks (adaptive, chunks of 16); power-of-two ranks of 16 (the int4 words' shape)
MIXED_CASES = [
    ("static-gqa4-tail", "static", 2, 2, 4, 32, 24, 7, 5, 45, 8, 16),
    ("adaptive-chunks", "adaptive", 1, 2, 3, 32, 24, 4, 5, 70, 16, 32),
    ("static-G16-r16", "static", 1, 1, 2, 32, 32, 16, 16, 70, 16, 32),
]


class TestTileHelpers:
    """The split kernel's bit-level helpers (``subspace_ref_triton._tl``): on a GPU their compiled
    forms (``int8_as_f16``'s and ``exp2_ftz``'s inline PTX), here the interpreter's."""

    def test_split3_bits_int8_as_f16_and_exp2_ftz(self, rng):
        import triton
        import triton.language as tl

        @triton.jit
        def kernel(x_ptr, c_ptr, e_ptr, hi_ptr, mid_ptr, lo_ptr, f_ptr, p_ptr, N: tl.constexpr, INTERPRETED: tl.constexpr):
            offs = tl.arange(0, N)
            hi, mid, lo = _tl.split3_bits(tl.load(x_ptr + offs))
            tl.store(hi_ptr + offs, hi)
            tl.store(mid_ptr + offs, mid)
            tl.store(lo_ptr + offs, lo)
            tl.store(f_ptr + offs, _tl.int8_as_f16(tl.load(c_ptr + offs), INTERPRETED))
            tl.store(p_ptr + offs, _tl.exp2_ftz(tl.load(e_ptr + offs), INTERPRETED))

        n = 256
        x = rng.standard_normal(n) * 10.0 ** rng.uniform(-30, 30, n)
        x[:4] = [0.0, 1.0, -3.0e38, 2.0**-120]
        e = np.concatenate([[-np.inf, 0.0, -150.0], rng.uniform(-120, 20, n - 3)])
        xs = _t(x, torch.float32)
        outs = [torch.empty(n, dtype=torch.bfloat16, device=DEVICE) for _ in range(3)]
        f = torch.empty(n, dtype=torch.float16, device=DEVICE)
        p = torch.empty(n, dtype=torch.float32, device=DEVICE)
        codes = torch.arange(-128, 128, dtype=torch.int16).to(device=DEVICE, dtype=torch.int8)
        kernel[(1,)](xs, codes, _t(e, torch.float32), *outs, f, p, N=n, INTERPRETED=interpreting())
        assert np.array_equal(sum(_f64(o) for o in outs), _f64(xs))  # exact: 3 x 8 significant bits
        assert np.array_equal(_f64(f), np.arange(-128, 128))
        want = np.exp2(_f64(_t(e, torch.float32)))
        want[want < 2.0**-126] = 0.0  # flushed
        np.testing.assert_allclose(_f64(p), want, rtol=2.0**-21, atol=0)


class TestMixedDecode:
    """A format per side (spec/quantization.md Q0: every pair of float, int8, int4 and int2) read
    by the one split kernel, each side in its own format (``K_INT8``/``K_BITS`` and
    ``V_INT8``/``V_BITS``), against the float64 oracle on the same state within the harness's
    derived tolerance; the kernel as launched here, as on a GPU, and its torch reference."""

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    @pytest.mark.parametrize("coefficients", MIXED_FORMATS)
    @pytest.mark.parametrize("case", MIXED_CASES, ids=[c[0] for c in MIXED_CASES])
    def test_matches_oracle(self, impl, rng, case, coefficients, dtype):
        from tests.differential.tolerance import tolerance

        name, kind, N, H, g, d, d_v, r, r_v, T, G, split_len = case
        state = _coded_state(rng, case, coefficients)
        lay = poison_sides(state.to("triton", device=DEVICE, dtype=dtype).layout)
        assert lay.coefficients == coefficients and not lay.uniform
        q = _t(rng.standard_normal((N, H * g, d)), torch.float32)
        state64 = state.to("numpy", dtype=np.float64)
        q64 = _f64(q)
        want = attend_reference(q64, state64, None)
        got = _f64(impl["attend"](q, lay, None, split_len=split_len))
        assert np.isfinite(got).all()
        ref = reference_error(state64, q64, None, want, dtype)
        err = np.abs(got - want).max()
        assert err <= tolerance(ref, want, dtype), (err, ref)

    def test_one_split_launch_with_each_sides_format(self, rng):
        """The launch takes the key side's and the value side's formats apart (no uniform-only
        flag), and one split kernel serves the pair."""
        B = np.stack([np.linalg.qr(rng.standard_normal((16, 4)))[0].T])
        state = sr.SubspaceState.static(sr.StaticBasis.from_bases(B, B, [1.0]), coefficients="int2/int8", group_size=8)
        state.append(rng.standard_normal((1, 20, 16)), rng.standard_normal((1, 20, 16)))
        lay = state.to("triton", device=DEVICE, dtype="float32").layout
        launch, _ = decode.split_launch(_t(rng.standard_normal((1, 2, 16)), torch.float32), lay, 0.25, 64)
        c = launch.constexprs
        assert (c["K_INT8"], c["K_BITS"], c["V_INT8"], c["V_BITS"], c["CENTRED"]) == (False, 2, True, 0, False)


def _layer_groups_tolerance(layer, q64, dtype):
    """Per head group of a LayerState, the oracle's output rows and the harness's tolerance
    (tests/differential/tolerance.py) for them, in the layer's query-head order."""
    from subspace_ref.layer_state import query_rows
    from tests.differential.tolerance import tolerance

    g = q64.shape[-2] // layer.kv_heads
    rows, _ = query_rows(layer.groups, g)
    out = []
    for group, idx in zip(layer.groups, rows):
        qg = q64[:, idx]
        want = attend_reference(qg, group.state, None)
        out.append((idx, want, tolerance(reference_error(group.state, qg, None, want, dtype), want, dtype)))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_state_with_mixed_groups_attends_on_triton(rng, dtype):
    """A LayerState (spec/layer_state.md) whose head groups store a format per side (int4 keys /
    int8 values pre-RoPE, int2 / int4 identity bases, float / int2) attends on the triton
    backend, one split launch per group, each group within the harness tolerance of the oracle
    over the same (converted) state."""
    from subspace_ref.calibration import StaticBasis
    from subspace_ref.layer_state import HeadConfig, LayerState
    from subspace_ref.rope import RopeParams

    D, DV, G, H, T, g = 16, 12, 8, 4, 45, 2
    configs = [
        HeadConfig(5, 4, "int4", "int8", "pre_rope"),
        HeadConfig(D, DV, "int2", "int4", "identity", "identity"),
        HeadConfig(5, 4, "int4", "int8", "pre_rope"),
        HeadConfig(7, DV, "float", "int2", "post_rope", "identity"),
    ]
    B = np.stack([np.linalg.qr(rng.standard_normal((D, D)))[0].T for _ in range(H)])
    E = np.stack([np.linalg.qr(rng.standard_normal((DV, DV)))[0].T for _ in range(H)])
    rope = RopeParams(1.0 / 50.0 ** (np.arange(0, D, 2) / D), "half", 1.0)
    layer = LayerState.from_heads(StaticBasis.from_bases(B, E, 1.0), configs, rope=rope, window=4, sinks=2, group_size=G)
    layer.append(rng.standard_normal((H, T, D)), rng.standard_normal((H, T, DV)))
    assert {grp.state.layout.coefficients for grp in layer.groups} == {"int4/int8", "int2/int4", "float/int2"}
    on_triton = layer.to("triton", device=DEVICE, dtype=dtype)
    assert all(not TritonBackend().not_supported_reasons(_t(np.zeros((1, 2 * len(grp.heads), D)), DTYPES[dtype]), grp.state) for grp in on_triton.groups)
    q = _t(rng.standard_normal((H * g, D)), torch.float32)
    got = _f64(sr.attend(q, on_triton, backend="triton"))
    assert got.shape == (H * g, DV) and np.isfinite(got).all()
    oracle = on_triton.to("numpy", dtype=np.float64)  # the layer's own values: its dtype's floats, float16 scales
    for idx, want, tol in _layer_groups_tolerance(oracle, _f64(q)[None], dtype):
        err = np.abs(got[idx] - want[0]).max()
        assert err <= tol, (idx, err, tol)


# (name, kind, N, H, g, d, d_v, T, sinks, window, min_tokens, coefficients, logit)
WINDOW_CASES = [
    ("static-sinks-window-d80-g5", "static", 2, 2, 5, 80, 48, 120, 3, 37, 0, "float", None),  # 37 recent: 3 tiles
    ("adaptive-window-int8-logits1e4", "adaptive", 1, 2, 2, 32, 32, 90, 0, 20, 0, "int8", 1e4),
    ("rotating-sinks-int4", "rotating", 1, 2, 3, 32, 24, 70, 5, 0, 0, "int4", None),
    ("static-below_min_tokens", "static", 1, 2, 2, 32, 32, 30, 2, 4, 100, "float", None),  # nothing compressed
]


class TestWindowDecode:
    """Exact tokens (spec/window.md W3 window, W7-W8 sinks): one A3.2 partial per exact segment
    (window_decode), merged with the compressed part's split partials, against the float64
    oracle on the same state within the harness's derived tolerance; the kernel and its torch
    reference."""

    @pytest.mark.parametrize("path", ["kernel", "gpu-numerics", "reference"])
    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    @pytest.mark.parametrize("case", WINDOW_CASES, ids=[c[0] for c in WINDOW_CASES])
    def test_matches_oracle(self, rng, case, dtype, path, monkeypatch):
        from subspace_ref_triton import window_decode

        from subspace_ref.basis_storage import decoded_state
        from tests.differential.tolerance import tolerance

        name, kind, N, H, g, d, d_v, T, sinks, window, min_tokens, coefficients, logit = case
        exact = dict(sinks=sinks, window=window, min_tokens=min_tokens, coefficients=coefficients, batch=N)
        if coefficients in ("int4", "int2"):
            exact["group_size"] = 8
        gamma = rng.uniform(0.5, 1.5, H)
        if kind == "static":
            B = np.stack([np.linalg.qr(rng.standard_normal((d, 6)))[0].T for _ in range(H)])
            E = np.stack([np.linalg.qr(rng.standard_normal((d_v, 5)))[0].T for _ in range(H)])
            state = sr.SubspaceState.static(sr.StaticBasis.from_bases(B, E, gamma), **exact)
        elif kind == "adaptive":
            state = sr.SubspaceState.adaptive(H, d, d_v, rank_k=5, rank_v=4, tau_k=0.6, tau_v=0.6, max_chunk=16, gamma=gamma, **exact)
        else:
            state = sr.SubspaceState.rotating(H, d, d_v, rank_k=5, rank_v=4, refresh_every=16, gamma=gamma, **exact)
        state.append(rng.standard_normal((N, H, T, d)), rng.standard_normal((N, H, T, d_v)))
        T_c = state.layout.num_tokens
        assert (T_c == 0) == (min_tokens > T) and state.window.recent == (window if T >= min_tokens else T - min(T, sinks))
        tstate = state.to("triton", device=DEVICE, dtype=dtype)
        q64 = rng.standard_normal((N, H * g, d))
        if logit is not None:  # |s q.k| reaches `logit` over the tokens (sinks, compressed, recent; gamma aside)
            K = state.reconstruct()[0]
            q64 *= logit / np.abs(np.einsum("nhgd,nhtd->nhgt", q64.reshape(N, H, g, d), K)).max() * np.sqrt(d)
        q = _t(q64, torch.float32)
        q64 = _f64(q)
        state64 = tstate.to("numpy", dtype=np.float64)
        want = attend_reference(q64, state64, None)
        layout = decoded_state(tstate).layout
        if path == "kernel" or (path == "gpu-numerics" and not interpreting()):
            got = window_decode.decode_attention(q, tstate, layout, None, decode.attention_partials)
        elif path == "gpu-numerics":  # the GPU's constexprs and 16-bit arithmetic (gpu_numerics), 32-column slices of d
            monkeypatch.setattr(window_decode, "interpreting", lambda: False)

            def compressed(q, lay, s):
                return gpu_partials(q, lay, s, decode.default_split_len(int(lay.num_tokens), q.shape[0] * H, q.device))

            with gpu_numerics(monkeypatch):
                got = window_decode.decode_attention(q, tstate, layout, None, compressed)
        else:
            got = window_decode.decode_attention_reference(q, tstate, layout, None)
        got = _f64(got)
        assert np.isfinite(got).all()
        ref = reference_error(state64, q64, None, want, dtype)
        assert np.abs(got - want).max() <= tolerance(ref, want, dtype), (np.abs(got - want).max(), ref)

    @pytest.mark.parametrize("block_d", [None, 32])
    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    @pytest.mark.parametrize("case", [c for c in WINDOW_CASES if c[1] == "static"], ids=[c[0] for c in WINDOW_CASES if c[1] == "static"])
    def test_workspace_step_with_the_exact_part_matches_oracle(self, rng, case, dtype, block_d):
        """The graph-capturable step of a windowed layer (spec/models.md M11.14 step 4): the
        workspace's split launch, then the merge launch with the exact part added
        (window_decode.exact_merge_launch), against the float64 oracle on the same state within
        the harness's tolerance. The exact tokens lie as a graph layer holds them: one array of
        sinks then recent slots, read up to min(count, slots) with the count the layer's whole T
        (beyond the slots when tokens were compressed; else slots past it hold garbage), and the
        group's KV head h at row 2 h + 1 of twice the heads (``heads``). Nothing compressed: the
        split partials are all empty."""
        from subspace_ref_triton import window_decode, workspace

        from subspace_ref.basis_storage import decoded_state
        from tests.differential.tolerance import tolerance

        name, kind, N, H, g, d, d_v, T, sinks, window, min_tokens, coefficients, logit = case
        B = np.stack([np.linalg.qr(rng.standard_normal((d, 6)))[0].T for _ in range(H)])
        E = np.stack([np.linalg.qr(rng.standard_normal((d_v, 5)))[0].T for _ in range(H)])
        state = sr.SubspaceState.static(sr.StaticBasis.from_bases(B, E, rng.uniform(0.5, 1.5, H)), sinks=sinks, window=window,
                                        min_tokens=min_tokens, batch=N)
        state.append(rng.standard_normal((N, H, T, d)), rng.standard_normal((N, H, T, d_v)))
        tstate = state.to("triton", device=DEVICE, dtype=dtype)
        win = tstate.window
        filled = win.sink_keys.shape[2] + win.keys.shape[2]
        garbage = 0 if tstate.layout.num_tokens else 5
        tdt = getattr(torch, dtype)

        def exact_array(sink, recent, width):
            rows = torch.full((N, 2 * H, filled + garbage, width), 1e4, dtype=tdt, device=DEVICE)  # what the count must hide
            rows[:, 1::2, :filled] = torch.cat([sink, recent], dim=2)
            return rows

        keys, values = exact_array(win.sink_keys, win.keys, d), exact_array(win.sink_values, win.values, d_v)
        q = _t(rng.standard_normal((N, H * g, d)), tdt)
        layout = decoded_state(tstate).layout
        ws = workspace.DecodeWorkspace(layout, H * g, tdt)
        count = torch.tensor(T, dtype=torch.int64, device=DEVICE)
        split, merge = ws.launches(q, exact=(keys, values, count, torch.arange(1, 2 * H, 2, device=DEVICE)))
        assert merge.kernel is window_decode._exact_merge_kernel
        if block_d is not None:
            merge.constexprs["BLOCK_D"] = block_d
        split.run()
        merge.run()
        got = _f64(ws.out)
        q64 = _f64(q)
        state64 = tstate.to("numpy", dtype=np.float64)
        want = attend_reference(q64, state64, None)
        ref = reference_error(state64, q64, None, want, dtype)
        assert np.isfinite(got).all() and np.abs(got - want).max() <= tolerance(ref, want, dtype), (np.abs(got - want).max(), ref)

    def test_exact_merge_is_the_merge_of_all_partials(self, rng):
        """exact_merge_launch equals the two launches it replaces: exact_launch's partial of the
        first ``count`` slots (garbage after them) of the group's KV heads (rows [2, 0] of 3) as
        one more column, then merge_launch over all columns. The split partials' maxima lie
        above and below the exact part's (one by 100: a reference taken from one part alone
        overflows), one column is empty and one row's every column (nothing compressed). The
        exact partials are bitwise the same (one helper); the merges differ in order only, each
        within (S + 8) u of sum_s a_s |N_s| / sum_s a_s Z_s (S + 1 products and sums, two
        exponentials rounded to a few ulp), so the two outputs within twice that."""
        from subspace_ref_triton import window_decode

        N, g, d, d_v, S, E, count = 2, 3, 40, 24, 5, 9, 7
        heads = torch.tensor([2, 0], device=DEVICE)
        H, Hq = heads.numel(), heads.numel() * g
        q = _t(rng.standard_normal((N, Hq, d)), torch.float32)
        keys = _t(rng.standard_normal((N, 3, E, d)), torch.float32)
        values = _t(rng.standard_normal((N, 3, E, d_v)), torch.float32)
        keys[:, :, count:], values[:, :, count:] = 1e4, 1e4  # what the count must hide
        own_k, own_v = keys[:, heads, :count].contiguous(), values[:, heads, :count].contiguous()
        top = (torch.einsum("nhgd,nhtd->nhgt", q.double().view(N, H, g, d), own_k.double()) * 0.3).amax(-1).reshape(N, Hq)  # the exact part's max
        offsets = _t(rng.choice([-2.0, 2.0], size=(N, Hq, S)), torch.float32)
        offsets[0, 0, 0] = 100.0
        pm = (top.float()[..., None] + offsets).contiguous()
        pz = _t(rng.uniform(0.5, 3.0, (N, Hq, S)), torch.float32)
        po = _t(rng.standard_normal((N, Hq, S, d_v)), torch.float32)
        pm[:, :, 1], pz[:, :, 1], po[:, :, 1] = float("-inf"), 0.0, 0.0  # an empty split
        pm[1, 2], pz[1, 2], po[1, 2] = float("-inf"), 0.0, 0.0  # a row with no compressed token
        out = torch.empty((N, Hq, d_v), device=DEVICE)
        window_decode.exact_merge_launch(q, keys, values, 0.3, (pm, pz, po), out, torch.tensor(count, device=DEVICE), heads).run()
        wide = tuple(torch.cat([x, torch.zeros_like(x[:, :, :1])], dim=2).contiguous() for x in (pm, pz, po))
        window_decode.exact_launch(q, own_k, own_v, 0.3, wide, S).run()
        want = decode.merge_partials(*wide, torch.float32)
        m = wide[0].double()
        a = torch.exp(m - m.amax(-1, keepdim=True))
        scale = (a[..., None] * wide[2].double().abs()).sum(2) / (a * wide[1].double()).sum(2)[..., None]
        bound = 2 * (S + 8) * 2.0**-24 * scale
        assert torch.isfinite(out).all() and ((out.double() - want.double()).abs() <= bound).all(), float((out - want).abs().max())

    def test_exact_merge_refuses_what_does_not_agree(self):
        """exact_merge_launch names the argument that does not fit, before any launch."""
        from subspace_ref_triton import window_decode

        q = torch.zeros(1, 4, 8, device=DEVICE)
        k = torch.zeros(1, 2, 3, 8, device=DEVICE)
        parts = (torch.zeros(1, 4, 2, device=DEVICE), torch.zeros(1, 4, 2, device=DEVICE), torch.zeros(1, 4, 2, 8, device=DEVICE))
        count = torch.tensor(3, device=DEVICE)
        with pytest.raises(ValueError, match="count must be a one-element int64"):
            window_decode.exact_merge_launch(q, k, k, 1.0, parts, torch.zeros(1, 4, 8, device=DEVICE), count.int())
        with pytest.raises(ValueError, match="do not agree"):
            window_decode.exact_merge_launch(q, k, k, 1.0, parts, torch.zeros(1, 4, 7, device=DEVICE), count)
        with pytest.raises(ValueError, match="keys must have a unit stride"):
            window_decode.exact_merge_launch(q, k.mT.contiguous().mT, k, 1.0, parts, torch.zeros(1, 4, 8, device=DEVICE), count)
        with pytest.raises(ValueError, match="do not agree"):  # values of other slots than the keys
            window_decode.exact_merge_launch(q, k, k[:, :, :2], 1.0, parts, torch.zeros(1, 4, 8, device=DEVICE), count)
        with pytest.raises(ValueError, match="partials must be contiguous float32"):
            wide = torch.zeros(1, 4, 3, device=DEVICE)[:, :, :2]
            window_decode.exact_merge_launch(q, k, k, 1.0, (wide, parts[1], parts[2]), torch.zeros(1, 4, 8, device=DEVICE), count)
        with pytest.raises(ValueError, match="heads must be a contiguous 1-D integer"):
            window_decode.exact_merge_launch(q, k, k, 1.0, parts, torch.zeros(1, 4, 8, device=DEVICE), count, torch.zeros(2, device=DEVICE))

    @pytest.mark.parametrize("block_d", [None, 32])
    def test_exact_partial_is_a_softmax_partial(self, rng, block_d):
        """One exact segment's (m, Z, N) of spec A3.2: m the largest logit s q.k, Z and N the sums
        of exp(l - m) and exp(l - m) v, every query head of the GQA group (g = 3 of 16 rows);
        d = 80 in one step (the interpreter's launch) or in 32-column slices (the GPU's)."""
        from subspace_ref_triton import window_decode

        N, H, g, d, d_v, n = 2, 2, 3, 80, 20, 19
        q = _t(rng.standard_normal((N, H * g, d)), torch.float32)
        k = _t(rng.standard_normal((N, H, n, d)), torch.float32)
        v = _t(rng.standard_normal((N, H, n, d_v)), torch.float32)
        out = tuple(torch.full(shape, 7.0, device=DEVICE) for shape in ((N, H * g, 2), (N, H * g, 2), (N, H * g, 2, d_v)))
        launch = window_decode.exact_launch(q, k, v, 0.3, out, 1)
        if block_d is not None:
            launch.constexprs["BLOCK_D"] = block_d
        launch.run()
        q4, k64, v64 = q.double().reshape(N, H, g, d), k.double(), v.double()
        logits = torch.einsum("nhgd,nhtd->nhgt", q4, k64) * 0.3
        m = logits.amax(-1)
        w = torch.exp(logits - m[..., None])
        # Forward error bounds of float32 arithmetic (Higham, Accuracy and Stability of Numerical
        # Algorithms, 3.1): a d-term dot product errs by at most gamma_d sum |q_i k_i|, gamma_n =
        # n u / (1 - n u), u = 2^-24; the logit's error is the weight's relative error (d exp(x) =
        # exp(x) dx), plus m's and the exponential's own (at most 8 u: ex2.approx on a GPU, libm
        # on the CPU); the sums of n weighted terms add gamma_n of their absolute sum.
        u = 2.0**-24

        def gamma(n):
            return n * u / (1 - n * u)

        logit_err = gamma(d) * torch.einsum("nhgd,nhtd->nhgt", q4.abs(), k64.abs()) * 0.3 + u * logits.abs()
        m_err = logit_err.amax(-1)
        w_rel = logit_err + m_err[..., None] + 8 * u
        z_err = (w * w_rel).sum(-1) + gamma(n) * w.sum(-1)
        o_err = (w * w_rel) @ v64.abs() + gamma(n) * (w @ v64.abs())
        assert ((out[0][:, :, 1].double() - m.reshape(N, H * g)).abs() <= m_err.reshape(N, H * g)).all()
        assert ((out[1][:, :, 1].double() - w.sum(-1).reshape(N, H * g)).abs() <= z_err.reshape(N, H * g)).all()
        assert ((out[2][:, :, 1].double() - (w @ v64).reshape(N, H * g, d_v)).abs() <= o_err.reshape(N, H * g, d_v)).all()
        assert (out[0][:, :, 0] == 7).all() and (out[2][:, :, 0] == 7).all()  # other columns untouched


class TestDecodePartials:
    """The per-split partials (m, Z, N) of spec A3.2, kernel against reference, and the merge."""

    @pytest.mark.parametrize("case", [DECODE_CASES[2], DECODE_CASES[5], DECODE_CASES[8]], ids=[DECODE_IDS[2], DECODE_IDS[5], DECODE_IDS[8]])
    def test_partials_agree(self, rng, case):
        name, N, H, g, T, d, d_v, r, r_v, starts, split_len, num_splits = case
        lay, _ = random_layout(rng, N, H, T, d, d_v, r, r_v, starts, "float32")
        q = _t(rng.standard_normal((N, H * g, d)), torch.float32)
        m, z, o = decode.decode_partials(q, lay, 0.2, split_len, num_splits)
        mr, zr, orr = decode.decode_partials_reference(q, lay, 0.2, split_len, num_splits)
        empty = torch.isinf(mr)
        assert torch.equal(torch.isinf(m), empty)  # empty splits: exactly the identity of A3.2
        assert torch.all(m[empty] < 0) and torch.all(z[empty] == 0) and torch.all(o[empty] == 0)
        torch.testing.assert_close(m[~empty], mr[~empty], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(z, zr, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o, orr, rtol=1e-5, atol=1e-5)
        if num_splits is not None:
            assert empty.any()

    @pytest.mark.parametrize("dtype,int8", [("float32", False), ("bfloat16", False), ("bfloat16", True)], ids=["float32", "bfloat16", "bfloat16-int8"])
    def test_every_partial_is_written(self, rng, dtype, int8):
        """The partials do not depend on what their buffers held: every entry is written, an empty
        split's as the identity (-inf, 0, 0), whether N is summed over a split's chunks in registers
        (float32 bases) or in its own row of the partial (16-bit bases; docs/gpu.md, "N in the
        partial"). Head 0's chunks hold 3 tokens, so its 16-token splits span six chunks."""
        name, N, H, g, T, d, d_v, r, r_v, _, split_len, num_splits = DECODE_CASES[DECODE_IDS.index("empty-splits")]
        starts = [list(range(0, T, 3)), chunked(T, 17)]
        lay, _ = random_layout(rng, N, H, T, d, d_v, r, r_v, starts, dtype, int8=int8)
        q = _t(rng.standard_normal((N, H * g, d)), getattr(torch, dtype))
        runs = []
        for fill in (float("nan"), 7.0):
            outs = (torch.full((N, H * g, num_splits), fill, device=DEVICE), torch.full((N, H * g, num_splits), fill, device=DEVICE),
                    torch.full((N, H * g, num_splits, d_v), fill, device=DEVICE))
            launch, outs = decode.split_launch(q, lay, 0.2, split_len, num_splits, outputs=outs)
            launch.run()
            runs.append(outs)
        for a, b in zip(*runs):
            assert torch.equal(a, b)
        m, z, o = runs[0]
        empty = torch.isinf(m)
        assert empty.any() and (~empty).any()
        assert torch.all(m[empty] < 0) and torch.all(z[empty] == 0) and torch.all(o[empty] == 0)

    def test_merge_handles_empty_partials(self, impl, rng):
        """S = 70 partials (two merge tiles), with empty ones: first, last, all but one."""
        N, Hq, S, d_v = 2, 3, 70, 20
        m = rng.normal(0, 5, (N, Hq, S))
        z = np.exp(rng.normal(0, 1, (N, Hq, S))) + 1.0
        o = rng.standard_normal((N, Hq, S, d_v))
        empty = rng.random((N, Hq, S)) < 0.3
        empty[0, 0] = True
        empty[0, 0, 37] = False  # one non-empty partial, in the second tile
        empty[1, 2, 0] = empty[1, 2, -1] = True
        m[empty], z[empty], o[empty] = -np.inf, 0.0, 0.0
        M = m.max(-1, keepdims=True)
        w = np.exp(m - M)
        want = (o * w[..., None]).sum(2) / (z * w).sum(2)[..., None]
        got = impl["merge"](_t(m, torch.float32), _t(z, torch.float32), _t(o, torch.float32), torch.float32)
        assert got.shape == (N, Hq, d_v)
        np.testing.assert_allclose(_f64(got), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(_f64(got)[0, 0], o[0, 0, 37] / z[0, 0, 37], rtol=1e-6)


class TestProjectAppend:
    """project_append (spec A6 step 1, A7 steps 1-2): coefficients written into views of the
    state's buffers, residuals against the oracle's relative_residual."""

    @pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
    @pytest.mark.parametrize("n_new", [1, 37])
    def test_projection_and_residuals(self, impl, rng, dtype, n_new):
        N, H, J, d, d_v, r, r_v, offset = 2, 3, 4, 80, 64, 5, 9, 10
        tdt = DTYPES[dtype]
        k = rng.standard_normal((N, H, n_new, d))
        v = rng.standard_normal((N, H, n_new, d_v))
        kb = np.swapaxes(np.linalg.qr(rng.standard_normal((N, H, J, d, r)))[0], -1, -2)
        vb = np.swapaxes(np.linalg.qr(rng.standard_normal((N, H, J, d_v, r_v)))[0], -1, -2)
        k[0, 1, 0] = 0.0  # a zero key: rho = 0
        chunk = rng.integers(0, J, (N, H))
        k[1, 2, -1] = kb[1, 2, chunk[1, 2]].T @ rng.standard_normal(r)  # in the span: rho ~ 0
        keys, values, key_bases, value_bases = _t(k, tdt), _t(v, tdt), _t(kb, tdt), _t(vb, tdt)
        buf_k = torch.full((N, H, offset + n_new + 4, r), float("nan"), dtype=tdt, device=DEVICE)
        buf_v = torch.full((N, H, offset + n_new + 4, r_v), float("nan"), dtype=tdt, device=DEVICE)
        rho = impl["project"](
            keys, values, key_bases, value_bases, _t(chunk, torch.int64), buf_k[:, :, offset : offset + n_new], buf_v[:, :, offset : offset + n_new], True
        )
        # only rows offset .. offset + n_new were written
        for buf in (buf_k, buf_v):
            assert torch.isnan(buf[:, :, :offset]).all() and torch.isnan(buf[:, :, offset + n_new :]).all()
        idx = np.arange(N)[:, None], np.arange(H)[None, :], chunk
        B, E = _f64(key_bases)[idx], _f64(value_bases)[idx]
        c64 = np.einsum("nhtd,nhrd->nhtr", _f64(keys), B)
        dv64 = np.einsum("nhtd,nhrd->nhtr", _f64(values), E)
        # float32 products, then one rounding to the buffer's dtype
        ulp = {"float32": 2.0**-22, "float16": 2.0**-10, "bfloat16": 2.0**-7}[dtype]
        for got, want in ((buf_k[:, :, offset : offset + n_new], c64), (buf_v[:, :, offset : offset + n_new], dv64)):
            np.testing.assert_allclose(_f64(got), want, rtol=ulp, atol=1e-5)
        rho_k, rho_v = (_f64(x) for x in rho)
        assert rho_k.dtype == np.float64 and rho[0].dtype == torch.float32 and rho[0].shape == (N, H, n_new)
        # residuals from the float32 coefficients: compare squares (cancellation near rho = 0)
        np.testing.assert_allclose(rho_k**2, relative_residual(_f64(keys), c64) ** 2, atol=2e-6)
        np.testing.assert_allclose(rho_v**2, relative_residual(_f64(values), dv64) ** 2, atol=2e-6)
        assert rho_k[0, 1, 0] == 0.0
        if dtype == "float32":  # (16-bit rounding moves the key out of the rounded basis' span)
            assert rho_k[1, 2, -1] < 3e-3

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_int8_outputs(self, impl, rng, dtype):
        """Spec A10 in the append: int8 coefficients and float32 scales, |c - s q| <= s / 2
        (A10.1) against the float64 projection, residuals from the unquantised coefficients."""
        N, H, n_new, d, r = 1, 2, 21, 64, 7
        tdt = DTYPES[dtype]
        keys = _t(rng.standard_normal((N, H, n_new, d)) * 10.0 ** rng.uniform(-3, 3, (N, H, n_new, 1)), tdt)
        keys[0, 1, 4] = 0.0  # a zero row: s = 0, q = 0
        bases = _t(np.swapaxes(np.linalg.qr(rng.standard_normal((N, H, 1, d, r)))[0], -1, -2), tdt)
        chunk = torch.zeros((N, H), dtype=torch.int64, device=DEVICE)
        out_k = torch.full((N, H, n_new + 2, r), 99, dtype=torch.int8, device=DEVICE)
        out_v = out_k.clone()
        s_k = torch.full((N, H, n_new + 2), float("nan"), device=DEVICE)
        s_v = s_k.clone()
        rho = impl["project"](
            keys, keys, bases, bases, chunk, out_k[:, :, 1:-1], out_v[:, :, 1:-1], True, out_key_scale=s_k[:, :, 1:-1], out_value_scale=s_v[:, :, 1:-1]
        )
        assert (out_k[:, :, [0, -1]] == 99).all() and torch.isnan(s_k[:, :, [0, -1]]).all()
        c64 = np.einsum("nhtd,nhrd->nhtr", _f64(keys), _f64(bases)[:, :, 0])
        q, s = _f64(out_k[:, :, 1:-1]), _f64(s_k[:, :, 1:-1])
        assert np.abs(q).max() <= 127 and (s >= 0).all() and s[0, 1, 4] == 0 and (q[0, 1, 4] == 0).all()
        np.testing.assert_allclose(s, np.abs(c64).max(-1) / 127, rtol=1e-5)
        assert (np.abs(q * s[..., None] - c64) <= s[..., None] * (0.5 + 1e-4) + 1e-30).all()
        torch.testing.assert_close(out_k, out_v)
        np.testing.assert_allclose(_f64(rho[0]) ** 2, relative_residual(_f64(keys), c64) ** 2, atol=2e-6)

    @pytest.mark.parametrize("int8", [False, True])
    def test_device_row(self, impl, rng, int8):
        """``out_row``, the outputs' first row read on the device (a graph-captured append at the
        token count, DecodeWorkspace.append), writes what a view at that row receives, bit for
        bit, and no other row."""
        N, H, n_new, d, r, row, cap = 2, 2, 3, 32, 5, 11, 20
        keys = _t(rng.standard_normal((N, H, n_new, d)), torch.float32)
        values = _t(rng.standard_normal((N, H, n_new, d)), torch.float32)
        bases = _t(np.swapaxes(np.linalg.qr(rng.standard_normal((N, H, 1, d, r)))[0], -1, -2), torch.float32)
        chunk = torch.zeros((N, H), dtype=torch.int64, device=DEVICE)

        def buffers():
            coef = torch.full((N, H, cap, r), 99 if int8 else -7.0, dtype=torch.int8 if int8 else torch.float32, device=DEVICE)
            scale = torch.full((N, H, cap), -7.0, device=DEVICE)
            return coef, coef.clone(), scale, scale.clone()

        want, got = buffers(), buffers()
        view = [x[:, :, row : row + n_new] for x in want]
        impl["project"](keys, values, bases, bases, chunk, view[0], view[1], False, *(view[2:] if int8 else (None, None)))
        impl["project"](keys, values, bases, bases, chunk, got[0], got[1], False, *(got[2:] if int8 else (None, None)),
                        out_row=torch.tensor(row, device=DEVICE))
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert (want[0][:, :, row : row + n_new] != (99 if int8 else -7.0)).any()

    def test_without_residuals_returns_none(self, impl, rng):
        keys = _t(rng.standard_normal((1, 2, 3, 16)), torch.float32)
        bases = _t(np.swapaxes(np.linalg.qr(rng.standard_normal((1, 2, 1, 16, 4)))[0], -1, -2), torch.float32)
        out = torch.empty((1, 2, 3, 4), device=DEVICE)
        chunk = torch.zeros((1, 2), dtype=torch.int64, device=DEVICE)
        assert impl["project"](keys, keys, bases, bases, chunk, out, out.clone(), False) is None
        torch.testing.assert_close(out, keys @ bases[:, :, 0].mT, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_project_window_equals_the_torch_backends_projection(rng, dtype):
    """The hook offered to the torch backend's adaptive windows returns what its inline
    ``torch.matmul`` + ``relative_residual`` compute (float64 windows go to torch)."""
    from subspace_ref.policies.online_run import relative_residual

    kk = _t(rng.standard_normal((2, 3, 5, 24)), dtype)
    vv = _t(rng.standard_normal((2, 3, 5, 20)), dtype)
    B = _t(np.swapaxes(np.linalg.qr(rng.standard_normal((2, 3, 24, 6)))[0], -1, -2), dtype)
    E = _t(np.swapaxes(np.linalg.qr(rng.standard_normal((2, 3, 20, 3)))[0], -1, -2), dtype)
    c, dv, rho_k, rho_v = project.project_window(kk, vv, B, E)
    want_c, want_dv = torch.matmul(kk, B.mT), torch.matmul(vv, E.mT)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for got, want in ((c, want_c), (dv, want_dv), (rho_k, relative_residual(kk, want_c)), (rho_v, relative_residual(vv, want_dv))):
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, **tol)


# ------------------------------------------------------------------------------- backend


def _numpy_static(rng, N, H, d, d_v, r, r_v):
    B = np.stack([np.linalg.qr(rng.standard_normal((d, r)))[0].T for _ in range(H)])
    E = np.stack([np.linalg.qr(rng.standard_normal((d_v, r_v)))[0].T for _ in range(H)])
    return sr.SubspaceState.static(sr.StaticBasis.from_bases(B, E, rng.uniform(0.5, 1.5, H)), batch=N)


class TestBackend:
    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_static_append_then_attend(self, rng, dtype):
        """Spec A6 through the projection kernel, in blocks of 1, 20 and 17 tokens, then A3."""
        N, H, g, d, d_v, r, r_v, T = 2, 2, 2, 64, 64, 5, 3, 38
        empty = _numpy_static(rng, N, H, d, d_v, r, r_v)
        K, V = rng.standard_normal((N, H, T, d)), rng.standard_normal((N, H, T, d_v))
        be = TritonBackend()
        state = empty.to("triton", device=DEVICE, dtype=dtype)
        for a, b in ((0, 1), (1, 21), (21, T)):
            be.append(state, _t(K[:, :, a:b], DTYPES[dtype]), _t(V[:, :, a:b], DTYPES[dtype]))
        assert state.num_tokens == T
        # the oracle's append over the same rounded bases and tokens
        oracle_state = state.to("numpy", dtype=np.float64)
        oracle_state.layout.num_tokens = 0
        oracle_state.append(_f64(_t(K, DTYPES[dtype])), _f64(_t(V, DTYPES[dtype])))
        ulp = 2.0**-22 if dtype == "float32" else 2.0**-7  # one rounding of each coefficient
        for got, want in ((state.layout.key_coef, oracle_state.layout.key_coef), (state.layout.value_coef, oracle_state.layout.value_coef)):
            np.testing.assert_allclose(_f64(got[:, :, :T]), want[:, :, :T], rtol=ulp, atol=1e-5)
        q = _f64(_t(rng.standard_normal((N, H * g, d)), torch.float32))
        out = sr.attend(_t(q, torch.float32), state, backend="triton")
        want = attend_reference(q, state.to("numpy", dtype=np.float64), None)
        np.testing.assert_allclose(_f64(out), want, rtol=0, atol=1e-5 * np.abs(want).max())

    def test_static_int8_append_then_attend(self, rng):
        """Spec A10 end to end: the projection kernel quantises as the torch backend does."""
        from subspace_ref_torch import TorchBackend

        N, H, g, d, r, T = 1, 2, 4, 64, 6, 30
        B = np.stack([np.linalg.qr(rng.standard_normal((d, r)))[0].T for _ in range(H)])
        empty = sr.SubspaceState.static(sr.StaticBasis.from_bases(B, B, [0.8, 1.1]), batch=N, coefficients="int8")
        K, V = (_t(rng.standard_normal((N, H, T, d)), torch.float32) for _ in range(2))
        a, b = empty.to("triton", device=DEVICE, dtype="float32"), empty.to("torch", device=DEVICE, dtype="float32")
        TritonBackend().append(a, K, V)
        TorchBackend().append(b, K, V)
        for name in ("key_coef", "value_coef"):  # round(c / s) may differ by one at a rounding tie
            assert (getattr(a.layout, name)[:, :, :T].int() - getattr(b.layout, name)[:, :, :T].int()).abs().max() <= 1
        torch.testing.assert_close(a.layout.key_scale[:, :, :T], b.layout.key_scale[:, :, :T], rtol=1e-6, atol=0)
        q = _t(rng.standard_normal((N, H * g, d)), torch.float32)
        want = attend_reference(_f64(q), a.to("numpy", dtype=np.float64), None)
        np.testing.assert_allclose(_f64(sr.attend(q, a, backend="triton")), want, rtol=0, atol=1e-5 * np.abs(want).max())

    def test_adaptive_append_uses_the_torch_backend(self, rng):
        """Non-static appends are the torch backend's (FD, triggers, warm-up): identical states."""
        from subspace_ref_torch import TorchBackend

        K, V = rng.standard_normal((2, 40, 16)), rng.standard_normal((2, 40, 16))
        empty = sr.SubspaceState.adaptive(2, 16, rank_k=3, rank_v=4, tau_k=0.5, tau_v=0.5, max_chunk=8, dtype=np.float32)
        a, b = empty.to("triton", device=DEVICE), empty.to("torch", device=DEVICE)
        TritonBackend().append(a, _t(K[None], torch.float32), _t(V[None], torch.float32))
        TorchBackend().append(b, _t(K[None], torch.float32), _t(V[None], torch.float32))
        assert a.num_chunks.tolist() == b.num_chunks.tolist()
        for x, y in zip(a.reconstruct(), b.reconstruct()):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)

    def test_refusals_say_why(self, rng, monkeypatch):
        be = TritonBackend()
        small = _numpy_static(rng, 1, 1, 8, 8, 2, 2)
        small.append(rng.standard_normal((1, 1, 3, 8)), rng.standard_normal((1, 1, 3, 8)))
        q = rng.standard_normal((1, 2, 8))
        reasons = be.not_supported_reasons(q, small)
        assert any("q is a numpy" in x for x in reasons) and any("state.to('triton'" in x for x in reasons)
        s64 = small.to("torch", device=DEVICE, dtype="float64")
        reasons = be.not_supported_reasons(_t(q), s64)
        assert any("float64" in x and "torch backend" in x for x in reasons)
        with pytest.raises(ValueError, match="does not support"):
            sr.attend(_t(q), s64, backend="triton")
        big = _numpy_static(rng, 1, 1, 300, 8, 1, 2).to("triton", device=DEVICE, dtype="float32")
        assert any("key head size d is 300" in x for x in be.not_supported_reasons(_t(rng.standard_normal((1, 1, 300)), torch.float32), big))
        s32 = small.to("triton", device=DEVICE, dtype="float32")
        assert be.not_supported_reasons(_t(q, torch.float32), s32) == []
        assert any("query heads per KV head" in x for x in be.not_supported_reasons(_t(rng.standard_normal((1, 65, 8)), torch.float32), s32))
        if DEVICE == "cpu":  # a CPU state, as the compiled kernels would see it
            monkeypatch.setattr(backend_module, "interpreting", lambda: False)
            assert any("TRITON_INTERPRET=1" in x for x in be.not_supported_reasons(_t(q, torch.float32), s32))

    def test_availability_reasons(self, monkeypatch):
        be = TritonBackend()
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        no_device = "no CUDA device; set TRITON_INTERPRET=1 to run the kernels on the CPU interpreter"
        for loaded in (None, True, False):  # kernels not imported / decorated for the interpreter / the GPU
            monkeypatch.setattr(backend_module, "_loaded_mode", lambda loaded=loaded: loaded)
            got = be.availability()
            assert not got and got.reason == no_device
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(backend_module, "_loaded_mode", lambda: True)
        assert "unset now; restart the process" in be.availability().reason
        monkeypatch.setattr(backend_module, "_loaded_mode", lambda: False)
        assert be.availability()
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert "restart the process with it set" in be.availability().reason
        monkeypatch.setattr(backend_module, "_loaded_mode", lambda: None)
        assert be.availability()

    def test_loaded_mode_is_read_from_the_kernels(self):
        assert backend_module._loaded_mode() == (DEVICE == "cpu")

    def test_import_touches_neither_triton_nor_cuda(self):
        code = (
            "import sys, subspace_ref_triton as t; t.TritonBackend().availability(); "
            "bad = [m for m in ('triton', 'subspace_ref_triton.decode', 'subspace_ref_triton.project') if m in sys.modules]; "
            "import torch; assert not torch.cuda.is_initialized(); print(bad)"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ, "TRITON_INTERPRET": "1"})
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "[]"
