"""Pre-RoPE static states (spec/rope.md P2-P3) on the accelerated backends, against the float64
oracle with the differential harness's derived tolerance (tests/differential/tolerance.py):
torch on the CPU, Triton's fused kernel under TRITON_INTERPRET=1 (skipped with its reason when
it cannot run here). Composed with GQA, int8 coefficients (spec A10), float16 bases
(spec/storage.md S1) and the exact window (spec/window.md W3)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from conftest import random_orthonormal
from differential.tolerance import reference_error, tolerance
from triton_numerics import gpu_numerics

import subspace_ref as sr
from subspace_ref import StaticBasis, SubspaceState
from subspace_ref.arrays import to_numpy
from subspace_ref.rope import RopeParams, rotate

torch = pytest.importorskip("torch")

# (name, layout, rotary_dim, scaling, H, group, d, r, T, coefficients, bases, window)
CASES = [
    ("half", "half", None, 1.0, 2, 1, 16, 6, 40, "float", "native", 0),
    ("interleaved-partial-gqa", "interleaved", 8, 1.2, 2, 3, 12, 5, 37, "float", "native", 0),
    ("int8-gqa", "half", None, 1.0, 2, 2, 16, 6, 50, "int8", "native", 0),
    ("f16bases-window", "half", None, 1.0, 2, 2, 16, 6, 45, "float", "float16", 7),
    ("tiles", "half", None, 1.0, 1, 2, 16, 4, 2600, "int8", "native", 0),  # > VALUE_TILE: several tiles, base angles > 0
    ("int4-tiles", "half", None, 1.0, 1, 2, 16, 4, 2100, "int4", "native", 0),  # key groups and a float tail
]


def rope_params(d, layout, rotary_dim, scaling):
    rot = d if rotary_dim is None else rotary_dim
    return RopeParams(1.0 / 50.0 ** (np.arange(0, rot, 2) / rot), layout, scaling)


def build(case, rng, **state_kw):
    _, layout, rot, scaling, H, g, d, r, T, coefficients, bases, window = case
    rope = rope_params(d, layout, rot, scaling)
    basis = StaticBasis.from_bases(random_orthonormal(rng, H, r=r, d=d), random_orthonormal(rng, H, r=r, d=d), gamma=1.3)
    state = SubspaceState.static(basis, rope=rope, coefficients=coefficients, bases=bases, window=window, **state_kw)
    # post-RoPE keys of pre-RoPE keys near the basis span, as a model gives them
    pre = np.einsum("htr,hrd->htd", rng.standard_normal((H, T, r)) * 3, basis.B) + 0.05 * rng.standard_normal((H, T, d))
    keys = rotate(pre, np.arange(T), rope)
    values = rng.standard_normal((H, T, d))
    q = rng.standard_normal((H * g, d)) * 2
    return state, keys, values, q


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_torch_pre_rope_attend_matches_oracle(case, dtype, rng):
    state, keys, values, q = build(case, rng)
    state.append(keys, values)
    want = sr.attend(q, state)
    ref = reference_error(state.copy(), q[None], None, want[None], dtype)
    tst = state.to("torch", dtype=dtype)
    got = to_numpy(sr.attend(torch.as_tensor(q, dtype=getattr(torch, dtype)), tst, backend="torch")).astype(np.float64)
    err = np.abs(got - want).max()
    assert err <= tolerance(ref, want, dtype), (err, ref)


@pytest.mark.parametrize("case", CASES[:4], ids=[c[0] for c in CASES[:4]])
def test_torch_pre_rope_append_matches_oracle(case, rng):
    """P2 on torch: appends in two blocks (positions continue across appends) store the
    oracle's coefficients (float64: to rounding; int8: the same codes)."""
    state, keys, values, _ = build(case, rng)
    tst = state.to("torch")
    half = keys.shape[1] // 2
    for sl in (slice(0, half), slice(half, None)):
        state.append(keys[:, sl], values[:, sl])
        tst.append(torch.as_tensor(keys[:, sl]), torch.as_tensor(values[:, sl]))
    want, got = state.layout.live_arrays(), tst.layout.live_arrays()
    for name in want:
        np.testing.assert_allclose(to_numpy(got[name]), want[name], rtol=0, atol=1e-12, err_msg=name)


