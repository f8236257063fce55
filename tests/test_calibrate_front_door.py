"""The front door (issue 37, spec/layer_state.md L6): `subspace-kv calibrate` runs the measured-loss
allocator on a local checkpoint and saves the allocation with the bases; `compress(model, bases)`
decodes exactly it; bad input is refused naming the field, with nothing written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from subspace_ref.hf_requirements import MIN_TRANSFORMERS

pytest.importorskip("transformers", minversion=MIN_TRANSFORMERS)  # older: generate has no cache= (skipped, both versions named)

import transformers  # noqa: E402

from subspace_ref.allocation import Allocation, HeadAllocation, allocate, best_uniform, greedy  # noqa: E402
from subspace_ref.byte_convention import Geometry, side_parts  # noqa: E402
from subspace_ref.hf import CalibratedBases, allocated_states, compress  # noqa: E402
from subspace_ref.hf.calibrate_checkpoint import calibrate_checkpoint  # noqa: E402
from subspace_ref.hf.grouped_layer import GroupedLayer  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random byte-level Llama saved as a checkpoint directory (head size 32, 2 KV heads)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2)
    path = tmp_path_factory.mktemp("ckpt")
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


def test_the_command_saves_an_allocation_that_compress_decodes(checkpoint, tmp_path, capsys):
    from subspace_ref.cli import main

    args = ["calibrate", "--model", str(checkpoint), "--compression-ratio", "0.3", "--sinks", "2", "--window", "8", "--context", "64",
            "--calibration-tokens", "640", "--group", "8", "--no-progress", "--bases-out", str(tmp_path / "bases")]
    assert main(args) == 0
    assert "allocator" in capsys.readouterr().out
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    bases = CalibratedBases.from_pretrained(tmp_path / "bases", model.config)
    alloc = bases.allocation
    assert (alloc.sinks, alloc.window, alloc.group) == (2, 8, 8)
    geom = Geometry.of_model(model, 64)
    assert alloc.bytes(geom).fraction <= 0.3 + 1e-9 and bases.calibration["rule"] == "allocator"
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    with compress(model, bases) as kv:
        cache = kv.cache()
        kv.generate(ids, max_new_tokens=4, do_sample=False, cache=cache)
    for li, layer in enumerate(cache.layers):
        assert isinstance(layer, GroupedLayer)
        st = layer.state
        assert st.window.size == 8 and st.window.sinks == 2
        for group in st.groups:
            head = alloc.heads[li][group.heads[0]]
            formats = {16: "float", 8: "int8", 4: "int4", 2: "int2"}
            assert group.state.layout.key_format == formats[head.bits_k] and group.state.layout.value_format == formats[head.bits_v]
            assert (getattr(group.state.policy, "rope", None) is not None) == (head.key_basis == "pre_rope")
            assert group.key_identity == (head.key_basis == "identity") and group.value_identity == (head.value_basis == "identity")
    # the same allocation through the graph-capturable cache (spec/models.md M11.12, M11.14): its sinks, window and mixed heads
    # give the SubspaceCache's greedy tokens, whose top-2 margins are checked first
    with compress(model, bases) as kv:
        eager = kv.generate(ids, max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    assert min(float(torch.topk(score[0], 2).values.diff().abs()) for score in eager.scores) > 1e-4
    with compress(model, bases, graph=True) as kv:
        graph_cache = kv.graph_cache(ids.shape[1] + 4)
        assert torch.equal(kv.generate(ids, max_new_tokens=4, do_sample=False, cache=graph_cache), eager.sequences)
    assert all(layer.exact is not None and len(layer.groups) == len(cache.layers[i].state.groups) for i, layer in enumerate(graph_cache.layers))


def test_bad_input_is_refused_before_anything_is_written(checkpoint, tmp_path):
    out = tmp_path / "never"
    cases = [
        (dict(ratio=0.0), "compression_ratio"),
        (dict(ratio=1.5), "compression_ratio"),
        (dict(ratio=0.3, sinks=-1), "sinks"),
        (dict(ratio=0.3, window=2.5), "window"),
        (dict(ratio=0.3, rule="energy", window=4), "energy rule keeps no exact tokens"),
        (dict(ratio=0.3, rule="magic"), "rule"),
        (dict(ratio=0.01, sinks=4, window=16), "below what sinks=4 and window=16 alone cost"),
    ]
    for kwargs, message in cases:
        ratio = kwargs.pop("ratio")
        with pytest.raises(ValueError, match=message):
            calibrate_checkpoint(checkpoint, ratio, context=64, tokens=128, **kwargs)
    assert not out.exists()


def test_an_allocation_that_does_not_fit_the_model_is_refused(checkpoint):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    bases = calibrate_checkpoint(checkpoint, 0.5, context=64, tokens=128)
    layer = bases.layers[0]
    wrong_heads = Allocation((bases.allocation.heads[0][:1],) * 2)
    with pytest.raises(ValueError, match="heads"):
        allocated_states(list(bases.layers), wrong_heads)
    with pytest.raises(ValueError, match="one per layer"):
        allocated_states([layer], bases.allocation)
    with pytest.raises(ValueError, match="coefficient_bits"):
        CalibratedBases.for_model(model, list(bases.layers), allocation=bases.allocation, coefficient_bits=8)
    with pytest.raises(ValueError, match="bits_k must be one of"):
        HeadAllocation(4, 4, bits_k=3)
    with pytest.raises(ValueError, match="value_basis must be one of"):
        HeadAllocation(4, 4, value_basis="pre_rope")
    too_big = Allocation(tuple(tuple(HeadAllocation(40, 4) for _ in range(2)) for _ in range(2)))
    with pytest.raises(ValueError, match="above the basis"):
        ids = torch.randint(0, 256, (1, 4))
        with compress(model, allocated_states(list(bases.layers), too_big)) as kv:
            kv.generate(ids, max_new_tokens=1, do_sample=False)


def _tables(rng, heads: int) -> list:
    """Random measured-loss tables with identity and subspace candidates (losses falling with
    rank and bits), for the allocator's uniform guarantee."""
    out = []
    for _ in range(heads):
        key = {(r, b): float(rng.uniform(0.5, 1.5) * 2.0 ** (-r / 4) * (1 + 4.0 ** (-b / 4))) for r in range(1, 9) for b in (16, 8, 4, 2)}
        val = {(r, b): float(rng.uniform(0.5, 1.5) * 2.0 ** (-r / 4) * (1 + 4.0 ** (-b / 4))) for r in range(0, 9) for b in (16, 8, 4, 2)}
        ident_k = {(8, b): float(rng.uniform(0.0, 0.3) * 4.0 ** (-b / 2)) for b in (16, 8, 4, 2)}
        ident_v = {(8, b): float(rng.uniform(0.0, 0.3) * 4.0 ** (-b / 2)) for b in (16, 8, 4, 2)}
        out.append({("key", "post_rope"): key, ("key", "identity"): ident_k, ("value", "subspace"): val, ("value", "identity"): ident_v})
    return [out]


