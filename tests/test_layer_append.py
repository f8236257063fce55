"""One call of the C kernels per layer and decode step for the appends (spec/layer_state.md L3;
``subspace_ref_torch.layer_append``): every head group's new token enters its exact window and
the window's oldest token is projected and stored, bit for bit as the groups' own appends, and a
step the call does not serve, or one that fails, changes nothing (the groups' appends then run
and raise as before)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from subspace_ref.hf_requirements import MIN_TRANSFORMERS  # noqa: E402
from subspace_ref.layer_state import HeadConfig, LayerState  # noqa: E402
from subspace_ref.layout import held_arrays  # noqa: E402
from subspace_ref_torch import kernel_library as lib  # noqa: E402
from subspace_ref_torch.layer_append import layer_appender  # noqa: E402
from tests.test_layer_state import D, DV, G, _basis, _rope  # noqa: E402

pytestmark = pytest.mark.skipif(not lib.library_status()[0], reason=f"the C kernels are not built: {lib.library_status()[1]}")

#: formats per side (mixed included), pre-RoPE, post-RoPE and identity keys, a rank-0 value side
GROUPS = [
    HeadConfig(5, 4, "int4", "int8", "pre_rope"),
    HeadConfig(D, DV, "int2", "int4", "identity", "identity"),
    HeadConfig(6, 5, "int8", "int8"),
    HeadConfig(7, DV, "float", "int2", "post_rope", "identity"),
    HeadConfig(4, 0, "int2", "float", "pre_rope"),
    HeadConfig(4, 3, "float", "float", "pre_rope"),
]


def _layer(rng, batch, sinks, window):
    layer = LayerState.from_heads(_basis(rng, len(GROUPS)), GROUPS, rope=_rope(), window=window, sinks=sinks, group_size=G, batch=batch, dtype="float32")
    return layer.to("torch")


def _tokens(rng, shape):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))


def _live(state) -> dict:
    """Every array the state reads, cut to its live rows (spare capacity is never read)."""
    T = state.layout.num_tokens
    out = {}
    for name, x in held_arrays(state).items():
        if name in ("key_coef", "value_coef", "key_scale", "value_scale", "value_token_scale", "value_token_zero"):
            x = x[:, :, :T]
        elif name in ("key_group_scale", "key_group_zero"):
            x = x[:, :, : T // G]
        out[name] = x
    return out


def _same(a, b) -> None:
    for ga, gb in zip(a.groups, b.groups):
        assert ga.state.num_tokens == gb.state.num_tokens
        la, lb = _live(ga.state), _live(gb.state)
        assert la.keys() == lb.keys()
        for name in la:
            assert la[name].shape == lb[name].shape and torch.equal(la[name], lb[name]), (ga.heads, name)


@pytest.mark.parametrize("batch, sinks, window, prefill", [(2, 3, 5, 20), (None, 4, 1, 9), (1, 0, 6, 30), (3, 2, 3, 4)])
def test_one_call_appends_as_the_groups_do_bit_for_bit(monkeypatch, batch, sinks, window, prefill):
    rng = np.random.default_rng(7)
    H = len(GROUPS)
    lead = (1 if batch is None else batch, H)
    layer = _layer(rng, 1 if batch is None else batch, sinks, window)
    ref = layer.copy()
    K, V = _tokens(rng, lead + (prefill, D)), _tokens(rng, lead + (prefill, DV))
    for lay in (layer, ref):
        lay.append(K, V)
    states = [g.state for g in layer.groups]
    heads = [g.heads for g in layer.groups]
    calls = []
    real = lib.library()

    class Counting:
        def __getattr__(self, name):
            fn = getattr(real, name)
            return (lambda *a: calls.append(name) or fn(*a)) if name == "layer_window_append" else fn

    monkeypatch.setattr(lib, "_library", Counting())
    appender = layer_appender(states, heads, K[:, :, :1], V[:, :, :1])
    assert appender is not None
    served = 0
    for step in range(2 * G + 3):
        k, v = _tokens(rng, lead + (1, D)) * 3, _tokens(rng, lead + (1, DV))
        ok = appender(states, k, v)
        served += ok
        if not ok:  # a window not yet full: the groups' own appends
            layer.append(k, v)
        ref.append(k, v)
        _same(layer, ref)
    assert served >= 2 * G and calls.count("layer_window_append") == served


def test_a_step_that_fails_changes_nothing():
    """A non-finite token, or a coefficient beyond float16's range: the call returns False with every
    group's layout and window objects as they were, and the groups' appends raise the error."""
    rng = np.random.default_rng(1)
    H = len(GROUPS)
    layer = _layer(rng, 2, 2, 3)
    layer.append(_tokens(rng, (2, H, 12, D)), _tokens(rng, (2, H, 12, DV)))
    states = [g.state for g in layer.groups]
    appender = layer_appender(states, [g.heads for g in layer.groups], _tokens(rng, (2, H, 1, D)), _tokens(rng, (2, H, 1, DV)))
    before = [(st.layout, st.window, st.layout.key_tail) for st in states]
    for bad in (float("nan"), float("inf")):
        k = _tokens(rng, (2, H, 1, D))
        k[1, 3, 0, 5] = bad
        assert not appender(states, k, _tokens(rng, (2, H, 1, DV)))
        assert [(st.layout, st.window, st.layout.key_tail) for st in states] == before
        with pytest.raises(ValueError):
            layer.append(k, _tokens(rng, (2, H, 1, DV)))
    # the window's oldest token, leaving for int4 / int2 stores, with coefficients beyond float16's range
    for st in states:
        st.window.keys[...] = 1e30
    for _ in range(G):
        ok = appender(states, _tokens(rng, (2, H, 1, D)), _tokens(rng, (2, H, 1, DV)))
        assert not ok
        assert [(st.layout, st.window, st.layout.key_tail) for st in states] == before


def test_served_only_where_the_kernels_serve_for_the_states_life(rng=None):
    rng = np.random.default_rng(2)
    H = len(GROUPS)
    k, v = _tokens(rng, (1, H, 1, D)), _tokens(rng, (1, H, 1, DV))
    no_window = _layer(rng, 1, 0, 0)
    assert layer_appender([g.state for g in no_window.groups], [g.heads for g in no_window.groups], k, v) is None
    windowed = _layer(rng, 1, 2, 3)
    assert layer_appender([g.state for g in windowed.groups], [g.heads for g in windowed.groups], k.double(), v.double()) is None
    assert layer_appender([g.state for g in windowed.groups], [g.heads for g in windowed.groups], k, v) is not None


@pytest.mark.parametrize("beams", [1, 2])
def test_generation_with_one_append_per_layer_is_the_childrens_bit_for_bit(monkeypatch, beams):
    """In the transformers cache: tokens and logits of ``generate`` (beams included) with the
    one-call append equal those of each child appending on its own, and the call is made."""
    pytest.importorskip("transformers", minversion=MIN_TRANSFORMERS)  # older: generate has no cache=
    from subspace_ref.hf import allocated_states, compress
    from subspace_ref.hf.grouped_layer import GroupedLayer
    from subspace_ref.rope import RopeParams
    from tests.test_hf_generation import model_for, prompt_ids
    from tests.test_hf_layer_state import mixed_allocation, mixed_bases

    model = model_for("llama", "float32")
    d = model.config.hidden_size // model.config.num_attention_heads
    alloc = mixed_allocation(d, 2, 3)
    factory = allocated_states(mixed_bases(model, alloc), alloc, rope=RopeParams.from_config(model.config))
    ids = prompt_ids(batch=2, length=9)
    kw = dict(max_new_tokens=10, do_sample=False, num_beams=beams, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    runs, counts = {}, {}
    real = lib.library()
    for one in (False, True):
        calls = []

        class Counting:
            def __getattr__(self, name):
                fn = getattr(real, name)
                return (lambda *a: calls.append(name) or fn(*a)) if name in ("layer_window_append", "layer_decode") else fn  # layer_decode appends first

        monkeypatch.setattr(lib, "_library", Counting())
        monkeypatch.setattr(GroupedLayer, "one_append", one)
        with compress(model, factory) as kv:
            runs[one] = model.generate(ids, cache=kv.cache(), **kw)
        counts[one] = len(calls)
    assert torch.equal(runs[False].sequences, runs[True].sequences)
    assert all(torch.equal(a, b) for a, b in zip(runs[False].logits, runs[True].logits))
    assert counts[False] == 0 and counts[True] > 0
