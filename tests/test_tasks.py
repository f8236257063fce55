"""Accuracy tasks (issue 12): instances, scoring, budgets, and the recall task's validity."""

from __future__ import annotations

import json

import numpy as np
import pytest

from subspace_ref.hf_requirements import MIN_TRANSFORMERS

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion=MIN_TRANSFORMERS)  # older: generate has no cache= (skipped, both versions named)

from subspace_ref.lab.experiments import _common as C  # noqa: E402
from subspace_ref.lab.experiments.statistics import bootstrap_ci  # noqa: E402
from subspace_ref.lab.tasks import lambada_targets, make_needles, score_answer  # noqa: E402
from subspace_ref.lab.tasks.next_token import lambada_correct, next_token_correct  # noqa: E402


@pytest.fixture(scope="module")
def heldout():
    return C.stream("heldout")


@pytest.fixture(scope="module")
def shipped():
    model, _ = C.load_model("default")
    torch.set_num_threads(1)
    return model


def test_instances_deterministic(heldout):
    a = make_needles(heldout, (256, 512), (0.1, 0.9), 3, seed=5)
    b = make_needles(heldout, (256, 512), (0.1, 0.9), 3, seed=5)
    c = make_needles(heldout, (256, 512), (0.1, 0.9), 3, seed=6)
    assert [x.as_dict() for x in a] == [x.as_dict() for x in b]
    assert [x.ids for x in a] != [x.ids for x in c]
    assert all(len(x.ids) == x.length for x in a)
    # the control differs from its instance only by the needle line
    w, wo = a[0], a[1]
    assert w.needle and not wo.needle and w.ids[-w.answer_len:] == wo.ids[-wo.answer_len:]
    wins = C.windows("heldout", 2, 512, 3)
    assert lambada_targets(wins, seed=1) == lambada_targets(wins, seed=1)


def _onehot_logits(ids, flip=None):
    """Logits whose argmax at t is ids[t+1] (a perfect predictor); ``flip`` breaks position flip."""
    ids = np.asarray(ids)
    B, T = ids.shape
    lg = torch.zeros(B, T, 256)
    nxt = np.concatenate([ids[:, 1:], ids[:, -1:]], axis=1)
    lg[torch.arange(B)[:, None], torch.arange(T)[None, :], torch.as_tensor(nxt)] = 5.0
    if flip is not None:
        lg[:, flip] = 0.0
        lg[:, flip, (int(nxt[0, flip]) + 1) % 256] = 5.0
    return lg


def test_harness_right_and_wrong(heldout):
    inst = make_needles(heldout, (256,), (0.5,), 2, seed=0)
    ids = np.array([x.ids for x in inst])
    a = inst[0].answer_len
    assert score_answer(_onehot_logits(ids), ids, a).all()
    assert not score_answer(_onehot_logits(ids, flip=ids.shape[1] - 2), ids, a).any()  # last answer byte wrong
    assert score_answer(_onehot_logits(ids, flip=ids.shape[1] - a - 3), ids, a).all()  # error before the answer: irrelevant
    assert next_token_correct(_onehot_logits(ids), ids).all()
    wins = C.windows("heldout", 4, 512, 0)
    tg = lambada_targets(wins)
    assert tg and lambada_correct(_onehot_logits(wins), wins, tg).all()
    w, s, n = tg[0]
    bad = _onehot_logits(wins)
    bad[w, s + n - 2] = 0.0
    bad[w, s + n - 2, (int(wins[w, s + n - 1]) + 1) % 256] = 5.0
    assert not lambada_correct(bad, wins, tg[:1]).any()


def test_teacher_forced_score_is_greedy_decoding(shipped, heldout):
    """Scoring from one pass equals greedy decoding of the answer (stock cache)."""
    x = make_needles(heldout, (256,), (0.5,), 1, seed=0, controls=False)[0]
    ids = torch.tensor([x.ids])
    with torch.no_grad():
        lg = shipped(input_ids=ids).logits
        cur = ids[:, : -x.answer_len]
        for _ in range(x.answer_len):
            nxt = shipped(input_ids=cur).logits[:, -1].argmax(-1, keepdim=True)
            cur = torch.cat([cur, nxt], dim=1)
    greedy_ok = bool((cur[0, -x.answer_len:] == ids[0, -x.answer_len:]).all())
    assert bool(score_answer(lg, ids.numpy(), x.answer_len)[0]) == greedy_ok