def test_pre_rope_decode_is_not_a_plain_static_decode(rng):
    """The rotation matters: the same coefficients attended without it (a plain static state)
    give a different result, and so would a backend that dropped R_t."""
    state, keys, values, q = build(CASES[0], rng)
    state.append(keys, values)
    plain = SubspaceState.static(StaticBasis.from_bases(state.layout.key_bases[0, :, 0], state.layout.value_bases[0, :, 0], gamma=1.3))
    plain.layout = state.layout
    tst = state.to("torch")
    got = to_numpy(sr.attend(torch.as_tensor(q), tst, backend="torch"))
    assert np.abs(got - sr.attend(q, plain)).max() > 1e-3


def _triton_or_skip():
    info = {b.name: b for b in sr.backends()}.get("triton")
    if info is None or not info.available:
        pytest.skip(f"triton backend unavailable: {None if info is None else info.reason}")


TRITON_CASES = [c for c in CASES if not c[0].endswith("tiles")] + [
    ("splits", "half", None, 1.0, 1, 2, 16, 4, 300, "int8", "native", 0),
    # spec/quantization.md Q2 (default G = 32): one key group and a float tail; two groups, a tail
    # of 6, two splits
    ("int4-gqa", "half", None, 1.0, 2, 2, 16, 6, 50, "int4", "native", 0),
    ("int2-interleaved-partial", "interleaved", 8, 1.2, 2, 3, 12, 5, 70, "int2", "native", 0),
    # a GQA group of 16 (the benchmark's is 4)
    ("gqa16-int8", "half", None, 1.0, 1, 16, 16, 4, 70, "int8", "native", 0),
    # a format per side (spec/quantization.md Q0): each side read in its own format by one kernel
    ("int4keys-int8values", "half", None, 1.0, 2, 2, 16, 6, 50, "int4/int8", "native", 0),
    ("int8keys-int2values-partial", "interleaved", 8, 1.2, 2, 3, 12, 5, 70, "int8/int2", "native", 0),
    ("floatkeys-int4values-splits", "half", None, 1.0, 1, 2, 16, 4, 300, "float/int4", "native", 0),
    ("int2keys-floatvalues", "half", None, 1.0, 2, 2, 16, 6, 50, "int2/float", "native", 0),
]


@pytest.mark.parametrize("case", TRITON_CASES, ids=[c[0] for c in TRITON_CASES])
def test_triton_pre_rope_kernel_matches_oracle(case, rng):
    """The fused kernel (rebuild, RoPE by angle addition, logits, online softmax, values in
    coefficient space) in float32 against the float64 oracle, tolerance derived as the harness
    does; several splits merged (split_len of 2 tiles); an exact window's partials (spec/window.md
    W3) merged with the kernel's."""
    _triton_or_skip()
    from subspace_ref_triton import rope_decode

    from subspace_ref.basis_storage import decoded_state

    state, keys, values, q = build(case, rng)
    state.append(keys, values)
    want = sr.attend(q, state)
    ref = reference_error(state.copy(), q[None], None, want[None], "float32")
    tst = state.to("triton", dtype="float32")  # on the GPU when there is one
    qt = torch.as_tensor(q, dtype=torch.float32, device=tst.layout.key_coef.device)
    got = to_numpy(sr.attend(qt, tst, backend="triton")).astype(np.float64)
    assert np.abs(got - want).max() <= tolerance(ref, want, "float32")
    if tst.window is not None:
        from subspace_ref_triton import window_decode

        def compressed(q, lay, s):
            return rope_decode.attention_partials(q, lay, tst.policy.rope, s, split_len=2 * rope_decode.BLOCK_T)

        split = to_numpy(window_decode.decode_attention(qt[None], tst, decoded_state(tst).layout, None, compressed))[0]
    else:
        split = to_numpy(rope_decode.decode_attention(qt[None], decoded_state(tst).layout, tst.policy.rope, split_len=2 * rope_decode.BLOCK_T))[0]
    assert np.abs(split - want).max() <= tolerance(ref, want, "float32")


