"""Spec A1 (exact attention) and A3 (blockwise softmax, A3.1 equivalence, A3.2 merge)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from subspace_ref import exact_attention
from subspace_ref.blockwise_softmax import SoftmaxPartial


def softmax_output(logits, values):
    w = np.exp(logits - logits.max())
    return (w / w.sum()) @ values


def test_exact_attention_matches_definition(rng):
    q, K, V = rng.standard_normal((4, 8)), rng.standard_normal((2, 10, 8)), rng.standard_normal((2, 10, 5))
    out = exact_attention(q, K, V)
    for hq in range(4):
        expected = softmax_output(K[hq // 2] @ q[hq] / np.sqrt(8), V[hq // 2])
        np.testing.assert_allclose(out[hq], expected, rtol=1e-13, atol=1e-14 * np.abs(V).max())


def test_exact_attention_huge_logits_no_overflow(rng):
    q, K, V = rng.standard_normal((2, 8)), rng.standard_normal((2, 50, 8)), rng.standard_normal((2, 50, 3))
    out = exact_attention(1e4 * q, K, V, scale=1.0)
    assert np.isfinite(out).all()
    top = (K @ q[:, :, None])[..., 0].argmax(axis=1)
    np.testing.assert_allclose(out, V[np.arange(2), top], rtol=1e-12)


def test_exact_attention_rejects_bad_groups(rng):
    with pytest.raises(ValueError, match="multiple of the 2 KV heads"):
        exact_attention(rng.standard_normal((3, 4)), rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 5, 4)))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 60),
    cuts=st.lists(st.integers(0, 60), max_size=12),
    logit_scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4]),
    seed=st.integers(0, 2**31 - 1),
)
def test_blockwise_equals_global_softmax_for_any_split(n, cuts, logit_scale, seed):
    """Spec A3.1: any partition into chunks gives softmax over all logits, at any logit size."""
    rng = np.random.default_rng(seed)
    logits = logit_scale * rng.standard_normal(n)
    coef = rng.standard_normal((n, 3))
    bounds = sorted({0, n, *[c for c in cuts if c <= n]})
    bases = [rng.standard_normal((3, 4)) for _ in bounds[:-1]]
    partial = SoftmaxPartial.empty(4)
    values = np.zeros((n, 4))
    for (a, b), E in zip(zip(bounds[:-1], bounds[1:]), bases):
        partial.add_chunk(logits[a:b], coef[a:b], E)
        values[a:b] = coef[a:b] @ E
    out = partial.result()
    assert np.isfinite(out).all()
    expected = softmax_output(logits, values)
    np.testing.assert_allclose(out, expected, rtol=1e-11, atol=1e-12 * np.abs(values).max())


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 40), split=st.integers(1, 39), seed=st.integers(0, 2**31 - 1))
def test_partial_merge_is_the_split_sequence_rule(n, split, seed):
    """Spec A3.2: partials over disjoint halves merge, in either order, into the whole."""
    split = min(split, n - 1)
    rng = np.random.default_rng(seed)
    logits, coef, E = 50 * rng.standard_normal(n), rng.standard_normal((n, 2)), rng.standard_normal((2, 3))
    whole, left, right = SoftmaxPartial.empty(3), SoftmaxPartial.empty(3), SoftmaxPartial.empty(3)
    whole.add_chunk(logits, coef, E)
    left.add_chunk(logits[:split], coef[:split], E)
    right.add_chunk(logits[split:], coef[split:], E)
    for merged in (left.merge(right), right.merge(left), left.merge(SoftmaxPartial.empty(3)).merge(right)):
        np.testing.assert_allclose(merged.result(), whole.result(), rtol=1e-12)


def test_empty_partial_has_no_result():
    with pytest.raises(ValueError, match="no tokens"):
        SoftmaxPartial.empty(3).result()
