"""A layer's decode step in one call of the C kernels (spec/layer_state.md L5.3;
``subspace_ref_torch.layer_decode``): the appends of every head group and the attention of every
query head over the states they leave, bit for bit the one-call append followed by
``subspace_ref.attend`` over the layer, and a step the call does not serve, or one that fails,
changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import subspace_ref  # noqa: E402
from subspace_ref_torch import kernel_library as lib  # noqa: E402
from subspace_ref_torch.layer_decode import layer_decoder  # noqa: E402
from tests.test_layer_append import GROUPS, _layer, _same, _tokens  # noqa: E402
from tests.test_layer_state import D, DV  # noqa: E402

pytestmark = pytest.mark.skipif(not lib.library_status()[0], reason=f"the C kernels are not built: {lib.library_status()[1]}")

H = len(GROUPS)
SCALE = 0.3


def _prefilled(rng, batch, sinks, window, prefill, g=2):
    """A layer and its copy holding the same ``prefill`` tokens, and a query like the step's."""
    layer = _layer(rng, batch, sinks, window)
    K, V = _tokens(rng, (batch, H, prefill, D)), _tokens(rng, (batch, H, prefill, DV))
    ref = layer.copy()
    for lay in (layer, ref):
        lay.append(K, V)
    return layer, ref, _tokens(rng, (batch, g * H, D))


@pytest.mark.parametrize("batch, sinks, window, prefill, g", [(2, 3, 5, 20, 2), (1, 0, 6, 30, 1), (3, 2, 3, 9, 3)])
def test_one_call_decodes_as_the_append_then_the_layer_attend_bit_for_bit(batch, sinks, window, prefill, g):
    rng = np.random.default_rng(11)
    layer, ref, q = _prefilled(rng, batch, sinks, window, prefill, g)
    states = [grp.state for grp in layer.groups]
    k, v = _tokens(rng, (batch, H, 1, D)), _tokens(rng, (batch, H, 1, DV))
    decoder = layer_decoder(layer, [grp.heads for grp in layer.groups], k, v, q, SCALE)
    assert decoder is not None
    served = 0
    for _ in range(20):  # int4 / int2 key groups finish and start again, capacity grows
        k, v, q = _tokens(rng, (batch, H, 1, D)) * 3, _tokens(rng, (batch, H, 1, DV)), _tokens(rng, (batch, g * H, D))
        out = decoder(states, k, v, q)
        ref.append(k, v)
        want = subspace_ref.attend(q, ref, backend="torch", scale=SCALE)
        if out is None:  # a step it does not serve (a capacity growth): the layer's own append
            layer.append(k, v)
        else:
            served += 1
            assert out.shape == want.shape and torch.equal(out, want)
        _same(layer, ref)
    assert served >= 15


def test_a_step_that_fails_changes_nothing():
    """A non-finite token: the call returns None with every group's layout and window objects as they
    were, and the groups' appends then raise the error."""
    rng = np.random.default_rng(3)
    layer, _, q = _prefilled(rng, 2, 2, 3, 12)
    states = [grp.state for grp in layer.groups]
    k, v = _tokens(rng, (2, H, 1, D)), _tokens(rng, (2, H, 1, DV))
    decoder = layer_decoder(layer, [grp.heads for grp in layer.groups], k, v, q, SCALE)
    assert decoder(states, k, v, q) is not None  # one served step, so that the next starts from what it committed
    before = [(st.layout, st.window, st.layout.num_tokens) for st in states]
    for bad in (float("nan"), float("inf")):
        k = _tokens(rng, (2, H, 1, D))
        k[1, 3, 0, 5] = bad
        assert decoder(states, k, v, q) is None
        assert [(st.layout, st.window, st.layout.num_tokens) for st in states] == before
        with pytest.raises(ValueError):
            layer.append(k, v)


def test_served_only_where_the_appends_and_the_attention_are_the_kernels():
    rng = np.random.default_rng(4)
    k, v = _tokens(rng, (1, H, 1, D)), _tokens(rng, (1, H, 1, DV))
    q = _tokens(rng, (1, 2 * H, D))
    no_window, _, _ = _prefilled(rng, 1, 0, 0, 8)
    assert layer_decoder(no_window, [grp.heads for grp in no_window.groups], k, v, q, SCALE) is None
    windowed, _, _ = _prefilled(rng, 1, 2, 3, 8)
    heads = [grp.heads for grp in windowed.groups]
    assert layer_decoder(windowed, heads, k, v, q.double(), SCALE) is None
    assert layer_decoder(windowed, heads, k.double(), v.double(), q, SCALE) is None
    assert layer_decoder(windowed, heads, k, v, q, SCALE) is not None