@pytest.mark.parametrize("seed", range(6))
def test_the_allocation_is_at_least_as_good_as_every_uniform_one(seed):
    """spec/layer_state.md L6.1 on random tables: allocate's loss is at most that of every uniform
    allocation within the budget (brute force over them), the quantisation rows included."""
    rng = np.random.default_rng(seed)
    geom = Geometry(1, 3, 8, 8, 64)
    tables = _tables(rng, 3)
    for fraction in (0.15, 0.3, 0.6):
        a = allocate(tables, geom, compression_ratio=fraction, group=8)
        budget = fraction * geom.full_bytes_per_token - geom.units * 4 / geom.context
        for (kk, kt) in (("post_rope", tables[0][0][("key", "post_rope")]), ("identity", tables[0][0][("key", "identity")])):
            for (vk, vt) in (("subspace", tables[0][0][("value", "subspace")]), ("identity", tables[0][0][("value", "identity")])):
                for rk, bk in kt:
                    for rv, bv in vt:
                        spent = geom.units * (sum(side_parts(geom, "key", rk, bk, 8, 1.0, kk != "identity").values())
                                              + sum(side_parts(geom, "value", rv, bv, 8, 1.0, vk != "identity").values()))
                        if spent / geom.units <= budget / geom.units + 1e-9:
                            loss = sum(t[("key", kk)][(rk, bk)] + t[("value", vk)][(rv, bv)] for t in tables[0])
                            assert a.calibration_loss <= loss * (1 + 1e-12)