@pytest.mark.parametrize("coefficients", ["float", "int8", "int8/float", "float/int4"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_triton_pre_rope_16bit_state(dtype, coefficients, rng):
    """A 16-bit state whose rebuild products are all at least 16 wide (d = 64: 32 planes, r = 16,
    GQA 4): on a GPU the rebuild runs on the tensor cores (``rope_decode.native16``), under the
    interpreter in float32; against the float64 oracle of the state as stored, within the
    harness's tolerance derived in that dtype, several splits merged."""
    _triton_or_skip()
    from subspace_ref_triton import rope_decode
    from subspace_ref_triton._common import interpreting

    state, keys, values, q = build(("native16", "half", None, 1.0, 2, 4, 64, 16, 300, coefficients, "native", 0), rng)
    state.append(keys, values)
    tst = state.to("triton", dtype=dtype)  # on the GPU when there is one
    qt = torch.as_tensor(q, device=tst.layout.key_coef.device).to(getattr(torch, dtype))
    state64 = tst.to("numpy", dtype=np.float64)
    q64 = to_numpy(qt).astype(np.float64)
    want = sr.attend(q64, state64)
    ref = reference_error(state64, q64[None], None, want[None], dtype)
    launch, _ = rope_decode.split_launch(qt[None], tst.layout, tst.policy.rope, 0.125, 64)
    assert launch.constexprs["NATIVE16"] == (not interpreting())
    for split_len in (None, 4 * rope_decode.BLOCK_T):
        got = to_numpy(rope_decode.decode_attention(qt[None], tst.layout, tst.policy.rope, split_len=split_len))[0].astype(np.float64)
        assert np.abs(got - want).max() <= tolerance(ref, want, dtype), (np.abs(got - want).max(), ref)


def test_triton_pre_rope_append_then_attend(rng):
    """P2 through the triton backend's append (keys un-rotated before projection) then P3."""
    _triton_or_skip()
    state, keys, values, q = build(CASES[2], rng)
    tst = state.to("triton", dtype="float32")
    state.append(keys, values)
    dev = tst.layout.key_coef.device  # the GPU when there is one
    tst.append(torch.as_tensor(keys, dtype=torch.float32, device=dev), torch.as_tensor(values, dtype=torch.float32, device=dev))
    want = sr.attend(q, state)
    ref = reference_error(state.copy(), q[None], None, want[None], "float32")
    got = to_numpy(sr.attend(torch.as_tensor(q, dtype=torch.float32, device=dev), tst, backend="triton")).astype(np.float64)
    assert np.abs(got - want).max() <= tolerance(ref, want, "float32") + 1e-6 * np.abs(want).max()


@pytest.mark.parametrize("coefficients", ["int4", "int2"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("T", [7, 2100])  # the float tail alone; several tiles of whole key groups, then the tail
def test_torch_one_chunk_low_bit_path_matches_oracle(coefficients, dtype, T, rng):
    """The one-chunk int4/int2 path of the torch attend (scaled query and one bias per key
    group, codes contracted as packed, value scales in the weights) within the harness's
    derived tolerance, GQA g = 2."""
    H, d, r = 2, 16, 6
    basis = StaticBasis.from_bases(random_orthonormal(rng, H, r=r, d=d), random_orthonormal(rng, H, r=r, d=d), gamma=0.8)
    state = SubspaceState.static(basis, coefficients=coefficients)
    state.append(np.einsum("htr,hrd->htd", rng.standard_normal((H, T, r)) * 3, basis.B), rng.standard_normal((H, T, d)))
    q = rng.standard_normal((H * 2, d)) * 2
    want = sr.attend(q, state)
    ref = reference_error(state.copy(), q[None], None, want[None], dtype)
    got = to_numpy(sr.attend(torch.as_tensor(q, dtype=getattr(torch, dtype)), state.to("torch", dtype=dtype), backend="torch")).astype(np.float64)
    assert np.abs(got - want).max() <= tolerance(ref, want, dtype)




@pytest.mark.parametrize("legacy, key_parts", [(False, 2), (False, 1), (True, 2)], ids=["mma", "mma-key1", "legacy"])
@pytest.mark.parametrize("coefficients", ["float", "int8", "int4", "int2", "float/int4", "int4/int8"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_triton_pre_ropegpu_numerics(dtype, coefficients, legacy, key_parts, rng, monkeypatch):
    """Both kernels (the tensor-core form, also with ``key_parts=1``, and ``legacy=True``) with the constexprs of a GPU launch
    (``NATIVE16``: 16-bit tensor-core products, float32 operands in 16-bit parts) and, under the
    interpreter, the GPU's 16-bit arithmetic (:func:`gpu_numerics`), against the float64 oracle of
    the stored state within the harness's tolerance in that dtype; several splits (tiles with base
    angles > 0), GQA 4, d = 64, r = 16, a key group tail for int4/int2."""
    _triton_or_skip()
    from subspace_ref_triton import rope_decode

    case = ("gpu", "half", None, 1.0, 2, 4, 64, 16, 300, coefficients, "native", 0)
    # the legacy kernel's tensor-core rebuild takes 16-bit or int8 key coefficients only (rope_decode.native16)
    native16 = not legacy or coefficients.split("/")[0] in ("float", "int8")
    err, tol, launch = _gpu_numerics_error(case, dtype, 2 * rope_decode.BLOCK_T, rng, monkeypatch, native16=native16, legacy=legacy,
                                           **({} if legacy else dict(key_parts=key_parts)))
    assert (launch.kernel is rope_decode._rope_split_kernel) == legacy
    assert err <= tol, (err, tol)


def test_triton_pre_rope_default_kernels():
    """The tensor-core form is the default for every coefficient format (``legacy=True``: the kernel
    before it); no float64 table reaches the new kernel."""
    _triton_or_skip()
    from subspace_ref_triton import rope_decode

    rng = np.random.default_rng(1)
    for coefficients in ("float", "int8", "int4", "float/int4"):
        state, keys, values, q = build(("d", "half", None, 1.0, 1, 4, 64, 16, 40, coefficients, "native", 0), rng)
        state.append(keys, values)
        tst = state.to("triton", dtype="bfloat16")
        qt = torch.as_tensor(q, device=tst.layout.key_coef.device).to(torch.bfloat16)
        launch, _ = rope_decode.split_launch(qt[None], tst.layout, tst.policy.rope, 0.125, 128)
        assert launch.kernel is rope_decode._rope_mma_kernel, coefficients
        assert all(a.dtype != torch.float64 for a in launch.args if isinstance(a, torch.Tensor))
        launch, _ = rope_decode.split_launch(qt[None], tst.layout, tst.policy.rope, 0.125, 128, legacy=True)
        assert launch.kernel is rope_decode._rope_split_kernel


def test_triton_pre_rope_splits_follow_the_compiled_occupancy(rng, monkeypatch):
    """Without a split length the splits fill the programs per SM of the launch as compiled
    (rope_decode.MAX_REGISTERS fits 3 where the split kernel's fallback assumes 2): the first call
    builds the launch again with the compiled figure, later calls of that configuration build once,
    splits are whole tiles, and the partials are those of the last launch built."""
    _triton_or_skip()
    from subspace_ref_triton import decode, rope_decode

    state, keys, values, q = build(("occupancy", "half", None, 1.0, 1, 4, 64, 16, 300, "int4", "native", 0), rng)
    state.append(keys, values)
    tst = state.to("triton", dtype="bfloat16")
    qt = torch.as_tensor(q, device=tst.layout.key_coef.device).to(torch.bfloat16)[None]
    built, real = [], rope_decode.split_launch
    monkeypatch.setattr(decode, "_RESIDENT_SEEN", {})
    monkeypatch.setattr(decode, "resident_programs", lambda launch, device: 3)
    monkeypatch.setattr(decode, "default_split_len", lambda T, programs, device, resident: 64 * resident)
    monkeypatch.setattr(rope_decode, "split_launch", lambda *a, **kw: built.append(a[4]) or real(*a, **kw))
    pm, _, _ = rope_decode.attention_partials(qt, tst.layout, tst.policy.rope, 0.125)
    assert built == [128, 192] and pm.shape[-1] == 2
    built.clear()
    pm, _, _ = rope_decode.attention_partials(qt, tst.layout, tst.policy.rope, 0.125)
    assert built == [192] and pm.shape[-1] == 2
    built.clear()
    rope_decode.attention_partials(qt, tst.layout, tst.policy.rope, 0.125, block_t=32)  # another configuration: its own figure
    assert built == [128, 192]
    built.clear()
    rope_decode.attention_partials(qt, tst.layout, tst.policy.rope, 0.125, block_t=128)  # splits of whole tiles
    assert built == [128, 256]


def _gpu_numerics_error(case, dtype, split_len, rng, monkeypatch, native16=True, state_kw=None, device_tokens=None, **launch_kw):
    """(error, tolerance, launch) of the kernel ``launch_kw`` select with a GPU launch's
    ``NATIVE16`` (``native16``) and, under the interpreter, the GPU numerics emulation
    (:func:`gpu_numerics`), against the float64 oracle of the stored state. ``device_tokens``: a
    device token count (``num_tokens``, a one-element int64 tensor on the state's device, which the
    kernel reads: a CPU tensor is no pointer a GPU launch can take)."""
    from subspace_ref_triton import decode, rope_decode
    from subspace_ref_triton._common import interpreting

    state, keys, values, q = build(case, rng, **(state_kw or {}))
    state.append(keys, values)
    tst = state.to("triton", dtype=dtype)
    qt = torch.as_tensor(q, device=tst.layout.key_coef.device).to(getattr(torch, dtype))
    state64 = tst.to("numpy", dtype=np.float64)
    q64 = to_numpy(qt).astype(np.float64)
    want = sr.attend(q64, state64)
    ref = reference_error(state64, q64[None], None, want[None], dtype)
    scale = 1.0 / np.sqrt(q.shape[-1])
    if device_tokens is not None:
        launch_kw["num_tokens"] = torch.full((1,), device_tokens, dtype=torch.int64, device=qt.device)
    launch, (pm, pz, po) = rope_decode.split_launch(qt[None], tst.layout, tst.policy.rope, scale, split_len, **launch_kw)
    launch.constexprs["NATIVE16"] = native16
    with gpu_numerics(monkeypatch) if interpreting() else contextlib.nullcontext():
        launch.run()
    got = to_numpy(decode.merge_partials(pm, pz, po, qt.dtype))[0].astype(np.float64)
    return np.abs(got - want).max(), tolerance(ref, want, dtype), launch


@pytest.mark.parametrize("coefficients", ["float", "int8", "int4", "int2", "int8/int4", "int2/int8"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_triton_pre_rope_words_partial_rotary_unaligned_splits(dtype, coefficients, rng, monkeypatch):
    """The tensor-core kernel's code-word paths (int8, int4, int2 read as 32-bit words:
    ``K_WORDS``/``V_WORDS``) with fixed dims beside the planes (partial rotary: the fixed dims'
    query parts and rebuild), under the GPU numerics emulation, against the float64 oracle within the
    harness's tolerance; a split length that is no multiple of the tile or the key group, so whole
    unmasked tiles start off the groups' boundaries and partial tiles mix coded tokens and the tail.
    One softmax a tile (``warp_softmax=False``; the per-warp default: test_triton_pre_rope_warp_softmax)."""
    _triton_or_skip()
    err, tol, launch = _gpu_numerics_error(("w", "half", 32, 1.0, 2, 4, 64, 32, 300, coefficients, "native", 0), dtype, 100, rng, monkeypatch,
                                           warp_softmax=False)
    assert launch.constexprs["HAS_FIXED"] and launch.constexprs["RANKS_FULL"] and launch.constexprs["WARPS"] == 1
    quantised = {side: fmt != "float" for side, fmt in zip("KV", (coefficients.split("/") * 2)[:2])}
    assert all(bool(launch.constexprs[side + "_WORDS"]) == q for side, q in quantised.items()), launch.constexprs
    assert err <= tol, (err, tol)


@pytest.mark.parametrize("split_len", [100, 40, "device"])
@pytest.mark.parametrize("dtype, coefficients, rank, launch_kw", [
    ("bfloat16", "float", 32, {}), ("bfloat16", "int8", 32, {}), ("bfloat16", "int4", 32, {}), ("bfloat16", "int2", 32, {}),
    ("float16", "int8", 32, {}), ("float16", "int4", 32, {}), ("bfloat16", "int8", 24, {}), ("float16", "float", 32, dict(block_t=128, num_warps=8)),
], ids=["bf16-float", "bf16-int8", "bf16-int4", "bf16-int2", "fp16-int8", "fp16-int4", "bf16-int8-r24", "fp16-float-8warps"])
def test_triton_pre_rope_warp_softmax(dtype, coefficients, rank, launch_kw, split_len, rng, monkeypatch):
    """``warp_softmax``: a softmax per warp's rows of the tile (WARPS = the warps), merged once per
    split, under the GPU numerics emulation, against the float64 oracle within the harness's
    tolerance: with partial rotary, float16 weight units per warp (int8/int4 values on float16
    bases), int8 keys read per code as the per-warp form reads them (bfloat16 and float16 bases),
    int8 values per code too at rank 24 (no words) and 8 warps. Splits of 40 tokens leave the last
    warp's rows of their one masked tile without a token (its max stays -inf: no NaN may reach the
    partial); a device token count over 8 splits leaves splits empty."""
    _triton_or_skip()
    if split_len == "device":  # 300 tokens: splits of MIN_SPLIT_TOKENS, the last ones empty
        launch_kw = dict(launch_kw, device_tokens=300, num_splits=8)
        split_len = 0
    err, tol, launch = _gpu_numerics_error(("ws", "half", 32, 1.0, 2, 4, 64, rank, 300, coefficients, "native", 0), dtype, split_len, rng, monkeypatch,
                                           warp_softmax=True, **launch_kw)
    assert launch.constexprs["WARPS"] == launch.num_warps > 1
    assert err <= tol, (err, tol)


def test_triton_pre_rope_warp_softmax_refused():
    """``warp_softmax`` where it cannot run: float32 bases, fewer than 16 tokens a warp, the legacy
    kernel; each a ValueError naming it."""
    _triton_or_skip()
    from subspace_ref_triton import rope_decode

    rng = np.random.default_rng(5)
    state, keys, values, q = build(("refused", "half", None, 1.0, 1, 4, 64, 16, 100, "float", "native", 0), rng)
    state.append(keys, values)
    for dtype, kw in (("float32", {}), ("bfloat16", dict(block_t=32, num_warps=4)), ("bfloat16", dict(legacy=True))):
        tst = state.to("triton", dtype=dtype)
        qt = torch.as_tensor(q, device=tst.layout.key_coef.device).to(getattr(torch, dtype))[None]
        with pytest.raises(ValueError, match="warp_softmax"):
            rope_decode.split_launch(qt, tst.layout, tst.policy.rope, 0.125, 64, warp_softmax=True, **kw)


@pytest.mark.parametrize("coefficients", ["int8", "int4", "int2"])
def test_triton_pre_rope_codes_per_code_when_rows_are_not_words(coefficients, rng, monkeypatch):
    """A rank that is no power of two (rank masks, rows of no whole 32-bit words): the per-code reads
    (``K_WORDS``/``V_WORDS`` 0) and the two-part float32 low-bit keys, under the GPU numerics
    emulation, within the harness's tolerance."""
    _triton_or_skip()
    err, tol, launch = _gpu_numerics_error(("p", "half", None, 1.0, 2, 4, 64, 12, 300, coefficients, "native", 0), "bfloat16", 128, rng, monkeypatch)
    assert not launch.constexprs["RANKS_FULL"] and not launch.constexprs["K_WORDS"] and not launch.constexprs["V_WORDS"]
    assert err <= tol, (err, tol)


@pytest.mark.parametrize("group_rows", [None, True], ids=["default", "forced"])
@pytest.mark.parametrize("split_len", [128, 96, 100])
@pytest.mark.parametrize("group", [16, 32, 64, 128])
@pytest.mark.parametrize("coefficients", ["int4", "int2", "int4/int8"])
def test_triton_pre_rope_key_scales_per_group(coefficients, group, split_len, group_rows, rng, monkeypatch):
    """int4/int2 keys read as words with their scales and zero points one row per key group
    (``GROUP_ROWS``, _rope_tl.group_rows: whole tiles that start on a group boundary and hold whole
    groups or lie in one; 64-token tiles, groups of 16 to 128 tokens; by default only where a tile
    holds two groups, ``group_rows=True`` wherever the tiles allow it) or, where a split length breaks
    that, one row per token; under the GPU numerics emulation, within the harness's tolerance."""
    _triton_or_skip()
    from subspace_ref_triton import rope_decode

    case = ("g", "half", None, 1.0, 2, 4, 64, 16, 300, coefficients, "native", 0)
    err, tol, launch = _gpu_numerics_error(case, "bfloat16", split_len, rng, monkeypatch, state_kw=dict(group_size=group), group_rows=group_rows)
    assert launch.constexprs["KGROUP"] == group and launch.constexprs["K_WORDS"]
    whole = split_len % min(group, rope_decode.BLOCK_T) == 0
    assert launch.constexprs["GROUP_ROWS"] == (whole and (group_rows or rope_decode.BLOCK_T == 2 * group))
    assert err <= tol, (err, tol)
