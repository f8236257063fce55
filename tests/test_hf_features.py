"""The subspace cache in deployment (issue 17): model-dtype states and honest byte ratios,
independence of caches/models (failed calls, deep copies), the compress() context, hybrid
sliding-window models, refusals with reasons, torch.compile, and bases saved as an artifact
for a checkpoint written with save_pretrained (and `subspace-kv calibrate --model PATH`)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from subspace_ref.hf_requirements import MIN_TRANSFORMERS

pytest.importorskip("transformers", minversion=MIN_TRANSFORMERS)  # older: generate has no cache= (skipped, both versions named)

import transformers  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from subspace_ref.hf import (  # noqa: E402
    CalibratedBases,
    SubspaceCache,
    SubspaceLayer,
    adaptive_states,
    capture,
    compress,
    full_rank_states,
    rotating_states,
    static_states,
)
from subspace_ref.capabilities import NotSupportedError  # noqa: E402
from tests.test_hf_generation import model_for, prompt_ids, tolerance  # noqa: E402

torch.set_num_threads(1)


def stock(model, ids, **kw):
    with torch.no_grad():
        return model(ids, cache=DynamicCache(config=model.config), **kw).logits


def dynamic_cache_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


# --------------------------------------------------------------------------- dtype and bytes
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_states_are_stored_in_the_model_dtype_and_ratios_are_against_the_stock_cache(dtype):
    model = model_for("llama", dtype)
    ids = prompt_ids(length=20)
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=ref)
    basis = [sr_basis(model, rank) for rank in (8, 8)]
    with compress(model, static_states(basis)) as kv, torch.no_grad():
        cache = kv.cache()
        model(ids, cache=cache)
    torch_dtype = getattr(torch, dtype)
    for st in cache.states:
        assert st.layout.key_coef.dtype == torch_dtype and st.layout.value_coef.dtype == torch_dtype
    assert cache.full_cache_nbytes == dynamic_cache_bytes(ref)
    # rank 8 of 16 on both sides: coefficients are half the stock bytes, plus float16 bases
    coef = sum(st.layout.key_coef[:, :, :20].nbytes + st.layout.value_coef[:, :, :20].nbytes for st in cache.states)
    assert coef == dynamic_cache_bytes(ref) // 2
    assert cache.nbytes < dynamic_cache_bytes(ref) * 1.5  # bases of 2x2x(8x16) float16 at 20 tokens


def sr_basis(model, rank: int):
    """Orthonormal random bases of ``rank`` rows per KV head (a layer's StaticBasis)."""
    import subspace_ref as sr

    rng = np.random.default_rng(rank)
    heads, d = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    q = np.stack([np.linalg.qr(rng.standard_normal((d, d)))[0][:rank] for _ in range(heads)])
    return sr.StaticBasis.from_bases(q, q, 1.0)


# --------------------------------------------------------------------------- independence
def test_a_failed_call_leaves_nothing_behind_and_affects_no_other_cache_or_model():
    """Layer 0 static, layer 1 rotating, with a padding mask: layer 1 refuses after layer 0
    appended; the failed cache holds nothing, and another model, another cache and the failed
    cache itself then compute exactly what they would have."""
    model, other = model_for("llama"), model_for("qwen2")
    ids = prompt_ids(batch=2, length=10)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    factory_mixed = {0: full_rank_states(), 1: full_rank_states("rotating", refresh_every=3)}
    other_before = stock(other, ids)
    with compress(model, lambda spec: factory_mixed[spec.layer_idx](spec)) as kv:
        failed = kv.cache()
        with pytest.raises(NotImplementedError, match="padding"):
            model(ids, attention_mask=mask, cache=failed)
        assert all(layer.pending_keys is None for layer in failed.layers)
        assert failed.get_seq_length() == 0 and failed.layers[0].state.num_tokens == 0
        assert torch.equal(stock(other, ids), other_before)
        with torch.no_grad():
            fresh = model(ids, cache=kv.cache(), use_cache=True).logits
            again = model(ids, cache=failed).logits  # the failed cache, unpadded now
        assert torch.equal(stock(model, ids), stock(model, ids))
        assert torch.equal(again, fresh)
    assert float((fresh - stock(model, ids)).abs().max()) <= tolerance("llama", "float32")


@pytest.mark.parametrize("first", ["adaptive+window", "adaptive"])
def test_a_failed_long_forward_rolls_online_and_windowed_states_back(first):
    """Layer 0 adaptive (with or without a window), layer 1 rotating: a padded 80-token forward
    (longer than max_crop_block) fails at layer 1 after layer 0 appended. Layer 0 goes back to
    its restore point: the next forward gives what it gives on a cache that never saw the
    failed one, bit for bit."""
    model = model_for("llama")
    ids = prompt_ids(batch=2, length=80)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    layers = {0: EDITED_STATES[first](), 1: rotating_states(rank_k=6, rank_v=6, refresh_every=3, warmup=2)}
    with compress(model, lambda spec: layers[spec.layer_idx](spec)) as kv, torch.no_grad():
        failed, fresh = kv.cache(), kv.cache()
        model(ids[:, :8], cache=failed)
        model(ids[:, :8], cache=fresh)
        with pytest.raises(NotImplementedError, match="padding"):
            model(ids, attention_mask=mask, cache=failed)
        assert failed.get_seq_length() == 8
        np.testing.assert_array_equal(model(ids[:, 8:], cache=failed).logits.numpy(), model(ids[:, 8:], cache=fresh).logits.numpy())


def test_deep_copies_are_independent():
    model = model_for("llama")
    ids = prompt_ids(batch=1, length=12)
    with compress(model, full_rank_states()) as kv, torch.no_grad():
        cache = kv.cache()
        model(ids[:, :8], cache=cache)
        twin = copy.deepcopy(cache)
        assert all(a.cache is cache for a in cache.layers) and all(b.cache is twin for b in twin.layers)
        a = model(ids[:, 8:10], cache=cache).logits
        del cache
        b = model(ids[:, 8:12], cache=twin).logits
    assert torch.equal(a, b[:, :2]) or float((a - b[:, :2]).abs().max()) <= tolerance("llama", "float32")
    assert twin.get_seq_length() == 12


def test_compress_is_scoped_to_one_model_and_block():
    model, other = model_for("llama"), model_for("phi3")
    before, other_impl = model.config._attn_implementation, other.config._attn_implementation
    ids = prompt_ids()
    with compress(model, full_rank_states()):
        assert model.config._attn_implementation.startswith("subspace_ref")
        assert other.config._attn_implementation == other_impl
        with torch.no_grad():  # a DynamicCache inside the block: the model's own attention
            inside = model(ids, cache=DynamicCache(config=model.config)).logits
    assert model.config._attn_implementation == before
    assert torch.equal(inside, stock(model, ids))
    with pytest.raises(RuntimeError, match="compress"):  # outside the block a SubspaceCache is refused
        model(ids, cache=SubspaceCache(model.config, full_rank_states()))


def test_hybrid_model_keeps_sliding_layers_stock_and_compresses_full_layers():
    model = model_for("gemma2")
    with compress(model, full_rank_states()) as kv, torch.no_grad():
        cache = kv.cache()
        model(prompt_ids(length=12), cache=cache)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["DynamicSlidingWindowLayer", "SubspaceLayer"], kinds
    assert cache.layers[0].keys.shape[2] <= model.config.sliding_window  # transformers' own window
    assert cache.nbytes >= cache.layers[0].keys.nbytes + cache.layers[0].values.nbytes


# --------------------------------------------------------------------------- refusals
EDITED_STATES = {
    "adaptive": lambda: adaptive_states(rank_k=6, rank_v=6, tau_k=0.05, tau_v=0.05, max_chunk=5, warmup=2),
    "rotating": lambda: rotating_states(rank_k=6, rank_v=6, refresh_every=3, warmup=2),
    "static+window": lambda: static_states([sr_basis(model_for("llama"), 6)] * 2, window=4, sinks=1),
    "adaptive+window": lambda: adaptive_states(rank_k=6, rank_v=6, tau_k=0.05, tau_v=0.05, max_chunk=5, warmup=2, window=3, min_tokens=6),
    # key groups of 4: the 7-token forward finishes groups that the crop cuts into
    "static+int4": lambda: static_states([sr_basis(model_for("llama"), 6)] * 2, coefficients="int4", group_size=4),
    "static+int2+window": lambda: static_states([sr_basis(model_for("llama"), 6)] * 2, coefficients="int2", group_size=4, window=3),
}


def next_logits(model, cache, token: int = 5) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[token]] * cache.layers[0].state.batch), cache=cache).logits