def test_the_uniform_fallback_is_taken_where_the_greedy_walk_stops_short():
    """Ranks 1, 2, 8 with losses 10, 9.9, 0: rank 2 is off the lower hull, and at the bytes of rank 2
    on both heads the walk cannot take the step to rank 8 (loss 20), while uniform rank 2 fits
    (loss 19.8): allocate takes it and says so (meta["rule"])."""
    geom = Geometry(1, 2, 8, 8, 64)
    keys = {(1, 16): 10.0, (2, 16): 9.9, (8, 16): 0.0}
    tables = [[{("key", "post_rope"): keys, ("value", "subspace"): {(0, 16): 0.0}} for _ in range(2)]]
    two = sum(side_parts(geom, "key", 2, 16, 8).values())
    fixed = geom.units * 4 / geom.context
    chosen, _, loss = greedy({(0, h, s): _candidates(geom, tables[0][h][(s, k)], s, k) for h in range(2) for s, k in (("key", "post_rope"), ("value", "subspace"))}, 2 * two)
    assert loss == 20.0  # the walk alone stays at rank 1
    a = allocate(tables, geom, bytes_per_token=2 * two + fixed, group=8)
    assert [h.rank_k for h in a.heads[0]] == [2, 2] and a.calibration_loss == pytest.approx(19.8) and a.meta["rule"] == "uniform"
    assert best_uniform({(0, 0, "key"): _candidates(geom, keys, "key", "post_rope")}, 0.1) is None  # nothing fits: no uniform allocation


def _candidates(geom, table, side, kind):
    from subspace_ref.allocation import Candidate

    return [Candidate(sum(side_parts(geom, side, r, b, 8).values()), loss, (kind, r, b)) for (r, b), loss in table.items()]


def test_key_bases_restrict_the_kinds_and_bad_kinds_are_refused():
    """spec/layer_state.md L6.3: with key_bases the allocator chooses keys of those kinds only, and
    its loss is at least that of the unrestricted allocation (a subset of the candidates); the
    restriction is recorded in meta. Unknown or no kinds: ValueError naming key_bases."""
    rng = np.random.default_rng(7)
    geom = Geometry(1, 3, 8, 8, 64)
    tables = _tables(rng, 3)
    free = allocate(tables, geom, compression_ratio=0.3, group=8)
    only = allocate(tables, geom, compression_ratio=0.3, group=8, key_bases=("post_rope",))
    assert {h.key_basis for h in only.heads[0]} == {"post_rope"} and only.meta["key_bases"] == ["post_rope"]
    assert "identity" in {h.key_basis for h in free.heads[0]} and "key_bases" not in free.meta  # the tables make identity keys cheap
    assert only.calibration_loss >= free.calibration_loss
    assert allocate(tables, geom, compression_ratio=0.3, group=8, key_bases="identity,post_rope").heads == free.heads
    for bad in (("pre-rope",), (), "post_rope,bogus"):
        with pytest.raises(ValueError, match="key_bases"):
            allocate(tables, geom, compression_ratio=0.3, group=8, key_bases=bad)
    with pytest.raises(ValueError, match="key_bases.*no measured key candidate"):
        allocate(tables, geom, compression_ratio=0.3, group=8, key_bases=("pre_rope",))


def test_calibrate_refuses_unknown_key_bases_before_any_model_runs(tmp_path):
    from subspace_ref.hf.calibrate_checkpoint import calibrate_checkpoint

    with pytest.raises(ValueError, match="key_bases"):
        calibrate_checkpoint(tmp_path / "no-such-checkpoint", 0.25, key_bases="post_rope,sideways")


