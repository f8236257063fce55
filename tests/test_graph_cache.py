"""The graph-capturable cache (subspace_ref/hf/graph_cache.py, spec/models.md M11).

It computes spec A2 through torch SDPA over (γBq, C, D) in preallocated tensors, so it is held
to the oracle cache (``SubspaceCache`` on the numpy backend) on float64 models, at the
tolerances ``tests/test_hf_cache.py`` derives (1e-10 of the logits' scale; 1e-5 for Llama,
whose RMSNorm rounds to float32). Compiled against eager: the same greedy tokens with
``fullgraph=True`` (a graph break fails the compile), on tiny float32 models whose top-2
margins are checked first. Refusals name their reasons and leave nothing behind.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from subspace_ref.hf_requirements import MIN_TRANSFORMERS

pytest.importorskip("transformers", minversion=MIN_TRANSFORMERS)  # older: generate has no cache= (skipped, both versions named)

from transformers import CompileConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

import subspace_ref as sr  # noqa: E402
from subspace_ref.capabilities import NotSupportedError  # noqa: E402
from subspace_ref.hf import GraphSubspaceCache, StateSpec, SubspaceCache, compress, full_rank_states, graph_refusals, static_states, use_subspace_attention  # noqa: E402
from subspace_ref.hf.compress import CAPACITY_STEP, generation_capacity  # noqa: E402
from subspace_ref.hf.graph_cache import model_graph_refusals  # noqa: E402
from subspace_ref.hf.graph_window import compressed_count  # noqa: E402
from subspace_ref.workloads import random_static_bases  # noqa: E402

torch.set_num_threads(1)
VOCAB = 128
RANK = 8


def make_model(family: str, dtype=torch.float64, seed: int = 0):
    torch.manual_seed(seed)
    if family in ("llama", "llama-yarn"):  # GQA: 4 query heads over 2 KV heads of 16
        # yarn: RoPE with attention scaling a != 1 (spec/rope.md §1: R_t = a Q_t)
        yarn = dict(rope_scaling=dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=64)) if family == "llama-yarn" else {}
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=VOCAB, initializer_range=0.2, max_position_embeddings=128, **yarn)
        model = LlamaForCausalLM(cfg)
    else:  # no RoPE, per-layer inverse scaling (the attention call's `scaling`)
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=128, initializer_range=0.2,
                         scale_attn_by_inverse_layer_idx=True, bos_token_id=None, eos_token_id=None)
        model = GPT2LMHeadModel(cfg)
    return model.eval().to(dtype)


def random_bases(model, rank: int = RANK, seed: int = 1) -> list:
    """Random orthonormal rank-``rank`` bases per layer, γ away from 1 (what A2 scales)."""
    text = model.config.get_text_config(decoder=True)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    gamma = np.random.default_rng(seed).uniform(0.8, 1.2, heads)
    return random_static_bases(text.num_hidden_layers, heads, text.hidden_size // text.num_attention_heads, rank, seed, gamma)


def ids_of(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:n][None]


def logits_through(model, cache, ids, steps: int) -> list[torch.Tensor]:
    """Prefill logits of ``ids`` then ``steps`` teacher-forced one-token decode steps."""
    out = [model(input_ids=ids, cache=cache).logits]
    for t in range(steps):
        out.append(model(input_ids=torch.tensor([[(7 * t + 3) % VOCAB]]), cache=cache).logits)
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_graph_cache_matches_the_oracle_cache(family):
    """Prefill and decode logits of the graph cache equal the numpy-backend SubspaceCache's
    (spec A2 both ways) at the float64 tolerance; so do greedy tokens."""
    model = make_model(family)
    bases = random_bases(model)
    ids = ids_of(12, 0)
    use_subspace_attention(model)
    capacity = ids.shape[1] + 6
    with torch.no_grad():
        graph = logits_through(model, GraphSubspaceCache(model.config, static_states(bases), max_cache_len=capacity), ids, 5)
        oracle = logits_through(model, SubspaceCache(model.config, static_states(bases), backend="numpy"), ids, 5)
    tol = 1e-5 if family == "llama" else 1e-10
    for a, b in zip(graph, oracle):
        scale = float(b.abs().max())
        assert float((a - b).abs().max()) <= tol * scale
    with compress(model, bases, graph=True) as kv:
        graph_tokens = kv.generate(ids, max_new_tokens=6, do_sample=False)
    with compress(model, bases, graph=False, backend="numpy") as kv:
        oracle_tokens = kv.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(graph_tokens, oracle_tokens)


QUANTISED = {"int8": "int8", "float-int8": ("float", "int8"), "int4": "int4", "int2": "int2", "int4-int8": ("int4", "int8")}


@pytest.mark.parametrize("coefficients", list(QUANTISED))
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_quantised_graph_cache_matches_the_oracle_cache(family, coefficients):
    """int8 and int4/int2 sides (spec A10, Q1-Q2) in the fixed layout (M11.8): a 12-token
    prefill stored as a block, decode steps one token at a time across key groups of 8, then a
    5-token block into a group begun before it, read back whole by the SDPA form (the block over
    low-bit keys by M11.8 step 3; float64 models have no kernel), equal to the numpy cache
    of the same states at the float64 tolerances of test_graph_cache_matches_the_oracle_cache;
    and beam search, reordering every stored array in place, gives its sequences."""
    model = make_model(family)
    factory = static_states(random_bases(model), coefficients=QUANTISED[coefficients], group_size=8)
    cache = matches_the_oracle_cache(model, factory, 1e-5 if family == "llama" else 1e-10)
    assert cache.layers[0].groups[0].layout is not None and not cache.layers[0].groups[0].kernel


def matches_the_oracle_cache(model, factory, tol: float, prompt: int = 12) -> GraphSubspaceCache:
    """Assert that a graph cache of ``factory``'s states gives the numpy cache's logits (within
    ``tol`` of their scale) over a ``prompt``-token prefill stored as a block, 9 one-token steps
    (across key groups of 8), then a 5-token block into a begun group, whose queries see its keys
    unquantised until their group completes (Q2.2); and its greedy and beam sequences. Returns
    the graph cache."""
    ids = ids_of(prompt, 2)
    use_subspace_attention(model)
    with torch.no_grad():
        cache = GraphSubspaceCache(model.config, factory, max_cache_len=ids.shape[1] + 9 + 5)
        oracle_cache = SubspaceCache(model.config, factory, backend="numpy")
        graph, oracle = (logits_through(model, c, ids, 9) for c in (cache, oracle_cache))
        seen = torch.ones((1, ids.shape[1] + 9 + 5), dtype=torch.long)
        for c, out in ((cache, graph), (oracle_cache, oracle)):
            out.append(model(input_ids=ids_of(5, 3), attention_mask=seen, cache=c).logits)
    for a, b in zip(graph, oracle):
        assert float((a - b).abs().max()) <= tol * float(b.abs().max())
    for search in (dict(), dict(num_beams=3)):
        with compress(model, factory, graph=True) as kv:
            tokens = kv.generate(ids, max_new_tokens=5, do_sample=False, **search)
        with compress(model, factory, graph=False, backend="numpy") as kv:
            assert torch.equal(tokens, kv.generate(ids, max_new_tokens=5, do_sample=False, **search))
    return cache


PRE_ROPE = {"float": "float", "int8": "int8", "int4": "int4", "int4-int8": ("int4", "int8")}


@pytest.mark.parametrize("coefficients", list(PRE_ROPE))
@pytest.mark.parametrize("family", ["llama", "llama-yarn"])
def test_pre_rope_graph_cache_matches_the_oracle_cache(family, coefficients):
    """Pre-RoPE states (spec/rope.md P2-P3) in the fixed layout (M11.10): keys un-rotated by
    their slots as they are written, rebuilt and rotated back by their slots for SDPA (float64
    models have no kernel). A 12-token prefill, one-token steps across key groups of 8, then a
    5-token block, equal to the numpy cache of the same states at the float64 Llama tolerance of
    test_graph_cache_matches_the_oracle_cache, with RoPE's attention scaling 1 and not (yarn);
    and greedy and beam search give its sequences."""
    model = make_model(family)
    rope = sr.rope.RopeParams.from_config(model.config)
    assert (rope.attention_scaling != 1.0) == (family == "llama-yarn")
    factory = static_states(random_bases(model), coefficients=PRE_ROPE[coefficients], group_size=8, rope=rope)
    cache = matches_the_oracle_cache(model, factory, 1e-5)
    assert cache.layers[0].groups[0].rope is rope and cache.layers[0].groups[0].layout is not None


def test_pre_rope_keys_are_not_the_post_rope_form():
    """The pre-RoPE layer is not a post-RoPE layer with other bases: the same bases held post-RoPE
    give other logits (so the equality above tests the rotation)."""
    model = make_model("llama")
    bases = random_bases(model)
    use_subspace_attention(model)
    ids = ids_of(12, 2)
    rope = sr.rope.RopeParams.from_config(model.config)
    with torch.no_grad():
        pre = model(input_ids=ids, cache=GraphSubspaceCache(model.config, static_states(bases, rope=rope), max_cache_len=16)).logits
        post = model(input_ids=ids, cache=GraphSubspaceCache(model.config, static_states(bases), max_cache_len=16)).logits
    assert float((pre - post).abs().max()) > 1e-2 * float(post.abs().max())


def test_left_padding_over_pre_rope_keys_is_refused_and_changes_nothing():
    """Pre-RoPE keys are un-rotated by their slot, which is not the position transformers rotated a
    left-padded sequence's key by: refused by name (as the SubspaceCache refuses it), the forward's
    tokens taken back from every layer."""
    model = make_model("llama")
    factory = static_states(random_bases(model), rope=sr.rope.RopeParams.from_config(model.config))
    use_subspace_attention(model)
    ids = torch.cat([ids_of(9, 5), ids_of(9, 6)])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cache = GraphSubspaceCache(model.config, factory, max_cache_len=12)
    with torch.no_grad(), pytest.raises(NotSupportedError, match="left padding"):
        model(input_ids=ids, attention_mask=mask, cache=cache)
    assert [int(layer.cumulative_length) for layer in cache.layers] == [0, 0]
    with torch.no_grad():  # the same cache then takes an unpadded batch
        model(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache)
    assert int(cache.get_seq_length()) == 9


def per_head_groups(basis, **state_kw):
    """A factory of layer states holding each KV head of ``basis`` in a head group of its own,
    the groups in reverse head order (heads stored apart, the groups' query heads permuted
    back), each a static state with ``state_kw``."""
    from subspace_ref.layer_state import HeadGroup, LayerState

    def factory(spec):
        groups = []
        for h in reversed(range(spec.heads)):
            one = sr.StaticBasis(B=basis.B[h : h + 1], E=basis.E[h : h + 1], gamma=basis.gamma[h : h + 1], rank_k=basis.rank_k[h : h + 1],
                                 rank_v=basis.rank_v[h : h + 1])
            groups.append(HeadGroup((h,), sr.SubspaceState.static(one, batch=spec.batch, dtype=spec.state_dtype, **state_kw)))
        return LayerState(spec.heads, groups)

    return factory


def mixed_layer_states(model, split: bool, sinks: int = 0, window: int = 0):
    """A factory of layer states whose KV heads differ: ``split``, each head its own group of
    float post-RoPE coefficients (:func:`per_head_groups`); else per layer a pre-RoPE int4 head
    of rank 5 beside an identity head with int8 keys and float values
    (tests/test_hf_layer_state.py's allocation, key groups of 4), with the layer's ``sinks`` and ``window``."""
    from tests.test_hf_layer_state import mixed_allocation, mixed_bases

    if split:
        return per_head_groups(random_bases(model)[0])
    alloc = mixed_allocation(model.config.hidden_size // model.config.num_attention_heads, sinks, window)
    return sr.hf.allocated_states(mixed_bases(model, alloc), alloc, rope=sr.rope.RopeParams.from_config(model.config))


@pytest.mark.parametrize("split", [True, False], ids=["split-float", "pre-RoPE-int4-and-identity-int8"])
def test_layer_states_decode_group_by_group_as_the_oracle_cache(split):
    """M11.12: a LayerState's head groups held and attended group by group (each its own storage,
    query heads put back in order) give the numpy cache's logits over a block prefill, one-token
    steps across key groups and a second block, and its greedy and beam sequences."""
    model = make_model("llama")
    cache = matches_the_oracle_cache(model, mixed_layer_states(model, split), 1e-5)
    assert all(len(layer.groups) == 2 for layer in cache.layers)


def test_layer_states_are_refused_by_head_group():
    """A layer state's refusals are its head groups' (here a compression threshold beyond the
    window, M11.14), named with the heads."""
    model = make_model("llama")
    factory = per_head_groups(random_bases(model)[0], window=2, min_tokens=10)
    reasons = model_graph_refusals(model.config, factory)
    assert any(r.startswith("layer 0: heads [1]: a compression threshold") for r in reasons) and any(r.startswith("layer 1: heads [0]: a compression") for r in reasons)
    with pytest.raises(NotSupportedError, match="a compression threshold"):
        GraphSubspaceCache(model.config, factory, max_cache_len=16)


def test_windowed_crop_takes_back_only_tokens_that_compressed_nothing():
    """A windowed layer gives back tokens that moved nothing to the compressed part (the logits of
    a cache that never held them); a crop that needs a token the ring has given up is refused,
    the cache unchanged (M11.14 step 2)."""
    model = make_model("llama")
    factory = static_states(random_bases(model), sinks=2, window=3)
    use_subspace_attention(model)
    step = lambda cache, token: model(input_ids=torch.tensor([[token]]), cache=cache).logits  # noqa: E731
    with torch.no_grad():
        cache, reference = (GraphSubspaceCache(model.config, factory, max_cache_len=16) for _ in range(2))
        for c in (cache, reference):
            model(input_ids=ids_of(3, 1), cache=c)
        step(cache, 7)
        cache.crop(-1)  # 4 tokens: nothing compressed yet (sinks 2 + window 3)
        got, want = step(cache, 9), step(reference, 9)
        assert float((got - want).abs().max()) <= 1e-12 * float(want.abs().max())
        for token in (1, 2, 3):
            step(cache, token)  # 7 tokens: 2 compressed
        with pytest.raises(RuntimeError, match="the window has compressed"):
            cache.crop(-1)
    assert int(cache.get_seq_length()) == 7 and int(cache.layers[0].compressed) == 2


WINDOWED = {  # (sinks, window, min_tokens, coefficients, pre-RoPE)
    "sinks2-window3-float": (2, 3, 0, "float", False),
    "window4-int4": (0, 4, 0, "int4", False),
    "sinks3-int8": (3, 0, 0, "int8", False),
    "sinks2-window3-pre-RoPE-int4": (2, 3, 0, "int4", True),
    "sinks4-window5-threshold9-pre-RoPE-float": (4, 5, 9, "float", True),
}


@pytest.mark.parametrize("prompt", [2, 12], ids=["sinks-and-ring-fill-while-decoding", "ring-full"])
@pytest.mark.parametrize("name", list(WINDOWED))
def test_windowed_graph_cache_matches_the_oracle_cache(name, prompt):
    """Exact sinks and a recent window (spec/window.md W1-W10) at fixed addresses (M11.14): the
    sinks and a ring of W slots written at the device count, the token the ring gives up
    compressed, the compressed part merged with the exact one by log-sum-exps; equal to the numpy
    cache of the same states (a block prefill whose queries each see their own split, one-token
    steps, a second block), with pre-RoPE keys at positions offset by the sinks (W10), and its
    greedy and beam sequences. A 2-token prompt leaves the sinks and the ring to fill during the
    one-token steps."""
    S, W, M, coefficients, pre_rope = WINDOWED[name]
    model = make_model("llama")
    rope = sr.rope.RopeParams.from_config(model.config) if pre_rope else None
    factory = static_states(random_bases(model), coefficients=coefficients, group_size=4, rope=rope, sinks=S, window=W, min_tokens=M)
    cache = matches_the_oracle_cache(model, factory, 1e-5, prompt)
    assert cache.layers[0].exact is not None and int(cache.layers[0].compressed) == compressed_count(prompt + 9 + 5, S, W)


@pytest.mark.parametrize("coefficients", ["float", "int4"])
def test_windowed_left_padded_batch_matches_the_oracle_cache(coefficients):
    """Left padding over sinks and a window (post-RoPE keys): transformers' mask is read at each
    slot's position (sinks, ring, compressed token i at S + i; M11.14 step 3), so a padded batch of
    two prompts gives the numpy cache's logits at the real positions, prefill and three decode
    steps, the window rolling over the padding."""
    model = make_model("llama")
    factory = static_states(random_bases(model), coefficients=coefficients, group_size=4, sinks=2, window=3)
    use_subspace_attention(model)
    ids = torch.cat([ids_of(9, 5), ids_of(9, 6)])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    logits = []
    with torch.no_grad():
        for cache in (GraphSubspaceCache(model.config, factory, max_cache_len=12), SubspaceCache(model.config, factory, backend="numpy")):
            m = mask
            out = [model(input_ids=ids, attention_mask=m, cache=cache).logits]
            for token in (4, 8, 15):
                m = torch.cat([m, torch.ones_like(m[:, :1])], dim=1)
                out.append(model(input_ids=torch.tensor([[token], [token]]), attention_mask=m, cache=cache).logits)
            logits.append(out)
    for graph, oracle in zip(*logits):
        real = slice(None) if graph.shape[1] == 1 else mask.bool()
        assert float((graph - oracle)[real].abs().max()) <= 1e-5 * float(oracle[real].abs().max())


def test_windowed_layer_states_match_the_oracle_cache():
    """The allocator's layer shape with its sinks and window (M11.12 with M11.14): a pre-RoPE int4
    head beside an identity int8 head, 2 sinks and 3 recent tokens."""
    model = make_model("llama")
    cache = matches_the_oracle_cache(model, mixed_layer_states(model, split=False, sinks=2, window=3), 1e-5)
    assert all(len(layer.groups) == 2 and layer.exact is not None for layer in cache.layers)


@pytest.mark.parametrize("coefficients", ["int4", "int2"])
def test_low_bit_keys_stored_as_a_block_or_token_by_token_agree(coefficients):
    """The two writers of low-bit keys (M11.8 step 1: a block as the state appends it, one token
    at a time re-quantising the unfinished group, as a compiled step does) leave the same codes,
    scales and zero points of every complete group and the same tail rows, from the same
    coefficients; and the block writer keeps the float rows of its groups."""
    from subspace_ref.hf import graph_storage

    spec = StateSpec(0, batch=1, heads=2, head_dim=16, value_dim=16, dtype=torch.float64, device=torch.device("cpu"))
    state = static_states(random_static_bases(1, 2, 16, RANK), coefficients=coefficients, group_size=8)(spec)
    block, single = (graph_storage.fixed_layout(state, "cpu", torch.float64, 24) for _ in range(2))
    rng = np.random.default_rng(4)
    head, rest = (torch.as_tensor(rng.standard_normal((1, 2, n, RANK))) for n in (3, 18))  # tokens 0-2, then 3-20
    for lay in (block, single):
        graph_storage.write(lay, "key", torch.tensor(0), head, eager=True)
    first, rows = graph_storage.write(block, "key", torch.tensor(3), rest, eager=True)
    for t in range(18):
        assert graph_storage.write(single, "key", torch.tensor(3 + t), rest[:, :, t : t + 1], eager=False) is None
    assert first == 0 and torch.equal(rows, torch.cat([head, rest], dim=2))
    assert torch.equal(block.key_coef[:, :, :16], single.key_coef[:, :, :16])
    for name in ("key_group_scale", "key_group_zero"):
        assert torch.equal(getattr(block, name)[:, :, :2], getattr(single, name)[:, :, :2])
    assert torch.equal(block.key_tail[:, :, :5], single.key_tail[:, :, :5])
    assert torch.equal(single.key_tail[:, :, :5], rest[:, :, 13:])


@pytest.mark.parametrize("groups", ["uniform", "per head"])
def test_low_bit_crop_puts_back_the_float_keys_of_its_group(groups):
    """Cropping low-bit keys (M11.8 step 4) gives the logits of a cache that never held the
    cropped tokens: back over one-token writes within their group, and back over a block whose
    group completed (its rows put back from the block's float keys); a crop whose rows later
    writes replaced is refused, the layers unchanged. Per head: every head group of a layer
    state crops (M11.12 step 3)."""
    model = make_model("llama")
    bases = random_bases(model)
    kw = dict(coefficients="int4", group_size=8)
    factory = static_states(bases, **kw) if groups == "uniform" else per_head_groups(bases[0], **kw)
    use_subspace_attention(model)
    ids = ids_of(12, 7)
    step = lambda cache, token: model(input_ids=torch.tensor([[token]]), cache=cache).logits  # noqa: E731
    block = lambda cache, tokens: model(input_ids=torch.tensor([tokens]), attention_mask=torch.ones((1, int(cache.get_seq_length()) + len(tokens)),  # noqa: E731
                                                                                                  dtype=torch.long), cache=cache).logits
    with torch.no_grad():
        fresh = lambda: GraphSubspaceCache(model.config, factory, max_cache_len=32)  # noqa: E731
        reference, cropped, over_block = fresh(), fresh(), fresh()
        for cache in (reference, cropped, over_block):
            model(input_ids=ids, cache=cache)
        expected = [step(reference, 5), step(reference, 9)]
        step(cropped, 5)
        step(cropped, 17)
        step(cropped, 23)
        cropped.crop(-2)  # tokens 12..14 were one-token writes into group 1: its rows are in the tail
        block(over_block, [40, 41, 42, 43, 44, 45])  # completes group 1 at 16
        over_block.crop(-6)
        assert float((step(over_block, 5) - expected[0]).abs().max()) <= 1e-12 * float(expected[0].abs().max())
        for got, want in ((step(cropped, 9), expected[1]), (step(over_block, 9), expected[1])):
            assert float((got - want).abs().max()) <= 1e-12 * float(want.abs().max())
        for token in range(8):  # tokens 14..21: group 1 completes at 16, and 16..21 reuse its tail slots
            step(cropped, token)
        held = int(cropped.get_seq_length())
        with pytest.raises(RuntimeError, match="which later writes replaced"):
            cropped.crop(-7)
    assert int(cropped.get_seq_length()) == held


def test_reset_empties_every_head_group_at_the_same_addresses():
    """``cache.reset()`` (M11.12 step 3) zeroes every head group's arrays and forgets a block's
    float keys, keeping each tensor's address (what a captured graph replays); the cache then
    gives a fresh cache's logits."""
    model = make_model("llama")
    factory = per_head_groups(random_bases(model)[0], coefficients="int4", group_size=8)
    use_subspace_attention(model)
    with torch.no_grad():
        cache, fresh = (GraphSubspaceCache(model.config, factory, max_cache_len=24) for _ in range(2))
        model(input_ids=ids_of(12, 7), cache=cache)
        model(input_ids=torch.tensor([[3]]), cache=cache)
        addresses = [t.data_ptr() for layer in cache.layers for t in layer.held()]
        cache.reset()
        assert [t.data_ptr() for layer in cache.layers for t in layer.held()] == addresses
        assert all(not t.any() for layer in cache.layers for t in layer.held())
        assert all(g.fresh_keys is None for layer in cache.layers for g in layer.groups) and int(cache.get_seq_length()) == 0
        got, want = (model(input_ids=ids_of(9, 4), cache=c).logits for c in (cache, fresh))
    assert float((got - want).abs().max()) <= 1e-12 * float(want.abs().max())


def test_low_bit_crop_after_a_beam_reorder_puts_back_each_sequences_rows():
    """A block's float keys are reordered with the sequences (beam search), so a crop after the
    reorder puts each sequence's own rows back: the logits of a cache that held the reordered
    prompts only."""
    model = make_model("llama")
    factory = static_states(random_bases(model), coefficients="int4", group_size=8)
    use_subspace_attention(model)
    prompts = torch.cat([ids_of(12, 8), ids_of(12, 9)])
    with torch.no_grad():
        cache, reference = (GraphSubspaceCache(model.config, factory, max_cache_len=24) for _ in range(2))
        model(input_ids=prompts, cache=cache)
        model(input_ids=torch.tensor([[1, 2, 3, 4, 5, 6]] * 2), attention_mask=torch.ones((2, 18), dtype=torch.long), cache=cache)
        cache.reorder_cache(torch.tensor([1, 0]))
        cache.crop(-6)
        model(input_ids=prompts.flip(0), cache=reference)
        got, want = (model(input_ids=torch.tensor([[7], [7]]), cache=c).logits for c in (cache, reference))
    assert float((got - want).abs().max()) <= 1e-12 * float(want.abs().max())


def test_a_low_bit_write_out_of_float16_range_changes_nothing():
    """Q1 stores float16 scales: a key beyond float16's range is refused (eager) by the layer that
    meets it, after the earlier layers gave the forward's tokens back; every count is unchanged."""
    model = make_model("llama")
    factory = static_states(random_bases(model), coefficients="int4", group_size=8)
    use_subspace_attention(model)
    cache = GraphSubspaceCache(model.config, factory, max_cache_len=24)
    with torch.no_grad():
        model(input_ids=ids_of(10, 2), cache=cache)
        layer = cache.layers[1]
        huge = torch.full((1, 2, 3, 16), 1e6, dtype=torch.float64)
        cache.layers[0].update(huge / 1e6, huge / 1e6)  # what layer 0 writes of the same forward
        with pytest.raises(ValueError, match="float16"):
            layer.update(huge, huge)
    assert [int(cache.layers[i].cumulative_length) for i in range(2)] == [10, 10]


@pytest.mark.parametrize("groups, bad", [("uniform", 1e6), ("per head", 1e6), ("per head", float("nan"))])
def test_a_value_out_of_range_leaves_the_low_bit_keys_as_they_were(groups, bad):
    """Keys within float16's range, values beyond it or NaN (of the last KV head only): the
    refusal comes before any side or head group writes (M11.12 step 1), so the block's keys do
    not overwrite the float rows of the begun key group (its tail), in any group."""
    model = make_model("llama")
    bases = random_bases(model)
    kw = dict(coefficients="int4", group_size=8)
    factory = static_states(bases, **kw) if groups == "uniform" else per_head_groups(bases[0], **kw)
    use_subspace_attention(model)
    cache = GraphSubspaceCache(model.config, factory, max_cache_len=24)
    with torch.no_grad():
        model(input_ids=ids_of(10, 2), cache=cache)
        layer = cache.layers[0]
        before = [t.clone() for t in layer.held()]
        keys = torch.randn((1, 2, 7, 16), dtype=torch.float64, generator=torch.Generator().manual_seed(0))  # completes key group 1 (tokens 8..15)
        values = keys.clone()
        values[:, 1] = bad
        with pytest.raises(ValueError, match="float16"):
            layer.update(keys, values)
    assert int(layer.cumulative_length) == 10 and all(torch.equal(a, b) for a, b in zip(before, layer.held(), strict=True))


@pytest.mark.parametrize("options, needs", [(dict(coefficients="int8"), "int8 coefficients"), (dict(rope="rope"), "pre-RoPE keys"),
                                            (dict(sinks=2, window=4), "sinks or an exact window")])
def test_quantised_or_pre_rope_on_cuda_without_the_kernel_is_refused(monkeypatch, options, needs):
    """On CUDA a quantised (here int8) or pre-RoPE layer needs the Triton kernel (M11.6, M11.10):
    without it, it is refused by name rather than dequantising, or rebuilding and rotating, the
    whole capacity every step; on the CPU it is held."""
    from subspace_ref.hf import graph_cache

    monkeypatch.setattr(graph_cache, "kernel_backend", lambda device, dtype: None)
    spec = StateSpec(0, batch=1, heads=2, head_dim=16, value_dim=16, dtype=torch.float32, device=torch.device("cpu"))
    if options.get("rope") == "rope":
        options = dict(rope=sr.rope.RopeParams(1e4 ** -(np.arange(8) / 8)))
    state = static_states(random_static_bases(1, 2, 16, RANK), **options)(spec)
    assert graph_refusals(state) == graph_refusals(state, "cpu") == []
    assert [r for r in graph_refusals(state, "cuda") if "on CUDA without the triton decode kernel" in r and needs in r]


def compiled_against_eager(model, factory, ids, steps: int):
    """``generate`` over a fresh graph cache eagerly (top-2 margins checked first, so equal tokens
    are a real comparison), then compiled as transformers compiles it with ``fullgraph=True`` (a
    graph break raises; here on the CPU too): (eager tokens, compiled tokens, the compiled run's
    cache, its CompileConfig)."""
    with torch.no_grad():
        cache = GraphSubspaceCache(model.config, factory, max_cache_len=ids.shape[1] + steps)
        eager = model.generate(ids, cache=cache, max_new_tokens=steps, do_sample=False, disable_compile=True, output_scores=True, return_dict_in_generate=True)
        margins = [float(torch.topk(s[0], 2).values.diff().abs()) for s in eager.scores]
    assert min(margins) > 1e-4
    compile_config = CompileConfig(fullgraph=True)
    compile_config._compile_all_devices = True  # transformers compiles on CUDA by default
    torch._dynamo.reset()
    cache = GraphSubspaceCache(model.config, factory, max_cache_len=ids.shape[1] + steps)
    compiled = model.generate(ids, cache=cache, max_new_tokens=steps, do_sample=False, compile_config=compile_config)
    assert hasattr(model, "_compiled_call")
    return eager.sequences, compiled, cache, compile_config


@pytest.mark.parametrize("coefficients", ["float", "int4", "pre-RoPE int4"])
def test_compiled_decode_equals_eager_without_graph_breaks(coefficients):
    """generate compiles the decode step of a graph cache (fullgraph=True: a break would raise)
    and gives the eager tokens; the compiled call is the one transformers made for it. int4
    here: no kernel, so the compiled step writes each key token into its group and reads the
    capacity back from the device count (M11.8), across key groups of 8; pre-RoPE: the keys
    rotated by device slots too (M11.10)."""
    model = make_model("llama", torch.float32)
    rope = sr.rope.RopeParams.from_config(model.config) if coefficients.startswith("pre-RoPE") else None
    factory = static_states(random_bases(model), coefficients=coefficients.removeprefix("pre-RoPE "), group_size=8, rope=rope)
    ids = ids_of(10, 1)
    steps = 8
    use_subspace_attention(model)
    eager, compiled, cache, _ = compiled_against_eager(model, factory, ids, steps)
    assert torch.equal(compiled, eager)
    assert int(cache.get_seq_length()) == ids.shape[1] + steps - 1

@pytest.mark.parametrize("state", ["int4", "pre-RoPE int4, 4 sinks, 32 recent"])
def test_shipped_model_generates_the_subspace_caches_tokens_through_the_compiled_int4_graph(state):
    """The project's trained model (4 layers, 2 KV heads of 64), bases calibrated on the prompt
    at rank 48, int4 coefficients: 40 greedy tokens through the compiled graph cache
    (fullgraph=True; through the kernel where the tests run it on the interpreter) equal the
    torch backend's SubspaceCache, whose top-2 margins are checked first. Also docs/baselines.md's
    best single state: pre-RoPE keys (bases calibrated on un-rotated keys), 4 sinks and 32 exact
    recent tokens (M11.14), the window rolling during the 40 steps."""
    from subspace_ref.hf import capture
    from subspace_ref.models.default_model import load_model

    model, _ = load_model("default")
    ids = torch.tensor([list(b"def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n\ndef write_config(path, config):\n")])
    if state == "int4":
        factory = static_states(capture(model, ids).calibrate(rank_k=48, rank_v=48), coefficients="int4")
    else:
        bases = capture(model, ids, rope=False).calibrate(rank_k=48, rank_v=48)
        factory = static_states(bases, coefficients="int4", rope=sr.rope.RopeParams.from_config(model.config), sinks=4, window=32)
    with compress(model, factory, graph=False, backend="torch") as kv:
        ref = kv.generate(ids, max_new_tokens=40, do_sample=False, output_scores=True, return_dict_in_generate=True)
    assert min(float(torch.topk(s[0], 2).values.diff().abs()) for s in ref.scores) > 1e-3
    compile_config = CompileConfig(fullgraph=True)
    compile_config._compile_all_devices = True
    torch._dynamo.reset()
    with compress(model, factory, graph=True) as kv:
        assert torch.equal(kv.generate(ids, max_new_tokens=40, do_sample=False, compile_config=compile_config), ref.sequences)
    assert hasattr(model, "_compiled_call")


REFUSED = {
    "threshold": (dict(window=2, min_tokens=10), "a compression threshold"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_states_name_their_reason_before_anything(name):
    """A refused state is named by compress(graph=True) and by the cache's constructor, before
    any forward writes."""
    model = make_model("llama")
    options, reason = REFUSED[name]
    factory = static_states(random_bases(model), **options)
    assert any(reason in r for r in model_graph_refusals(model.config, factory))
    with pytest.raises(NotSupportedError, match=reason):
        with compress(model, factory, graph=True):
            pass
    with pytest.raises(NotSupportedError, match=reason):
        GraphSubspaceCache(model.config, factory, max_cache_len=16)


def test_online_and_shared_states_are_refused():
    spec = StateSpec(0, batch=1, heads=2, head_dim=16, value_dim=16, dtype=torch.float32, device=torch.device("cpu"))
    for kind in ("adaptive", "rotating"):
        assert any(kind in r for r in graph_refusals(full_rank_states(kind)(spec)))
    per_query_head = static_states(random_static_bases(1, 4, 16, RANK), share="query_head")(spec)
    assert any("per query head" in r for r in graph_refusals(per_query_head))
    assert graph_refusals(object()) and "not a SubspaceState or LayerState" in graph_refusals(object())[0]


def test_overflow_is_refused_and_changes_nothing():
    model = make_model("llama")
    use_subspace_attention(model)
    cache = GraphSubspaceCache(model.config, static_states(random_bases(model)), max_cache_len=6)
    with torch.no_grad():
        model(input_ids=ids_of(5, 3), cache=cache)
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        with pytest.raises(ValueError, match="exceed max_cache_len = 6"):
            model(input_ids=ids_of(2, 4), cache=cache)
    assert int(cache.get_seq_length()) == 5
    for layer, (k, v) in zip(cache.layers, before):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_graph_layer_attention_within_the_harness_tolerance(dtype):
    """One graph layer in a 16/32-bit dtype against the float64 oracle over the same tokens, held
    to the differential harness's one rule (tests/differential/tolerance.py: twice the oracle's
    own error in that dtype, plus a floor). The oracle's state holds the keys and values rounded
    to the dtype, as the model hands them to the cache."""
    from tests.differential.tolerance import reference_error, tolerance

    torch_dtype = getattr(torch, dtype)
    model = make_model("llama", torch_dtype)
    H, d, T, Hq = 2, 16, 40, 4
    rng = np.random.default_rng(7)
    basis = random_bases(model)[0]
    empty = sr.SubspaceState.static(basis, batch=2, dtype=np.float64)
    cache = GraphSubspaceCache(model.config, [empty, empty], max_cache_len=T + 7)  # unwritten slots the attention must not read
    K, V, q = (torch.as_tensor(rng.standard_normal(shape)).to(torch_dtype) for shape in ((2, H, T, d), (2, H, T, d), (2, Hq, d)))
    layer = cache.layers[0]
    layer.update(K, V)
    scale = d**-0.5
    out = layer.attend(q[:, :, None], None, scale)[:, 0].double().numpy()  # (2, H_q, d_v)
    state64 = empty.append(K.double().numpy(), V.double().numpy())
    out64 = np.asarray(sr.attend(q.double().numpy(), state64, backend="numpy", scale=scale))
    ref = reference_error(state64, q.double().numpy(), scale, out64, dtype)
    assert np.abs(out - out64).max() <= tolerance(ref, out64, dtype)


def test_left_padded_batch_matches_the_oracle_cache():
    """transformers' static mask carries left padding to SDPA: a padded batch of two prompts
    gives the numpy cache's logits at the real positions (float64 Llama)."""
    model = make_model("llama")
    bases = random_bases(model)
    use_subspace_attention(model)
    ids = torch.cat([ids_of(9, 5), ids_of(9, 6)])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second prompt is 6 tokens, left-padded
    with torch.no_grad():
        graph = model(input_ids=ids, attention_mask=mask, cache=GraphSubspaceCache(model.config, static_states(bases), max_cache_len=12)).logits
        oracle = model(input_ids=ids, attention_mask=mask, cache=SubspaceCache(model.config, static_states(bases), backend="numpy")).logits
    real = mask.bool()
    assert float((graph - oracle)[real].abs().max()) <= 1e-5 * float(oracle[real].abs().max())


def dropout_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=VOCAB, max_position_embeddings=128, attention_dropout=0.1)
    return LlamaForCausalLM(cfg).eval()


def test_a_refused_attention_call_takes_the_forward_back():
    """Dropout in training mode, in the second layer only, is refused at its attention call
    after both layers' updates wrote: the forward's tokens are taken back from both."""
    model = dropout_llama().to(torch.float64)
    use_subspace_attention(model)
    cache = GraphSubspaceCache(model.config, static_states(random_bases(model)), max_cache_len=16)
    model(input_ids=ids_of(5, 8), cache=cache)
    model.model.layers[1].self_attn.train()
    with pytest.raises(NotSupportedError, match="layer 1: .*attention dropout in training mode"):
        model(input_ids=ids_of(3, 9), cache=cache)
    assert [int(layer.cumulative_length) for layer in cache.layers] == [5, 5]


def test_a_refusal_inside_a_compiled_step_takes_the_forward_back():
    """The same refusal met while torch.compile traces a decode step: the part of the step
    that ran before the break wrote layer 0, and the refusal takes it back there too."""
    model = dropout_llama()
    use_subspace_attention(model)
    cache = GraphSubspaceCache(model.config, static_states(random_bases(model)), max_cache_len=16)
    torch._dynamo.reset()
    step = torch.compile(model)
    with torch.no_grad():
        model(input_ids=ids_of(5, 10), cache=cache)
        step(input_ids=torch.tensor([[3]]), cache=cache)
        model.model.layers[1].self_attn.train()
        with pytest.raises(NotSupportedError, match="attention dropout in training mode"):
            step(input_ids=torch.tensor([[4]]), cache=cache)
    assert [int(layer.cumulative_length) for layer in cache.layers] == [6, 6]


def test_beam_search_matches_the_oracle_cache():
    """Beam search reorders the coefficients in place (the tag and addresses stay): the same
    sequences as the numpy cache's."""
    model = make_model("gpt2")
    bases = random_bases(model)
    ids = ids_of(8, 11)
    with compress(model, bases, graph=True) as kv:
        graph = kv.generate(ids, max_new_tokens=5, num_beams=3, do_sample=False)
    with compress(model, bases, graph=False, backend="numpy") as kv:
        oracle = kv.generate(ids, max_new_tokens=5, num_beams=3, do_sample=False)
    assert torch.equal(graph, oracle)


def test_generate_sizes_the_capacity_as_transformers_counts_tokens():
    """No length given: transformers' default of 20 new tokens; a given graph cache too small
    for the prompt and max_new_tokens is refused before generating."""
    model = make_model("gpt2")
    bases = random_bases(model)
    ids = ids_of(10, 12)
    with compress(model, bases, graph=True) as kv:
        out = kv.generate(ids, do_sample=False)
        assert out.shape == (1, 30)
        with pytest.raises(ValueError, match="max_cache_len = 12 holds fewer than the 16 tokens"):
            kv.generate(ids, cache=kv.graph_cache(12), max_new_tokens=6, do_sample=False)
    assert generation_capacity(model, 10, dict(max_new_tokens=6), round_to=CAPACITY_STEP) == CAPACITY_STEP
    assert generation_capacity(model, 10, dict(max_length=40)) == 40


def test_sliding_layers_stay_in_the_compiled_graph():
    """A model with a sliding-window layer: transformers' static sliding layer holds it, its
    attention is the model's own SDPA, traced too (fullgraph=True), same tokens as eager."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                      max_position_embeddings=128, use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    model = Qwen2ForCausalLM(cfg).eval()
    bases = random_bases(model)
    ids = ids_of(12, 13)
    use_subspace_attention(model)
    cache = GraphSubspaceCache(model.config, static_states(bases), max_cache_len=20)
    assert [type(layer).__name__ for layer in cache.layers] == ["StaticSlidingWindowLayer", "GraphSubspaceLayer"]
    eager = model.generate(ids, cache=cache, max_new_tokens=8, do_sample=False, disable_compile=True)
    compile_config = CompileConfig(fullgraph=True)
    compile_config._compile_all_devices = True
    torch._dynamo.reset()
    cache = GraphSubspaceCache(model.config, static_states(bases), max_cache_len=20)
    assert torch.equal(model.generate(ids, cache=cache, max_new_tokens=8, do_sample=False, compile_config=compile_config), eager)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_bad_capacity_is_refused(bad):
    model = make_model("gpt2")
    with pytest.raises(ValueError, match="max_cache_len"):
        GraphSubspaceCache(model.config, static_states(random_bases(model)), max_cache_len=bad)


def test_state_count_and_graph_option_are_checked():
    model = make_model("gpt2")
    bases = random_bases(model)
    with pytest.raises(ValueError, match="1 states given for a model of 2 layers"):
        GraphSubspaceCache(model.config, [sr.SubspaceState.static(bases[0], batch=1)], max_cache_len=8)
    with pytest.raises(ValueError, match="graph must be"):
        with compress(model, bases, graph="yes"):
            pass


def test_soft_capping_models_are_refused_up_front():
    """Gemma2 passes softcap to its attention call; the graph path cannot apply it, so "auto"
    keeps such a model on the SubspaceCache and graph=True refuses it before the block opens."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       vocab_size=VOCAB, max_position_embeddings=128, attn_logit_softcapping=50.0)
    model = Gemma2ForCausalLM(cfg).eval()
    bases = random_bases(model)
    assert any("soft-capping" in r for r in model_graph_refusals(model.config, static_states(bases)))
    with compress(model, bases) as kv:
        assert not kv.uses_graph("cuda")
    with pytest.raises(NotSupportedError, match="soft-capping"):
        with compress(model, bases, graph=True):
            pass


def test_auto_uses_the_graph_cache_on_cuda_only(monkeypatch):
    """``graph="auto"`` (the default) picks the graph cache for a CUDA device when every state
    qualifies and no SubspaceCache option is given; never on the CPU. Decided without CUDA:
    quantised states, pre-RoPE states and layer states of them qualify on CUDA when the Triton
    kernel runs there for the model's dtype (M11.6, M11.10, M11.12)."""
    from subspace_ref.hf import graph_cache

    model = make_model("llama")
    bases = random_bases(model)
    with compress(model, bases) as kv:
        assert kv.uses_graph("cuda") and not kv.uses_graph("cpu") and not kv.uses_graph()
    with compress(model, bases, backend="numpy") as kv:
        assert not kv.uses_graph("cuda")
    monkeypatch.setattr(graph_cache, "kernel_backend", lambda device, dtype: object())
    with compress(model, static_states(bases, coefficients="int8")) as kv:
        assert kv.uses_graph("cuda") and not kv.uses_graph("cpu")
    with compress(model, static_states(bases, coefficients="int4")) as kv:
        assert kv.uses_graph("cuda") and not kv.uses_graph("cpu")
    # the kernel is asked about the model's dtype (float64 here), not the states' (float32)
    monkeypatch.setattr(graph_cache, "kernel_backend", lambda device, dtype: None if "float64" in str(dtype) else object())
    rope = sr.rope.RopeParams.from_config(model.config)
    for kernel_states in (static_states(bases, rope=rope), mixed_layer_states(model, split=False)):
        with compress(model, kernel_states) as kv:
            assert not kv.uses_graph("cuda")
        assert not model_graph_refusals(model.config, kernel_states, "cuda", torch.float32)
    monkeypatch.setattr(graph_cache, "kernel_backend", lambda device, dtype: None)
    with compress(model, static_states(bases, coefficients=("float", "int2"))) as kv:
        assert not kv.uses_graph("cuda")
    with compress(model, bases, graph=True) as kv:
        assert kv.uses_graph("cpu")
        assert isinstance(kv.graph_cache(8), GraphSubspaceCache)


def test_graph_decode_benchmark_runs_on_the_cpu(tmp_path):
    """benchmarks/graph_decode.py (the GPU session's step 3b) runs every row on a tiny model:
    a broken row would otherwise surface only on a lent GPU."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "graph_decode.py"
    out = tmp_path / "rows.json"
    args = ["--device", "cpu", "--contexts", "24", "--steps", "4", "--layers", "1", "--hidden", "256", "--heads", "2", "--kv-heads", "2",
            "--vocab", "64", "--rank", "8", "--json", str(out)]
    run = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    names = [r["cache"] for r in rows]
    assert names == ["DynamicCache + SDPA (eager)", "StaticCache (compiled)", "GraphSubspaceCache r=8 float (compiled)", "GraphSubspaceCache r=8 float (eager)",
                     "SubspaceCache r=8 float (torch, eager)", "GraphSubspaceCache r=8 int8 (compiled)", "SubspaceCache r=8 int8 (torch, eager)",
                     "GraphSubspaceCache r=8 int4 (compiled)", "SubspaceCache r=8 int4 (torch, eager)",
                     "GraphSubspaceCache r=8 pre-rope-float (compiled)", "SubspaceCache r=8 pre-rope-float (torch, eager)",
                     "GraphSubspaceCache r=8 pre-rope-int4 (compiled)", "SubspaceCache r=8 pre-rope-int4 (torch, eager)",
                     "GraphSubspaceCache r=8 pre-rope-int4-sinks4-window32 (compiled)", "SubspaceCache r=8 pre-rope-int4-sinks4-window32 (torch, eager)"]
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows), rows
    assert rows[2]["bytes"] < rows[1]["bytes"]  # r + r_v = 16 of d + d_v = 256 per token and head
    # per token and head: float 2 * 8 * 4 bytes, int8 2 (8 + 4), int4 4 + 4 and a 32-token float key tail, which dominates at 28 tokens
    assert rows[5]["bytes"] < rows[2]["bytes"] and rows[7]["bytes"] < rows[2]["bytes"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: generate compiles the graph cache's step with CUDA graphs there only")
@pytest.mark.parametrize("coefficients", ["float", "int8", "int4", "pre-RoPE float", "pre-RoPE int4", "layer state", "windowed layer state"])
def test_cuda_generate_decodes_through_the_compiled_graph(coefficients):
    """On CUDA, ``compress(...).generate`` picks the graph cache by default and transformers
    compiles its decode step (mode="reduce-overhead": CUDA graphs; quantised sides and pre-RoPE keys
    through the kernel operator, M11.6, M11.10): the tokens of the eager SubspaceCache on the same device, at margins
    checked first."""
    model = make_model("llama", torch.float32).cuda()
    rope = sr.rope.RopeParams.from_config(model.config) if coefficients.startswith("pre-RoPE") else None
    # int4 key groups complete at 16, inside the graph; layer state: a pre-RoPE int4 and an identity int8 head group (M11.12)
    if coefficients.endswith("layer state"):  # windowed: 2 sinks and 3 recent tokens (M11.14)
        bases = mixed_layer_states(model, split=False, sinks=2 if coefficients.startswith("windowed") else 0, window=3 if coefficients.startswith("windowed") else 0)
    else:
        bases = static_states(random_bases(model), coefficients=coefficients.removeprefix("pre-RoPE "), group_size=8, rope=rope)
    ids = ids_of(10, 14).cuda()
    with compress(model, bases, graph=False) as kv:
        eager = kv.generate(ids, max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True)
    assert min(float(torch.topk(s[0], 2).values.diff().abs()) for s in eager.scores) > 1e-3
    torch._dynamo.reset()
    with compress(model, bases) as kv:
        assert kv.uses_graph()
        graph = kv.generate(ids, max_new_tokens=8, do_sample=False)
    assert hasattr(model, "_compiled_call")
    assert torch.equal(graph, eager.sequences)
