"""Layer states in the transformers cache (spec/layer_state.md, subspace_ref/hf/grouped_layer.py):
a layer whose heads differ decodes through one child layer per head group, with every feature of
a uniform layer (beams, left padding, crop, the model's dtype), and an artifact with an allocation
decodes exactly what it saved."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from subspace_ref.hf_requirements import MIN_TRANSFORMERS

pytest.importorskip("transformers", minversion=MIN_TRANSFORMERS)  # older: generate has no cache= (skipped, both versions named)

from subspace_ref import SubspaceState  # noqa: E402
from subspace_ref.allocation import Allocation, HeadAllocation  # noqa: E402
from subspace_ref.calibration import StaticBasis  # noqa: E402
from subspace_ref.hf import CalibratedBases, SubspaceCache, allocated_states, compress, static_states  # noqa: E402
from subspace_ref.hf.grouped_layer import GroupedLayer  # noqa: E402
from subspace_ref.hf.teacher_forced import decode_token_by_token  # noqa: E402
from subspace_ref.layer_state import HeadGroup, LayerState  # noqa: E402
from subspace_ref.rope import RopeParams  # noqa: E402
from tests.test_hf_features import sr_basis  # noqa: E402
from tests.test_hf_generation import check_call, model_for, prompt_ids, tolerance  # noqa: E402

torch.set_num_threads(1)


def split_states(basis: StaticBasis, coefficients: str):
    """A factory of layer states holding each KV head in a group of its own, every head the
    configuration ``static_states([basis], coefficients=...)`` gives all of them at once."""

    def factory(spec):
        groups = []
        for h in range(spec.heads):
            one = StaticBasis(B=basis.B[h : h + 1], E=basis.E[h : h + 1], gamma=basis.gamma[h : h + 1], rank_k=basis.rank_k[h : h + 1], rank_v=basis.rank_v[h : h + 1])
            groups.append(HeadGroup((h,), SubspaceState.static(one, batch=spec.batch, dtype=spec.state_dtype, coefficients=coefficients, bases="float16")))
        return LayerState(spec.heads, groups)

    return factory


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_split_groups_decode_as_the_uniform_layer_with_beams_and_left_padding(dtype):
    """Heads split into groups give the uniform cache's beams and logits under a left-padding mask."""
    model = model_for("llama", dtype)
    basis = sr_basis(model, 6)
    ids = prompt_ids(batch=2, length=10)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding of the first sequence
    kw = dict(max_new_tokens=6, num_beams=2, do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0, attention_mask=mask)
    with compress(model, static_states([basis] * 2, coefficients="int8")) as kv:
        uniform = model.generate(ids, cache=kv.cache(), **kw)
    with compress(model, split_states(basis, "int8")) as kv:
        cache = kv.cache()
        split = model.generate(ids, cache=cache, **kw)
    assert all(isinstance(layer, GroupedLayer) for layer in cache.layers)
    assert all(layer.children[0].state.dtype == (torch.bfloat16 if dtype == "bfloat16" else torch.float32) for layer in cache.layers)
    assert check_call(f"llama/{dtype}/split", model, uniform, split, True, False, tolerance("llama", dtype))


def mixed_allocation(d: int, sinks: int, window: int) -> Allocation:
    """Per layer: a low-rank pre-RoPE int4 head and an identity int8 / float head (spec/layer_state.md L1)."""
    layer = (HeadAllocation(5, 4, 4, 4, "pre_rope"), HeadAllocation(d, d, 8, 16, "identity", "identity"))
    return Allocation((layer, layer), group=4, window=window, sinks=sinks)


def mixed_bases(model, alloc: Allocation) -> list[StaticBasis]:
    basis = sr_basis(model, 5)
    layer = StaticBasis(B=basis.B * np.array([1.0, 0.0])[:, None, None], E=basis.E[:, :4] * np.array([1.0, 0.0])[:, None, None],
                        gamma=np.ones(2), rank_k=(5, 0), rank_v=(4, 0))
    return [layer] * alloc.layers