def test_max_pre_rope_rank_caps_the_rebuilt_keys_and_bad_caps_are_refused():
    """spec/layer_state.md L6.4: with max_pre_rope_rank=R no pre-RoPE key of the allocation has rank
    above R (its decode costs at most R d multiply-adds per token), the other kinds are untouched
    (L6.1's uniform guarantee still holds against the identity rows), and the cap is recorded in
    meta. Not an int >= 1: ValueError naming max_pre_rope_rank, from calibrate before any model runs."""
    rng = np.random.default_rng(11)
    geom = Geometry(1, 3, 8, 8, 64)
    tables = _tables(rng, 3)
    for t in tables[0]:  # pre-RoPE keys cheapest in loss at every rank, so the uncapped walk takes high ranks
        t[("key", "pre_rope")] = {(r, b): loss / 100 for (r, b), loss in t[("key", "post_rope")].items()}
    free = allocate(tables, geom, compression_ratio=0.3, group=8)
    assert max(h.rank_k for h in free.heads[0] if h.key_basis == "pre_rope") > 1 and "max_pre_rope_rank" not in free.meta
    capped = allocate(tables, geom, compression_ratio=0.3, group=8, max_pre_rope_rank=1)
    assert all(h.rank_k <= 1 for h in capped.heads[0] if h.key_basis == "pre_rope") and capped.meta["max_pre_rope_rank"] == 1
    assert capped.heads != free.heads
    budget = 0.3 * geom.full_bytes_per_token - geom.units * 4 / geom.context
    for bk in (16, 8, 4, 2):  # every uniform identity-key row that fits, values as cheap as they come
        spent = geom.units * (sum(side_parts(geom, "key", 8, bk, 8, 1.0, False).values()) + sum(side_parts(geom, "value", 0, 16, 8).values()))
        if spent <= budget + 1e-9:
            row = sum(t[("key", "identity")][(8, bk)] + t[("value", "subspace")][(0, 16)] for t in tables[0])
            assert capped.calibration_loss <= row * (1 + 1e-12)
    assert allocate(tables, geom, compression_ratio=0.3, group=8, max_pre_rope_rank=8).heads == free.heads  # a cap above every rank: no change
    for bad in (0, -2, 2.5, True, "16"):
        with pytest.raises(ValueError, match="max_pre_rope_rank"):
            allocate(tables, geom, compression_ratio=0.3, group=8, max_pre_rope_rank=bad)
    with pytest.raises(ValueError, match="max_pre_rope_rank"):
        calibrate_checkpoint("/no-such-checkpoint", 0.25, max_pre_rope_rank=0)


def test_the_command_saves_the_capped_allocation(checkpoint, tmp_path):
    """`subspace-kv calibrate --max-pre-rope-rank R` (L6.4) passes the cap to the allocator, whose
    filtering the table test above checks (this random model's heads take identity keys): the cap
    travels with the saved allocation, a quarter of the head size (16 here) by default and none with
    ``none``; a cap of 0 or a word is refused with nothing written."""
    from subspace_ref.cli import main

    args = ["calibrate", "--model", str(checkpoint), "--compression-ratio", "0.5", "--sinks", "2", "--window", "8", "--context", "64",
            "--calibration-tokens", "640", "--group", "8", "--no-progress"]
    assert main(args + ["--max-pre-rope-rank", "3", "--bases-out", str(tmp_path / "capped")]) == 0
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    alloc = CalibratedBases.from_pretrained(tmp_path / "capped", config).allocation
    assert alloc.meta["max_pre_rope_rank"] == 3
    assert main(args + ["--bases-out", str(tmp_path / "auto")]) == 0
    assert CalibratedBases.from_pretrained(tmp_path / "auto", config).allocation.meta["max_pre_rope_rank"] == 4
    assert main(args + ["--max-pre-rope-rank", "none", "--bases-out", str(tmp_path / "free")]) == 0
    assert "max_pre_rope_rank" not in CalibratedBases.from_pretrained(tmp_path / "free", config).allocation.meta
    with pytest.raises(SystemExit):  # argparse names the option
        main(args + ["--max-pre-rope-rank", "quarter", "--bases-out", str(tmp_path / "refused")])
    with pytest.raises(ValueError, match="max_pre_rope_rank"):
        main(args + ["--max-pre-rope-rank", "0", "--bases-out", str(tmp_path / "refused")])
    assert not (tmp_path / "refused").exists()
