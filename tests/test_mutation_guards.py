"""Behaviours no other test pinned down (issue 42): a one-line bug in each passed the whole suite.

1. The bytes the allocator charges every side x bits x rank (``side_parts``, ``head_parts``, now in
   subspace_ref/byte_convention.py; spec/quantization.md Q3) are the baselines' convention
   (budget.py's quantised KV and subspace rows), and are what a state of those ranks holds.
2. The byte ceiling at equality (spec/algorithms.md A7.3 step 1: ``<=``), in exact arithmetic.
3. (tests/test_hf_pre_rope_sinks.py: pre-RoPE bases with sinks through the transformers cache.)
4. The length threshold with sinks (spec/window.md W7): S > 0 and M <= T < M + S.
5. The byte ceiling's growth rates (subspace_ref/layout.py ``growth_rates``, spec A7.3's B_c and
   T_c) are the measured growth of the counted bytes, for every coefficient format.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

import subspace_ref as sr
from subspace_ref.allocation import Allocation, HeadAllocation
from subspace_ref.lab.baselines.combined import Subspace
from subspace_ref.lab.baselines.quantized import QuantizedKV
from subspace_ref.byte_convention import Geometry, head_parts, side_parts
from subspace_ref.layout import BY_NAME, FIXED, counted_nbytes, growth_rates
from subspace_ref.policies import byte_ceiling
from subspace_ref.window import after_sinks_threshold


def orthonormal_rows(rng, heads: int, rank: int, d: int) -> np.ndarray:
    return np.stack([np.linalg.qr(rng.standard_normal((d, rank)))[0].T for _ in range(heads)])


# ------------------------------------------------------------------------ 1. allocation bytes
D, D_V = 16, 8  # d != d_v: a value side charged at the key size shows


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("context, group", [(96, 32), (100, 32), (77, 8), (64, 64)])
def test_full_rank_low_bit_sides_cost_what_budget_py_charges_quantized_kv(bits, context, group):
    """At full rank (r = d, r_v = d_v) int4/int2 coefficients are budget.py's quantised KV
    (lab/baselines/quantized.py ``QuantizedKV.bytes``) part by part: key codes of the complete groups,
    an fp16 scale and zero per group and channel, the unfinished group's keys in fp16, value codes
    and an fp16 scale and zero per token. Contexts with and without an unfinished group."""
    geom = Geometry(1, 1, D, D_V, context)
    want = QuantizedKV(bits=bits, group=group).bytes(geom).parts
    keys, values = side_parts(geom, "key", D, bits, group), side_parts(geom, "value", D_V, bits, group)
    assert keys["key_codes"] == pytest.approx(want["key_codes"], rel=1e-12, abs=1e-12)
    assert keys["key_scales"] == pytest.approx(want["key_scales"], rel=1e-12, abs=1e-12)
    assert keys["key_tail"] == pytest.approx(want["key_residual"], rel=1e-12, abs=1e-12)
    assert values["value_codes"] == pytest.approx(want["value_codes"], rel=1e-12)
    assert values["value_scales"] == pytest.approx(want["value_scales"], rel=1e-12)


@pytest.mark.parametrize("bits", [16, 8])
def test_fp16_and_int8_sides_cost_what_budget_py_charges_subspace(bits):
    """Every (r, r_v) and compressed fraction: fp16 / int8 coefficients of both sides, their
    bases and gamma are budget.py's ``Subspace`` row (lab/baselines/combined.py)."""
    geom = Geometry(1, 1, D, D_V, 100)
    coefficients = {16: "fp16", 8: "int8"}[bits]
    for kept in (1.0, 0.63, 0.2):
        for r in range(1, D + 1):
            for r_v in range(1, D_V + 1):
                ours = (
                    sum(side_parts(geom, "key", r, bits, 32, kept).values()) + sum(side_parts(geom, "value", r_v, bits, 32, kept).values()) + 4 / geom.context
                )
                assert ours == pytest.approx(Subspace(r, r_v, coefficients).bytes(geom, kept_fraction=kept).per_token, rel=1e-12)