@pytest.mark.parametrize("backend", ["torch", "numpy"])
@pytest.mark.parametrize("name", list(EDITED_STATES))
def test_crop_takes_back_the_last_forward_exactly_and_refuses_further(name, backend):
    """crop(-3) after a 7-token forward gives the state of never appending those 3 tokens (the
    next token's logits equal those of a cache fed only the kept ones, to rounding); cropping below the
    last forward's start is refused with the reason, the state unchanged. Spec change: these
    states refused every crop before (issue 17 item 5 follow-up; int4/int2 states until
    2026-11-25)."""
    model = model_for("llama")
    ids = prompt_ids(length=17)
    with compress(model, EDITED_STATES[name](), backend=backend) as kv, torch.no_grad():
        cache, ref = kv.cache(), kv.cache()
        model(ids[:, :10], cache=cache)
        model(ids[:, 10:], cache=cache)
        assert cache.is_croppable
        cache.crop(-3)
        assert cache.get_seq_length() == 14
        model(ids[:, :10], cache=ref)
        model(ids[:, 10:14], cache=ref)
        # the kept keys come out of a 7-token forward here and a 4-token one there: rounding apart
        assert float((next_logits(model, cache) - next_logits(model, ref)).abs().max()) <= tolerance("llama", "float32")
        with pytest.raises(NotSupportedError, match="start of its last forward"):
            cache.crop(-2)
        assert cache.get_seq_length() == 15