@pytest.mark.parametrize("sinks, window", [(2, 3), (0, 0), (3, 0)])
def test_prefill_equals_decoding_for_pre_rope_heads_with_sinks_and_a_window(sinks, window):
    """spec/window.md W10 through the cache: one forward over the prompt (the causal evaluation,
    compressed tokens at positions offset by the sinks) gives the logits of decoding token by
    token (subspace_ref.attend each step), for low-rank pre-RoPE int4 heads beside identity ones."""
    model = copy.deepcopy(model_for("llama")).to(torch.float64)
    d = model.config.hidden_size // model.config.num_attention_heads
    alloc = mixed_allocation(d, sinks, window)
    factory = allocated_states(mixed_bases(model, alloc), alloc, rope=RopeParams.from_config(model.config))
    ids = prompt_ids(batch=2, length=17)
    with compress(model, factory) as kv, torch.no_grad():
        prefill = model(ids, cache=kv.cache()).logits
    stepwise = decode_token_by_token(model, ids, factory)
    scale = float(prefill.abs().max())
    torch.testing.assert_close(prefill, stepwise, rtol=0, atol=1e-5 * scale)  # Llama's float32 RMSNorm in a float64 model (test_hf_cache.py)
    with compress(model, full_and_pre_rope_exact(model)) as kv, torch.no_grad():
        exact = model(ids, cache=kv.cache()).logits
    assert float((prefill - exact).abs().max()) > 1e-6 * scale  # the compression is lossy here: the comparison above is not vacuous


def full_and_pre_rope_exact(model):
    d = model.config.hidden_size // model.config.num_attention_heads
    layer = (HeadAllocation(d, d, 16, 16, "identity", "identity"),) * 2
    alloc = Allocation((layer, layer))
    zero = StaticBasis(B=np.zeros((2, 1, d)), E=np.zeros((2, 1, d)), gamma=np.ones(2), rank_k=(0, 0), rank_v=(0, 0))
    return allocated_states([zero, zero], alloc)


def test_identity_heads_in_float_reproduce_the_stock_cache():
    model = copy.deepcopy(model_for("llama")).to(torch.float64)
    ids = prompt_ids(batch=2, length=12)
    with torch.no_grad():
        stock = model(ids).logits
    with compress(model, full_and_pre_rope_exact(model)) as kv, torch.no_grad():
        cache = kv.cache()
        got = model(ids, cache=cache).logits
    torch.testing.assert_close(got, stock, rtol=0, atol=1e-5 * float(stock.abs().max()))  # Llama's float32 RMSNorm (test_hf_cache.py)
    assert cache.nbytes == cache.full_cache_nbytes + 2 * 2 * 8  # identity bases uncounted: coefficients (as K, V) and gamma


def test_an_artifact_with_an_allocation_decodes_what_it_saved(tmp_path):
    """compress(model, bases) builds the saved allocation's layer states (formats, kinds, sinks,
    window, group), with no other argument; the reloaded artifact gives the same logits."""
    model = copy.deepcopy(model_for("llama")).to(torch.float64)
    d = model.config.hidden_size // model.config.num_attention_heads
    alloc = mixed_allocation(d, 2, 3)
    saved = CalibratedBases.for_model(model, mixed_bases(model, alloc), allocation=alloc).save_pretrained(tmp_path / "bases")
    bases = CalibratedBases.from_pretrained(saved, model.config)
    ids = prompt_ids(batch=1, length=15)
    with compress(model, bases) as kv, torch.no_grad():
        cache = kv.cache()
        got = model(ids, cache=cache).logits
    layer = cache.layers[0]
    assert isinstance(layer, GroupedLayer)
    st = layer.state
    assert [g.state.layout.coefficients for g in st.groups] == ["int4", "int8/float"]
    assert st.window.size == 3 and st.window.sinks == 2 and st.groups[0].state.layout.group == 4
    assert st.groups[0].state.policy.rope is not None and st.groups[1].key_identity and st.groups[1].value_identity
    factory = allocated_states(mixed_bases(model, alloc), alloc, rope=RopeParams.from_config(model.config), basis_format=bases.basis_format)
    with compress(model, factory) as kv, torch.no_grad():
        want = model(ids, cache=kv.cache()).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="config"):
        bases.states()  # pre-RoPE heads need the model's RoPE


