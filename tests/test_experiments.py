"""The experiment runner (subspace_ref/lab/experiments) on a tiny random Llama and a tiny random BERT:
every subcommand runs end to end and writes its outputs, the report carries the verdict table,
and each falsifier's verdict follows from made-up numbers as its rule says."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from subspace_ref.hf_requirements import MIN_TRANSFORMERS

pytest.importorskip("torch")
pytest.importorskip("transformers", minversion=MIN_TRANSFORMERS)  # older: generate has no cache= (skipped, both versions named)
pytest.importorskip("matplotlib")

from subspace_ref.lab.experiments import SUBCOMMANDS  # noqa: E402
from subspace_ref.lab.experiments import _common as C  # noqa: E402
from subspace_ref.lab.experiments import falsify as F  # noqa: E402

TINY = ["--model", "tiny-random", "--profile", "tiny", "--no-progress"]


def parse(module, argv):
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(argv)


def tiny_bert(folder: Path) -> Path:
    """A 2-layer random BERT (4 heads of 8) with a small word-piece vocabulary, saved like a hub folder."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", "(", ")", "'", "-"] + letters + ["##" + c for c in letters]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), do_lower_case=True).save_pretrained(folder)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                     max_position_embeddings=128)
    BertModel(cfg).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """`experiments --full` with the tiny profile on the tiny Llama, MiniLM's code on a tiny BERT."""
    from subspace_ref.lab.experiments import main_job

    root = tmp_path_factory.mktemp("experiments")
    bert = tiny_bert(root / "bert")
    args = parse(main_job, ["--full", *TINY, "--out", str(root / "out"), "--docs", str(root / "docs"),
                            "--minilm-path", str(bert), "--minilm-sentences", "8"])
    assert main_job.run(args) == 0
    return root


def test_every_subcommand_is_registered_with_the_cli_interface():
    import importlib

    for name, (module, _help) in SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        assert callable(mod.add_arguments) and callable(mod.run), name


def test_full_run_writes_every_output(full_run):
    out = full_run / "out"
    for name in ("calibration.json", "calibration/svd.npz", "ppl.json", "ppl.csv", "ppl_tokens.npz", "spectra.json",
                 "falsify.json", "minilm.json", "minilm.csv"):
        assert (out / name).exists(), name
    for fig in ("ppl_vs_rank.png", "ppl_by_position.png", "ppl_vs_bytes.png", "spectra_energy.png", "spectra_sigma.png",
                "spectra_chunks.png", "residual_traces.png", "falsify_errors.png", "minilm_spectra.png", "minilm_fidelity.png"):
        assert (out / "figures" / fig).stat().st_size < 200_000, fig
    ppl = json.loads((out / "ppl.json").read_text())
    methods = {r["method"] for r in ppl["runs"]}
    assert methods == {"static", "adaptive", "rotating", "static-pre"}
    # the static cache (coefficient space) equals exact attention over the projected keys/values
    assert ppl["checks"]["projection_vs_cache"]["max_abs_token_nll_diff"] < 1e-3
    assert any(r.get("tau_source", "").startswith("paper") for r in ppl["runs"])
    assert {r["compress"] for r in ppl["runs"]} == {"both", "keys", "values"}
    assert any(r["coefficients"] == "int8" for r in ppl["runs"])
    assert {r["gamma"] for r in ppl["runs"] if r["method"] == "static"} == {"unit", "paper", "mse"}
    assert {r["sketch_reset"] for r in ppl["runs"] if r["method"] == "adaptive"} == {True, False}
    for r in ppl["runs"]:
        assert r["bytes_per_token"] > 0 and set(r["by_position"]) == set(ppl["baseline"]["by_position"])
    cal = json.loads((out / "calibration.json").read_text())
    assert cal["gamma_in_sample_max_abs_deviation"] < 1e-8  # the MSE gamma fitted in-sample is exactly 1
    for t in cal["tau"]["by_rank"].values():
        assert all(0 < x < 1 for x in t["tau_k"] + t["tau_v"])
    mini = json.loads((out / "minilm.json").read_text())
    assert mini["equivalence_max_abs_diff"] < 1e-4  # projected sdpa == subspace_ref.attend
    full_rank = [r for r in mini["fidelity"] if r.get("rank") == mini["d"] and r["side"] == "both" and r["gamma"] == "unit"]
    assert full_rank and full_rank[0]["cos_mean"] > 0.9999  # rank d is exact