@pytest.mark.parametrize("length", [256, 512])
def test_full_attention_solves_recall_where_the_model_reaches(shipped, heldout, length):
    """The recall task is valid on the shipped model: with the full cache the needle measurably
    helps, i.e. the paired bootstrap interval of (with needle - control) over the same haystacks
    lies above 0 (the rule docs/tasks.md applies per length). Trained on code alone the model
    failed this at every length; the copy fine-tune (train_default_model) made it pass."""
    inst = make_needles(heldout, (length,), (0.1, 0.5, 0.9), 8, seed=0)
    correct = {}
    for with_needle in (True, False):
        xs = [x for x in inst if x.needle == with_needle]
        ids = np.array([x.ids for x in xs])
        with torch.no_grad():
            lg = shipped(input_ids=torch.as_tensor(ids)).logits
        correct[with_needle] = score_answer(lg, ids, xs[0].answer_len).astype(float)
    lo, _ = bootstrap_ci(correct[True] - correct[False])
    assert lo > 0, (correct[True].mean(), correct[False].mean())


def test_budgets_match_baselines_accounting(shipped):
    from subspace_ref.lab.baselines import methods_at
    from subspace_ref.byte_convention import Geometry, capacity_for
    from subspace_ref.lab.experiments.tasks import method_plan

    plan = method_plan(shipped, (256, 1024), budgets=(0.5, 0.25, 0.125), own=False)
    for f in (0.5, 0.25, 0.125):
        for L in (256, 1024):
            geom = Geometry.of_model(shipped, L)
            ours = [e["at"][L] for e in plan if e["budget"] == f]
            assert ours == methods_at(geom, f)
            sw = next(m for m in ours if type(m).__name__ == "SlidingWindow")
            assert sw.window == capacity_for(geom, f)
            for m in ours:
                if m.family != "quantized KV":
                    assert m.bytes(geom).fraction <= f + 1e-9


def test_bootstrap_ci():
    x = np.r_[np.ones(30), np.zeros(70)]
    lo, hi = bootstrap_ci(x)
    assert lo < 0.3 < hi and bootstrap_ci(x) == (lo, hi)
    assert bootstrap_ci(np.ones(10)) == (1.0, 1.0)


def test_quick_suite_writes_results_page_and_instances(tmp_path):
    """``subspace-kv tasks --quick`` end to end on the tiny random Llama: every method gets a row,
    instances are saved and the page is generated from them."""
    import argparse

    from subspace_ref.lab.experiments import tasks as T

    p = argparse.ArgumentParser()
    T.add_arguments(p)
    args = p.parse_args(["--quick", "--model", "tiny-random", "--no-progress", "--out", str(tmp_path / "out"), "--docs", str(tmp_path / "docs")])
    assert T.run(args) == 0
    record = json.loads((tmp_path / "out" / "tasks.json").read_text())
    inst = json.loads((tmp_path / "out" / "tasks_instances.json").read_text())
    assert record["meta"]["instances_sha256"] == T.instances_hash(inst)
    keys = [r["key"] for r in record["rows"]]
    assert keys[0] == "full cache" and any(k.startswith("adaptive") for k in keys) and any("sliding window" in k for k in keys)
    for r in record["rows"]:
        rec = T.recall_at(r, record["lengths"])
        assert 0.0 <= rec["accuracy"] <= 1.0 and rec["ci"][0] <= rec["accuracy"] <= rec["ci"][1]
    page = (tmp_path / "docs" / "tasks.md").read_text()
    assert "## Summary" in page and (tmp_path / "docs" / "figures" / "tasks_needle_heatmaps.png").exists()


def test_summary_recall_pools_only_the_valid_lengths():
    """A length where the needle does not help is no retrieval test: it must not enter the recall column."""
    from subspace_ref.lab.experiments import tasks as T

    def cell(length, needle, correct):
        return dict(length=length, depth=0.5, needle=needle, correct=correct, n=len(correct), accuracy=float(np.mean(correct)))

    full = dict(needle=[cell(256, True, [1] * 8), cell(256, False, [0] * 8), cell(1000, True, [0] * 8), cell(1000, False, [0] * 8)])
    validity = T.recall_validity(full, [256, 1000])
    assert validity[256]["valid"] and not validity[1000]["valid"]
    rec = T.recall_at(full, [L for L, v in validity.items() if v["valid"]])
    assert rec["accuracy"] == 1.0 and rec["n"] == 8