def _held(state, names) -> int:
    return counted_nbytes(state, [n for n in names if n in BY_NAME])


@pytest.mark.parametrize("bits", [16, 8, 4, 2])
@pytest.mark.parametrize("group", [8, 5])
@pytest.mark.parametrize("exact", [(0, 0), (6, 3)], ids=["all-compressed", "window-and-sinks"])
def test_every_rank_costs_what_a_state_of_that_rank_holds(bits, group, exact):
    """The allocator's per-head bytes (``head_parts``: ``side_parts`` of each side for the
    compressed fraction, the exact tokens in fp16) against a float16 static state of the same
    ranks, coefficient format and key group after C = 61 tokens, every key rank 1..16 (value
    rank 1..8) and both sides: codes (ceil(r b / 8) bytes per token, of complete key groups for
    keys), fp16 scales and zeros (per value token; per key group and channel), the unfinished key
    group's rows in fp16 (spec/quantization.md Q2), int8 codes and float32 scales (spec A10),
    fp16 coefficients, bases, and the window's and sinks' tokens (spec/window.md W1, W7)."""
    rng = np.random.default_rng(bits * 100 + group)
    window, sinks = exact
    C, H = 61, 1
    coefficients = {16: "float", 8: "int8", 4: "int4", 2: "int2"}[bits]
    K, V = rng.standard_normal((H, C, D)), rng.standard_normal((H, C, D_V))
    geom = Geometry(1, H, D, D_V, C)
    n = C - window - sinks  # compressed tokens
    for r in range(1, D + 1):
        r_v = (r - 1) % D_V + 1  # every value rank, each with two key ranks
        basis = sr.StaticBasis.from_bases(orthonormal_rows(rng, H, r, D), orthonormal_rows(rng, H, r_v, D_V))
        state = sr.SubspaceState.static(basis, dtype=np.float16, coefficients=coefficients, group_size=group, bases="float16", window=window, sinks=sinks)
        state.append(K, V)
        assert state.layout.num_tokens == n
        parts = head_parts(geom, HeadAllocation(r, r_v, bits, bits), group, window, sinks)
        got = {k: v * C for k, v in parts.items()}  # bytes at the end of the window
        where = (bits, group, r, r_v)
        assert got["key_basis"] == _held(state, ["key_bases"]) and got["value_basis"] == _held(state, ["value_bases"]), where
        if bits == 16:
            assert got["key_coefficients"] == pytest.approx(_held(state, ["key_coef"])), where
            assert got["value_coefficients"] == pytest.approx(_held(state, ["value_coef"])), where
        elif bits == 8:
            assert (got["key_codes"], got["key_scales"]) == pytest.approx((_held(state, ["key_coef"]), _held(state, ["key_scale"]))), where
            assert (got["value_codes"], got["value_scales"]) == pytest.approx((_held(state, ["value_coef"]), _held(state, ["value_scale"]))), where
        else:
            assert got["value_codes"] == pytest.approx(_held(state, ["value_coef"])), where
            assert got["value_scales"] == pytest.approx(_held(state, ["value_token_scale", "value_token_zero"])), where
            width = state.layout.key_coef.shape[-1]
            assert width == math.ceil(r * bits / 8)
            assert got["key_codes"] == pytest.approx((n - n % group) * width), where  # complete groups' codes
            assert got["key_scales"] == pytest.approx(_held(state, ["key_group_scale", "key_group_zero"])), where
            assert got["key_tail"] == pytest.approx((n % group) * r * 2), where  # fp16 rows of the unfinished group
        exact_bytes = _held(state, ["window_keys", "window_values", "sink_keys", "sink_values"])
        assert got.get("exact_tokens", 0.0) == pytest.approx(exact_bytes), where
        # and an Allocation of such heads sums them (budget.py's make_bytes)
        alloc = Allocation(((HeadAllocation(r, r_v, bits, bits),),), group, window=window, sinks=sinks)
        assert alloc.bytes(geom).per_token == pytest.approx(sum(parts.values()), rel=1e-12)