def test_crop_through_grouped_layers_equals_greedy_decoding():
    """Prompt lookup crops rejected candidates from every group (restore points of int4 groups)."""
    model = copy.deepcopy(model_for("llama")).to(torch.float64)
    d = model.config.hidden_size // model.config.num_attention_heads
    alloc = mixed_allocation(d, 0, 0)
    factory = allocated_states(mixed_bases(model, alloc), alloc, rope=RopeParams.from_config(model.config))
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
    kw = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    with compress(model, factory) as kv:
        greedy = model.generate(ids, cache=kv.cache(), **kw)
        lookup = model.generate(ids, prompt_lookup_num_tokens=3, cache=kv.cache(), **kw)
    assert check_call("llama/grouped/lookup", model, greedy, lookup, True, False, tolerance("llama", "float32"))


def test_a_layer_state_for_another_model_is_refused():
    model = model_for("llama")
    d = model.config.hidden_size // model.config.num_attention_heads
    alloc = Allocation(((HeadAllocation(d, d, 16, 16, "identity", "identity"),) * 3,) * 2)
    zero = StaticBasis(B=np.zeros((3, 1, d)), E=np.zeros((3, 1, d)), gamma=np.ones(3), rank_k=(0,) * 3, rank_v=(0,) * 3)
    cache = SubspaceCache(model.config, allocated_states([zero, zero], alloc))
    with compress(model, allocated_states([zero, zero], alloc)), pytest.raises(ValueError, match="3 KV heads, the model 2"):
        model(prompt_ids(batch=1, length=4), cache=cache)


@pytest.mark.parametrize(
    "backend, dtype, sinks, window", [("torch", "float32", 2, 3), ("torch", "float32", 0, 0), ("torch", "bfloat16", 1, 4), ("numpy", "float32", 2, 3)]
)
def test_one_attend_per_decode_step_generates_what_the_children_do(monkeypatch, backend, dtype, sinks, window):
    """spec/layer_state.md L5.2 in the cache: a decode step appends every group's token, then one
    ``subspace_ref.attend`` over the layer state (on the torch backend, one call of the C kernels
    for the layer's groups) gives the tokens and logits of one attend per child, bit for bit."""
    from subspace_ref_torch import kernel_library as lib
    from tests.test_layer_kernel import CountingLibrary

    model = model_for("llama", dtype)
    d = model.config.hidden_size // model.config.num_attention_heads
    alloc = mixed_allocation(d, sinks, window)
    factory = allocated_states(mixed_bases(model, alloc), alloc, rope=RopeParams.from_config(model.config))
    ids = prompt_ids(batch=2, length=9)
    kw = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    runs = {}
    for one in (False, True):
        monkeypatch.setattr(GroupedLayer, "one_attend", one)
        counting = CountingLibrary(lib.library()) if lib.library_status()[0] else None
        if counting is not None:
            monkeypatch.setattr(lib, "_library", counting)
        with compress(model, factory, backend=backend) as kv:
            cache = kv.cache()
            runs[one] = model.generate(ids, cache=cache, **kw), None if counting is None else dict(counting.calls)
        assert all(isinstance(layer, GroupedLayer) for layer in cache.layers)
    (children, child_calls), (layer, layer_calls) = runs[False], runs[True]
    assert torch.equal(children.sequences, layer.sequences)
    assert all(torch.equal(a, b) for a, b in zip(children.logits, layer.logits))
    if backend == "torch" and dtype == "float32" and layer_calls is not None:
        # each decode step of each layer: one layer_attention, but for the step that admits the queries
        # (in bfloat16 the float value side is stored in bfloat16, which the kernel does not read: group by group);
        # with full exact windows, one layer_decode (the appends and the attention, subspace_ref_torch.layer_decode);
        # the children then take one layer_decode each (a one-state layer's step: SubspaceLayer._one_call_step)
        layers, steps = len(cache.layers), len(layer.logits) - 1
        one_call = "layer_decode" if window else "layer_attention"
        assert layer_calls.get(one_call, 0) >= layers * (steps - 1)
        children = sum(len(grouped.children) for grouped in cache.layers)
        assert "layer_attention" not in child_calls and child_calls.get("layer_decode", 0) >= (children * (steps - 1) if window else 0)
        assert layer_calls.get("layer_decode", 0) < child_calls.get("layer_decode", 0) or not window