def test_a_restore_point_refuses_a_state_written_in_place():
    """The restore point shares the state's objects (appends replace the fixed-size arrays, never
    write them): one written in place since the forward began would be restored as it now is, so
    crop raises, naming it, instead."""
    model = model_for("llama")
    ids = prompt_ids(length=17)
    with compress(model, EDITED_STATES["static+window"](), backend="torch") as kv, torch.no_grad():
        cache = kv.cache()
        model(ids[:, :10], cache=cache)
        window = cache.layers[0].state.window
        model(ids[:, 10:], cache=cache)
        window.keys.add_(1.0)  # the restore point's exact window, which the forward replaced
        with pytest.raises(RuntimeError, match="window_keys changed in place"):
            cache.crop(-3)


@pytest.mark.parametrize("kind", ["static", "adaptive", "rotating"])
def test_select_sequences_equals_each_sequence_alone(kind):
    """operations.select_sequences on an oracle state with window, sinks and chunks: sequence i
    of the result attends exactly as sequence index[i] of the original (numpy, bit for bit),
    and every array of the state has the new batch size (gamma excepted)."""
    import subspace_ref as sr
    from subspace_ref.layout import held_arrays
    from subspace_ref.operations import select_sequences

    rng = np.random.default_rng(4)
    N, H, d, T = 3, 2, 8, 30
    options = dict(window=4, sinks=2, batch=N)
    if kind == "static":
        q = np.stack([np.linalg.qr(rng.standard_normal((d, d)))[0][:3] for _ in range(H)])
        state = sr.SubspaceState.static(sr.StaticBasis.from_bases(q, q, 1.0), **options)
    else:
        extra = {"tau_k": 0.3, "tau_v": 0.3, "max_chunk": 5} if kind == "adaptive" else {"refresh_every": 4}
        state = getattr(sr.SubspaceState, kind)(H, d, d, rank_k=3, rank_v=3, **options, **extra)
    state.append(rng.standard_normal((N, H, T, d)), rng.standard_normal((N, H, T, d)))
    index = np.array([2, 0, 2, 1])
    picked = select_sequences(state, index)
    assert all(x.shape[0] == len(index) for name, x in held_arrays(picked).items() if name != "gamma")
    queries = rng.standard_normal((N, 2 * H, d))
    np.testing.assert_array_equal(sr.attend(queries[index], picked), sr.attend(queries, state)[index])