def test_report_has_the_verdict_table_and_its_figures(full_run):
    page = (full_run / "docs" / "experiments.md").read_text()
    assert "GENERATED" in page
    assert "| id | source | falsifier | claim | numbers |" in page
    for fid in ("001-1", "001-2", "001-3", "001-4", "003-1", "003-2", "003-3"):
        assert f"| {fid} |" in page
    for ref in [line.split("(figures/")[1].split(")")[0] for line in page.splitlines() if "](figures/" in line]:
        assert (full_run / "docs" / "figures" / ref).stat().st_size < 200_000
    fal = json.loads((full_run / "out" / "falsify.json").read_text())
    for f in fal["falsifiers"]:
        assert f["verdict"] in ("supported", "refuted", "inconclusive")
        assert f["why"] in page  # the numbers behind each verdict are on the page, from the JSON


def test_quick_main_job_prints_the_table(tmp_path, capsys):
    from subspace_ref.lab.experiments import main_job

    assert main_job.run(parse(main_job, [*TINY, "--out", str(tmp_path)])) == 0
    text = capsys.readouterr().out
    for col in ("method", "rank k/v", "ppl", "Δppl %", "KV B/token", "chunks"):
        assert col in text
    assert "adaptive" in text and "rotating" in text and "seed 001 falsifier 1" in text and "seed 003 falsifier 1" in text
    assert (tmp_path / "quick" / "ppl.json").exists()


# ----------------------------------------------------------------------------- verdicts from made-up numbers
def row(method="static", rank=16, delta=0.5, compress="both", **kw):
    r = dict(method=method, name=f"{method} r{rank} {compress}", rank=rank, rank_k=rank, rank_v=rank, rank_max=rank,
             delta_pct=delta, compress=compress, gamma="unit", coefficients="float", ppl=10 * (1 + delta / 100))
    r.update(kw)
    return r


def test_low_rank_refuted_when_no_small_rank_meets_one_percent():
    rows = [row(rank=8, delta=3.0), row(rank=16, delta=1.5), row(rank=32, delta=0.2),
            row(rank=4, delta=0.1, compress="keys")]  # one-sided compression does not count
    v = F.verdict_low_rank(rows, d=64)
    assert v["verdict"] == "refuted"
    assert v["best_at_d4"]["delta_pct"] == 1.5
    assert v["smallest_rank_meeting_threshold"]["static uniform γ=unit"]["rank"] == 32


def test_low_rank_supported_by_a_small_rank_meeting_one_percent():
    v = F.verdict_low_rank([row(rank=8, delta=3.0), row(rank=16, delta=0.9)], d=64)
    assert v["verdict"] == "supported" and "rank 16" in v["why"]
    assert F.verdict_low_rank([row(rank=32, delta=0.1)], d=64)["verdict"] == "inconclusive"


def test_adaptive_vs_static_verdict():
    static = [row(rank=r, delta=1.0) for r in (8, 16, 32)]
    worse = [row("adaptive", rank=r, delta=2.0, sketch_reset=s) for r in (8, 16, 32) for s in (False, True)]
    assert F.verdict_adaptive_vs_static(static + worse)["verdict"] == "refuted"
    better = [row("adaptive", rank=r, delta=0.5, sketch_reset=True) for r in (8, 16, 32)]
    assert F.verdict_adaptive_vs_static(static + better)["verdict"] == "supported"


def test_online_significance_verdict():
    sig = [dict(rank=r, online="rotating", delta_nll=-0.01, delta_nll_ci=[-0.02, -0.001]) for r in (8, 16)]
    not_sig = [dict(rank=r, online="adaptive", delta_nll=-0.01, delta_nll_ci=[-0.02, 0.003]) for r in (8, 16, 32)]
    assert F.verdict_online_significance(sig)["verdict"] == "supported"
    assert F.verdict_online_significance(not_sig)["verdict"] == "refuted"
    assert F.verdict_online_significance([])["verdict"] == "inconclusive"