# ------------------------------------------------------------------------ 2. the ceiling at equality
def ceiling_terms(state) -> tuple[Fraction, Fraction, Fraction, Fraction]:
    """(F, B_c, T_c, beta) of spec/algorithms.md A7.3 for one (sequence, head), as exact numbers:
    the bytes that do not grow (``byte_ceiling.fixed_bytes``), one more chunk, one more token, and
    the ceiling per token."""
    per_chunk, per_token, beta = byte_ceiling.rates(state)
    fixed = byte_ceiling.fixed_bytes(state)
    return Fraction(fixed), Fraction(per_chunk), Fraction(per_token), Fraction(beta)


def test_a_chunk_opens_on_the_token_that_lands_exactly_on_the_ceiling(rng):
    """Spec/algorithms.md A7.3 step 1: chunk J + 1 may open at the token that makes ``ends``
    tokens iff F + (J + 1) B_c + ends T_c <= ends beta, equality included. A float64 state of
    d = 8, d_v = 6, ranks 1 has integer rates (bases of 8 and 6 float64s, one int64 offset; two
    float64 coefficients a token; beta = 14 x 8 at c = 1), so float64 sums are exact and, with
    tau -> 0 (the paper trigger fires on every token of a random stream), the chunk that opens
    on the 11th token lands exactly on the ceiling. Checked on ``may_open`` itself, and end to
    end: the chunks open exactly where the exact rule, applied token by token, says."""
    N, H, d, d_v = 1, 2, 8, 6
    state = sr.SubspaceState.adaptive(H, d, d_v, rank_k=1, rank_v=1, tau_k=1e-9, tau_v=1e-9, trigger="paper", warmup=0, batch=N)
    fixed, per_chunk, per_token, beta = ceiling_terms(state)
    assert all(x.denominator == 1 for x in (fixed, per_chunk, per_token, beta))
    T = 30
    J, starts, equal = 1, [0], []
    for t in range(T):  # the exact rule, token by token (every token's trigger fires)
        cost, allowed = fixed + (J + 1) * per_chunk + (t + 1) * per_token, (t + 1) * beta
        if cost == allowed:
            equal.append((J, t + 1))
        if cost <= allowed:
            J, starts = J + 1, starts + [t + 1]
    assert equal and equal[0][1] == 11, equal
    for J, ends in equal:
        assert bool(byte_ceiling.may_open(state, J, ends)) and not bool(byte_ceiling.may_open(state, J, ends - 1))
        assert bool(np.all(byte_ceiling.may_open(state, np.full((N, H), J), np.full((N, H), ends))))
    state.append(rng.standard_normal((N, H, T, d)), rng.standard_normal((N, H, T, d_v)))
    lay = state.layout
    for n in range(N):
        for h in range(H):
            assert list(np.asarray(lay.chunk_starts[n, h, : int(lay.num_chunks[n, h])])) == starts, (n, h)


# ------------------------------------------------------------------------ 4. threshold with sinks
def expected_compressed(T: int, window: int, min_tokens: int, sinks: int) -> int:
    """Spec/window.md W1 and W7: nothing is compressed while the whole state holds T < M tokens;
    after, everything but the S sinks and the last W tokens."""
    return 0 if T < min_tokens else max(T - sinks - window, 0)