@pytest.mark.parametrize("name", list(EDITED_STATES))
def test_reordering_sequences_gathers_every_state_array(name):
    """reorder_cache / batch_select_indices on any state kind: the cache then holds the chosen
    sequences, as if they had been fed in that order (the next logits are those rows)."""
    model = model_for("llama")
    ids = torch.cat([prompt_ids(batch=1, length=12, seed=s) for s in (1, 2, 3)])
    with compress(model, EDITED_STATES[name]()) as kv, torch.no_grad():
        cache = kv.cache()
        model(ids, cache=cache)
        before = next_logits(model, copy.deepcopy(cache))
        cache.reorder_cache(torch.tensor([2, 0, 0]))
        np.testing.assert_array_equal(next_logits(model, copy.deepcopy(cache)).numpy(), before[[2, 0, 0]].numpy())
        cache.batch_select_indices(torch.tensor([1]))
        # a batch of one runs the model's matmuls with other blockings than a batch of three
        assert float((next_logits(model, cache) - before[[0]]).abs().max()) <= tolerance("llama", "float32")


def test_rotating_states_refuse_soft_capping_before_appending():
    model = model_for("gemma2")
    with compress(model, rotating_states(rank_k=16, rank_v=16, refresh_every=4)) as kv:
        cache = kv.cache()
        with pytest.raises(NotImplementedError, match="soft-capping"):
            model(prompt_ids(), cache=cache)
    layer = cache.layers[1]
    assert isinstance(layer, SubspaceLayer) and layer.state.num_tokens == 0 and layer.pending_keys is None


@pytest.mark.slow
def test_torch_compile_runs_with_graph_breaks_around_the_cache():
    model = model_for("llama")
    ids = prompt_ids()
    compiled = torch.compile(model)
    with compress(model, full_rank_states()) as kv, torch.no_grad():
        cache = kv.cache()
        out = compiled(ids, cache=cache).logits
        nxt = compiled(torch.tensor([[3], [4]]), cache=cache).logits
    full = stock(model, torch.cat([ids, torch.tensor([[3], [4]])], 1))
    assert float((torch.cat([out, nxt], 1) - full).abs().max()) <= tolerance("llama", "float32")