@pytest.mark.parametrize("coefficients, rope", [("int4", True), ("float", True), ("int8", False)])  # (post-RoPE float coefficients: torch's own products)
def test_a_one_state_layer_decodes_in_one_call_as_its_own_append_and_attend(monkeypatch, coefficients, rope):
    """spec/layer_state.md L5.3 for a layer of one SubspaceState (SubspaceLayer._one_call_step: the
    state as a one-group layer): greedy tokens and logits bit for bit those of the step's own
    append then ``subspace_ref.attend``, with one ``layer_decode`` per layer and step once the
    window is full."""
    from subspace_ref.hf.cache_layer import SubspaceLayer
    from subspace_ref_torch import kernel_library as lib
    from tests.test_layer_kernel import CountingLibrary

    if not lib.library_status()[0]:
        pytest.skip(f"the C kernels are not built: {lib.library_status()[1]}")
    model = model_for("llama", "float32")
    basis = sr_basis(model, 5)
    options = dict(coefficients=coefficients, sinks=2, window=3) | (dict(rope=RopeParams.from_config(model.config)) if rope else {})
    ids = prompt_ids(batch=2, length=9)
    kw = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    runs = {}
    for one in (False, True):
        if not one:
            monkeypatch.setattr(SubspaceLayer, "_one_call_step", lambda self, query, scale: None)
        else:
            monkeypatch.undo()
        counting = CountingLibrary(lib.library())
        monkeypatch.setattr(lib, "_library", counting)
        with compress(model, static_states([basis] * 2, **options)) as kv:
            cache = kv.cache()
            runs[one] = model.generate(ids, cache=cache, **kw), dict(counting.calls)
        assert all(isinstance(layer, SubspaceLayer) for layer in cache.layers)
    (own, own_calls), (one, one_calls) = runs[False], runs[True]
    assert torch.equal(own.sequences, one.sequences)
    assert all(torch.equal(a, b) for a, b in zip(own.logits, one.logits))
    steps = len(one.logits) - 1
    assert "layer_decode" not in own_calls and one_calls.get("layer_decode", 0) >= len(cache.layers) * (steps - 1)


def _fresh_versions(layer):
    """What keep_restore_point keeps, computed afresh from the state's arrays."""
    from subspace_ref.layout import FIXED_ARRAYS, held_arrays

    return {name: (x, x._version) for name, x in held_arrays(layer.state, FIXED_ARRAYS).items()}