def test_context_verdict():
    buckets = ["1-63", "64-255", "256-511", "512-1023"]

    def ada(values):
        return row("adaptive", rank=16, by_position={b: dict(delta_pct=v) for b, v in zip(buckets, values)}, sketch_reset=True)

    assert F.verdict_context([ada([0.0, 0.5, 1.5, 4.0])], 64, buckets)["verdict"] == "refuted"
    assert F.verdict_context([ada([0.0, 0.5, 0.8, 1.2])], 64, buckets)["verdict"] == "supported"


def test_rope_verdict():
    def spectra(post, pre):
        return dict(layers=[dict(keys=dict(post=dict(ranks={"0.95": post}), pre=dict(ranks={"0.95": pre})))])

    assert F.verdict_rope(spectra([60, 50], [20, 20]), d=64)["verdict"] == "refuted"
    assert F.verdict_rope(spectra([30, 20], [20, 20]), d=64)["verdict"] == "supported"
    assert F.verdict_rope(spectra([60, 50], [60, 50]), d=64)["verdict"] == "inconclusive"  # high rank, but not RoPE's doing
    # perplexity decides too: the post-RoPE basis needs r = 48 = 3d/4 for 1%, the pre-RoPE basis 16
    rows = [row(rank=16, delta=5.0), row(rank=48, delta=0.8), row("static-pre", rank=16, delta=0.9)]
    v = F.verdict_rope(spectra([30, 20], [20, 20]), d=64, rows=rows)
    assert v["verdict"] == "refuted" and v["smallest_rank_post"] == 48 and v["smallest_rank_pre"] == 16
    assert F.verdict_rope(spectra([30, 20], [20, 20]), d=64, rows=rows[:1] + [row(rank=32, delta=0.5)])["verdict"] == "supported"


def test_low_rank_can_exclude_the_pre_rope_ablation():
    rows = [row(rank=16, delta=5.0), row("static-pre", rank=16, delta=0.5)]
    assert F.verdict_low_rank(rows, d=64)["verdict"] == "supported"
    assert F.verdict_low_rank(rows, d=64, exclude=("static-pre",))["verdict"] == "refuted"


def test_predictor_verdict():
    good = {f"{a} ~ {b}": dict(rho=0.8, p=1e-6, n=50) for a, b in F.PREDICTOR_PAIRS}
    assert F.verdict_predictors(good)["verdict"] == "supported"
    bad = dict(good)
    bad["fd_eps_v ~ output_error"] = dict(rho=0.2, p=0.3, n=50)
    v = F.verdict_predictors(bad)
    assert v["verdict"] == "refuted" and "fd_eps_v ~ output_error" in v["why"]
    # pooled correlations carried by the rank alone do not count
    within_good = {r: {k: dict(rho=0.6) for k in good} for r in ("8", "16")}
    assert F.verdict_predictors(good, within_good)["verdict"] == "supported"
    within_flat = {r: {k: dict(rho=0.0) for k in good} for r in ("8", "16")}
    assert F.verdict_predictors(good, within_flat)["verdict"] == "refuted"


# ----------------------------------------------------------------------------- helpers
def test_position_buckets_match_the_training_report():
    assert C.position_edges(1024) == [1, 64, 256, 512, 1024]
    from subspace_ref.lab.experiments.ppl import by_position

    nll = np.arange(1023, dtype=float)[None]  # column t predicts with context length t + 1
    b = by_position(nll, C.position_edges(1024))
    assert list(b) == ["1-63", "64-255", "256-511", "512-1023"]
    assert b["1-63"] == pytest.approx(np.mean(np.arange(63)))
    assert b["512-1023"] == pytest.approx(np.mean(np.arange(511, 1023)))


def test_block_bootstrap_covers_the_mean():
    rng = np.random.default_rng(0)
    diff = 0.1 + rng.standard_normal((4, 512))
    lo, hi = C.block_bootstrap(diff, 64)
    assert lo < diff.mean() < hi and lo < 0.1 < hi