def test_frontier_rows_are_the_baselines_allocations(shipped):
    """The frontier rows of ``tasks`` are `subspace-kv baselines`' allocator rows at each
    length's geometry: within the budget, or at the quantisation row's bytes, and identical
    allocations to :func:`~subspace_ref.lab.experiments.baselines.frontier_methods`."""
    from subspace_ref.lab.baselines.quantized import QuantizedKV
    from subspace_ref.byte_convention import Geometry
    from subspace_ref.lab.experiments import _common as C
    from subspace_ref.lab.experiments.baselines import frontier_methods
    from subspace_ref.hf.calibration_losses import calibration_losses
    from subspace_ref.lab.experiments.tasks import FRONTIER_KEYS, method_plan

    cal = calibration_losses(shipped, C.windows("train", 1, 128, C.SEED_BASES), ranks=tuple(range(0, 65, 16)))
    plan = method_plan(shipped, (256, 1024), budgets=(0.5, 0.25), own=False, frontier=cal)
    rows = [e for e in plan if e["family"] == "subspace (issue 16)"]
    assert [e["key"] for e in rows] == [f"25% {k}" for k in FRONTIER_KEYS]  # none at 50%
    for L in (256, 1024):
        geom = Geometry.of_model(shipped, L)
        ms = [e["at"][L] for e in rows]
        ref = {m.name: m.allocation for m in frontier_methods(geom, 0.25, cal)}
        for m in ms:
            assert ref[m.name] == m.allocation
        assert ms[0].bytes(geom).fraction <= 0.25 + 1e-9 and ms[1].bytes(geom).fraction <= 0.25 + 1e-9
        assert ms[1].allocation.window == L // 32 and ms[1].allocation.sinks == 4
        assert ms[2].bytes(geom).per_token <= QuantizedKV(bits=4, group=64).bytes(geom).per_token + 1e-9


def test_paired_difference_and_frontier_section():
    """Frontier minus quantisation on the same units: a frontier row that answers every unit the
    quantisation row misses is measurably higher; equal rows tie at exactly 0."""
    from subspace_ref.lab.experiments import tasks as T

    def row(key, family, correct, per_window, lam, name, nbytes):
        cells = [dict(length=256, depth=0.5, needle=True, correct=correct, n=len(correct), accuracy=float(np.mean(correct)))]
        return dict(key=key, family=family, budget=0.25, needle=cells,
                    next_token=dict(correct_per_window=per_window, tokens_per_window=10, accuracy=0.0, ci=[0, 0]),
                    lambada=dict(correct=lam, windows=[0, 0, 1, 1, 2, 2]),
                    bytes={"1024": dict(name=name, bytes_per_token=nbytes, fraction_of_full=nbytes / 2048,
                                        allocation=dict(heads=[[dict(key_basis="pre_rope")]]) if "@" in name else None)})

    quant = row("25% quantized KV", "quantized KV", [0] * 12, [5, 5, 5, 5], [0] * 6, "4-bit KV (g=64)", 576)
    front = row("25% allocator", "subspace (issue 16)", [1] * 12, [9, 9, 9, 9], [0] * 6, "allocator @ 576 bytes", 574)
    d = T.paired_difference(front, quant, [256])
    assert d["recall"]["difference"] == 1.0 and d["recall"]["ci"][0] > 0
    assert d["next_token"]["difference"] == pytest.approx(0.4) and d["next_token"]["ci"][0] > 0
    assert d["lambada"]["difference"] == 0.0 and d["lambada"]["ci"] == [0.0, 0.0]
    record = dict(rows=[quant, front], window_length=1024, meta=dict(budgets=[0.25]))
    text = "\n".join(T.frontier_section(record, [256]))
    assert "allocator @ 576 bytes (574)" in text and "wins measurably on recall, next-token" in text
    assert "1 pre-RoPE, 0 post-RoPE, 0 RoPE-plane" in text
    del front["next_token"]["correct_per_window"]  # a record from before per-unit results were saved
    assert T.frontier_section(record, [256]) == []