@pytest.mark.parametrize("grouped", [True, False])
def test_a_one_call_step_carries_the_next_restore_point(grouped):
    """SubspaceLayer.carry_restore_point: after each one-call decode step the next forward's
    restore point is the one keep_restore_point would take afresh (the same arrays, the same
    versions), and it still refuses a state written in place, whether the array was one the
    step replaced (the window's keys) or one it kept (the sinks)."""
    from subspace_ref.hf.cache_layer import SubspaceLayer
    from subspace_ref_torch import kernel_library as lib

    if not lib.library_status()[0]:
        pytest.skip(f"the C kernels are not built: {lib.library_status()[1]}")
    model = model_for("llama", "float32")
    rope = RopeParams.from_config(model.config)
    if grouped:
        d = model.config.hidden_size // model.config.num_attention_heads
        alloc = mixed_allocation(d, 2, 3)
        factory = allocated_states(mixed_bases(model, alloc), alloc, rope=rope)
    else:
        factory = static_states([sr_basis(model, 5)] * 2, coefficients="int4", sinks=2, window=3, rope=rope)
    ids = prompt_ids(batch=1, length=12)
    with compress(model, factory) as kv, torch.no_grad():
        cache = kv.cache()
        model(ids[:, :9], cache=cache)
        children = cache.state_layers
        assert all(isinstance(c, SubspaceLayer) for c in children) and isinstance(cache.layers[0], GroupedLayer) == grouped
        for t in range(9, 12):
            model(ids[:, t : t + 1], cache=cache)
            assert all(c._carried is not None for c in children)  # every layer took the one-call step
            fresh = [_fresh_versions(c) for c in children]
            held = [c.get_seq_length() for c in children]
            cache.begin_forward(children[0].layer_idx)  # the next forward's restore points, from what was carried
            for c, want, tokens in zip(children, fresh, held):
                got = c._restore_point[1]
                assert got.keys() == want.keys() and all(got[n][0] is want[n][0] and got[n][1] == want[n][1] for n in want)
                assert c._forward_start == tokens == t + 1  # carried too: where a crop or rollback goes back to
        for name, array in (("window_keys", lambda st: st.window.keys), ("sink_keys", lambda st: st.window.sink_keys)):
            model(ids[:, -1:], cache=cache)
            array(cache.state_layers[0]._restore_point[0]).add_(1.0)  # written in place since the forward began
            with pytest.raises(RuntimeError, match=f"{name} changed in place"):
                cache.crop(-1)


@pytest.mark.parametrize("one_call", [False, True])
def test_a_failing_layer_attend_gives_back_every_groups_token(monkeypatch, one_call):
    """A decode step whose one attend fails after every group appended: the attention function's
    ``abandon`` gives back the tokens of the forward, every group at its old length and outputs.
    With the one-call step (appends and attention in one C call, subspace_ref_torch.layer_decode),
    the first layer's step succeeds and the second layer's fails: the first gives its token back."""
    import subspace_ref
    from subspace_ref_torch.layer_decode import LayerDecoder

    model = model_for("llama", "float32")
    d = model.config.hidden_size // model.config.num_attention_heads
    alloc = mixed_allocation(d, 2, 3)
    factory = allocated_states(mixed_bases(model, alloc), alloc, rope=RopeParams.from_config(model.config))
    ids = prompt_ids(batch=1, length=9)
    with compress(model, factory) as kv, torch.no_grad():
        cache = kv.cache()
        model(ids, cache=cache)
        step = ids[:, -1:]
        want = model(step, cache=cache).logits
        cache.crop(-1)
        lengths = [[c.state.num_tokens for c in layer.children] for layer in cache.layers]
        steps = []

        def boom(*args, **kwargs):
            raise RuntimeError("attend failed")

        def second_fails(self, *args):
            steps.append(self)
            return real_call(self, *args) if len(steps) == 1 else boom()

        real_call = LayerDecoder.__call__
        with monkeypatch.context() as m:
            if one_call:
                m.setattr(LayerDecoder, "__call__", second_fails)
            else:
                m.setattr(GroupedLayer, "_one_call_step", lambda *args: None)  # the one-call append, then the attend
                m.setattr(subspace_ref, "attend", boom)
            with pytest.raises(RuntimeError, match="attend failed"):
                model(step, cache=cache)
        assert len(steps) == (2 if one_call else 0)
        assert [[c.state.num_tokens for c in layer.children] for layer in cache.layers] == lengths
        assert torch.equal(model(step, cache=cache).logits, want)