# --------------------------------------------------------------------------- artifact
def test_bases_round_trip_on_a_saved_checkpoint(tmp_path):
    """A checkpoint written with save_pretrained; `subspace-kv calibrate --model DIR
    --compression-ratio 0.5 --rule energy` saves bases; from_pretrained gives the same arrays and metadata,
    generates as the in-memory bases do, and refuses another architecture's config."""
    from subspace_ref.cli import main

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "ckpt")
    assert (
        main(
            [
                "calibrate",
                "--model",
                str(tmp_path / "ckpt"),
                "--compression-ratio",
                "0.5",
                "--context",
                "64",
                "--calibration-tokens",
                "640",
                "--rule",
                "energy",
                "--no-progress",
                "--bases-out",
                str(tmp_path / "bases"),
            ]
        )
        == 0
    )
    loaded = CalibratedBases.from_pretrained(tmp_path / "bases", model.config)
    assert loaded.calibration["coefficient_fraction"] <= 0.5
    assert sum(sum(b.rank_k) + sum(b.rank_v) for b in loaded.layers) <= 0.5 * 2 * 2 * 32
    from subspace_ref.allocation import Allocation, HeadAllocation

    plan = Allocation(tuple(tuple(HeadAllocation(int(rk), int(rv)) for rk, rv in zip(b.rank_k, b.rank_v)) for b in loaded.layers))
    ours = CalibratedBases.for_model(model, list(loaded.layers), calibration=loaded.calibration, allocation=plan)
    ours.save_pretrained(tmp_path / "again")
    back = CalibratedBases.from_pretrained(tmp_path / "again", model)
    assert back.allocation.heads == plan.heads and back.metadata()["allocation"]["heads"] == ours.metadata()["allocation"]["heads"]
    assert {**back.metadata(), "allocation": None} == loaded.metadata()
    for a, b in zip(back.layers, loaded.layers):
        assert np.array_equal(a.B, b.B) and np.array_equal(a.E, b.E) and np.array_equal(a.gamma, b.gamma)
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(2))
    outs = []
    for bases in (loaded, list(loaded.layers)):
        with compress(model, bases) as kv:
            outs.append(kv.generate(ids, max_new_tokens=5, do_sample=False))
    assert torch.equal(outs[0], outs[1])
    wider = transformers.LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 3})
    with pytest.raises(ValueError, match="config hash"):
        CalibratedBases.from_pretrained(tmp_path / "bases", wider)


def test_capture_observes_only_its_own_model():
    model, other = model_for("llama"), model_for("qwen2")
    ids = prompt_ids(batch=1, length=6)
    cap = capture(model, ids)
    assert len(cap.layers) == 2
    seen = []
    from subspace_ref.hf import observe

    with observe(model, lambda *a: seen.append(1)):
        stock(other, ids)
    assert not seen


def test_assisted_decoding_with_a_draft_model_crops_and_matches_greedy():
    """A one-layer draft proposes tokens; rejected ones are cropped from the subspace cache.
    Greedy assisted decoding must give the stock cache's greedy tokens."""
    model = model_for("llama")
    torch.manual_seed(3)
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = 1
    draft = transformers.LlamaForCausalLM(config).eval()
    ids = prompt_ids(batch=1, length=10)
    expected = model.generate(ids, do_sample=False, max_new_tokens=10, pad_token_id=0)
    with compress(model, full_rank_states()) as kv:
        cache = kv.cache()
        got = model.generate(ids, do_sample=False, max_new_tokens=10, pad_token_id=0, assistant_model=draft, cache=cache)
    assert torch.equal(got, expected)
    assert cache.get_seq_length() == got.shape[1] - 1


def test_prompt_lookup_with_an_int4_state_equals_its_greedy_decoding():
    """Assisted decoding is lossless with int4 coefficients too: prompt lookup (verifying
    forwards of up to 4 tokens, the rejected candidates cropped back through the restore point)
    gives the tokens and logits of plain greedy decoding with the same state. Key groups of 4
    tokens, so verifying forwards finish groups that crops cut into. In float64: the two runs
    compute the kept keys in forwards of different lengths, rounding apart, and in float32 a
    code can round the other way (an int4 step, not a wrong crop); float32 tolerance as bound."""
    from tests.test_hf_generation import check_call

    model = copy.deepcopy(model_for("llama")).to(torch.float64)
    factory = static_states([sr_basis(model, 6)] * 2, coefficients="int4", group_size=4)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
    kw = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    with compress(model, factory) as kv:
        greedy = model.generate(ids, cache=kv.cache(), **kw)
        lookup = model.generate(ids, prompt_lookup_num_tokens=3, cache=kv.cache(), **kw)
    assert check_call("llama/int4/lookup", model, greedy, lookup, True, False, tolerance("llama", "float32"))