@pytest.mark.parametrize("kind", ["static", "adaptive", "rotating"])
@pytest.mark.parametrize("appends", ["tokens", "block"])
def test_the_length_threshold_counts_the_sinks(rng, kind, appends):
    """W7: with S sinks the threshold M applies to the whole state, T = S + T', so the stream after
    the sinks is compressed from T' >= M - S on. S = 3, M = 6, W = 2: at T = 6, 7, 8 (M <= T <
    M + S) the state already holds 1, 2, 3 compressed tokens; a threshold on T' alone would hold
    none until T = 9. Appended token by token and in blocks that cross the threshold."""
    S, M, W, T, H, d = 3, 6, 2, 12, 2, 8
    assert after_sinks_threshold(M, S) == M - S and after_sinks_threshold(2, S) == 0 and after_sinks_threshold(M, 0) == M
    K, V = rng.standard_normal((H, T, d)), rng.standard_normal((H, T, d))
    options = dict(window=W, min_tokens=M, sinks=S)
    if kind == "static":
        state = sr.SubspaceState.static(sr.calibrate(K, V, rank_k=3, rank_v=3), **options)
    elif kind == "adaptive":
        state = sr.SubspaceState.adaptive(H, d, rank_k=3, rank_v=3, warmup=1, **options)
    else:
        state = sr.SubspaceState.rotating(H, d, rank_k=3, rank_v=3, refresh_every=2, warmup=1, **options)
    cuts = list(range(T + 1)) if appends == "tokens" else [0, 2, 7, 8, T]
    for a, b in zip(cuts[:-1], cuts[1:]):
        state.append(K[:, a:b], V[:, a:b])
        want = expected_compressed(b, W, M, S)
        assert (state.layout.num_tokens, state.window.sink_count, state.window.recent) == (want, min(b, S), b - min(b, S) - want), b
    assert [expected_compressed(t, W, M, S) for t in (6, 7, 8)] == [1, 2, 3]
    attention = pytest.importorskip("subspace_ref.hf.causal_attention")  # the transformers prefill's count
    lengths = np.arange(1, T + 1)
    compressed, sinks = attention.compressed_visible(state, lengths)
    assert list(compressed) == [expected_compressed(int(t), W, M, S) for t in lengths] and list(sinks) == list(np.minimum(lengths, S))


# ------------------------------------------------------------------------ 5. growth rates
def growing_nbytes(state) -> int:
    """The counted bytes of the arrays that grow (A7.3.1's G: all but the FIXED ones)."""
    return counted_nbytes(state, [name for name, a in BY_NAME.items() if a.axis != FIXED])


@pytest.mark.parametrize("coefficients", ["float", "int8", "int4", "int2"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_declared_growth_rates_are_the_measured_growth(rng, coefficients, dtype):
    """Spec A7.3: B_c and T_c (``layout.growth_rates``) are the bytes one more chunk and one more
    token add to the counted bytes. An adaptive state of ranks 3 / 2 (d = 8, d_v = 6, groups of
    4 keys) that opens chunks often (tau -> 0, no ceiling) holds, after every append that ends on
    a key-group boundary, exactly sum_heads(J) B_c + N H t T_c counted growing bytes: a per-group
    array (int4/int2 key scales and zeros, spec/quantization.md Q2) adds its row once per G
    tokens, so T_c charges it 1/G per token. In between, the unfinished group's scales are not
    held yet: the bytes lie below the formula by less than one group's rows."""
    N, H, d, d_v, G = 2, 2, 8, 6, 4
    state = sr.SubspaceState.adaptive(
        H, d, d_v, rank_k=3, rank_v=2, tau_k=1e-9, tau_v=1e-9, max_chunk=5, coefficients=coefficients, group_size=G, byte_ceiling=math.inf, batch=N, dtype=dtype
    )
    per_chunk, per_token = growth_rates(state)
    t = 0
    for n in (G, 1, 2, 1, 2 * G, 3, 5, G):
        state.append(rng.standard_normal((N, H, n, d)), rng.standard_normal((N, H, n, d_v)))
        t += n
        chunks = int(np.asarray(state.layout.num_chunks).sum())
        declared = chunks * per_chunk + N * H * t * per_token
        measured = growing_nbytes(state)
        if coefficients in ("int4", "int2") and t % G:
            group_row = 2 * 3 * 2  # fp16 scale and zero of r = 3 channels
            assert declared - N * H * group_row < measured < declared, (t, measured, declared)
        else:
            assert measured == declared, (t, measured, declared)
    assert int(np.asarray(state.layout.num_chunks).max()) > 2  # chunks were charged too
