"""The bounds sweep (spec B9): the CLI on the quick grid with a saved cache, its outputs and the
generated theory page; the RoPE helper; the cache loader."""

import json
import math

import numpy as np
import pytest

from subspace_ref.lab.bounds import CLAIMS, COUNTEREXAMPLES
from subspace_ref.lab.bounds import sweep


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    from subspace_ref.cli import main

    tmp = tmp_path_factory.mktemp("bounds")
    caches = tmp / "caches"
    caches.mkdir()
    rng = np.random.default_rng(3)
    K = rng.standard_normal((2, 2, 40, 3)) @ rng.standard_normal((3, 8))  # 2 layers, H = 2, d = 8
    V = rng.standard_normal((2, 2, 40, 8))
    Q = rng.standard_normal((2, 4, 40, 8))
    np.savez(caches / "model.npz", K=K, V=V, Q=Q)
    np.savez(caches / "unrelated.npz", weights=np.zeros(3))
    out = tmp / "out"
    theory = tmp / "theory.md"
    rc = main(["bounds", "--quick", "--out", str(out), "--theory", str(theory), "--caches", str(caches), "--no-progress"])
    return rc, out, theory


def test_quick_sweep_writes_every_output(quick_run):
    rc, out, theory = quick_run
    assert rc == 0  # no guarantee violated
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["cache_layers"] == 2 and summary["meta"]["configurations"] > 50
    assert set(summary["claims"]) == set(CLAIMS)
    for cid, s in summary["claims"].items():
        assert s["violations"] == 0, cid
        if CLAIMS[cid].kind == "guarantee":
            assert s["failed"] == 0, cid
    for name, ce in summary["counterexamples"].items():
        assert all(not r["held"] for r in ce["refutes"].values()), name
        assert ce["violations"] == []
    header = (out / "bounds.csv").read_text().splitlines()[0]
    for col in ("config", "claim", "measured", "bound", "ratio", "held", "guarantee"):
        assert col in header
    assert (out / "bounds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(k.startswith("cache:model.npz") for k in {p["source"] for p in json.loads((out / "predictors.json").read_text())})


def test_quick_sweep_reports_predictor_correlations(quick_run):
    _, out, _ = quick_run
    sp = json.loads((out / "summary.json").read_text())["spearman"]["all"]
    for pair in ("max_chunk_residual_k ~ logit_error", "bound_B4.4.c ~ output_error", "fd_eps_k ~ max_chunk_residual_k"):
        assert -1.0 <= sp[pair]["rho"] <= 1.0 and sp[pair]["n"] >= 3


def test_theory_page_is_generated_from_the_sweep(quick_run):
    _, out, theory = quick_run
    text = theory.read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert text.startswith("# What the theory guarantees") and "GENERATED" in text
    for cid, claim in CLAIMS.items():
        assert f"### {cid}." in text
        if claim.kind == "paper form":
            assert f"counterexample `{claim.counterexample}`" in text
    for name in COUNTEREXAMPLES:
        assert f"Counterexample `{name}`" in text
    # the tightness numbers on the page are the summary's
    s = summary["claims"]["B3.1"]
    assert f"median {s['median_ratio']:.3g}, worst {s['worst_ratio']:.3g}" in text
    assert "Spearman" in text


def test_module_entry_point_and_missing_caches(tmp_path, capsys):
    from subspace_ref.lab.bounds.__main__ import main

    # --caches pointing nowhere is skipped, not an error
    rc = main(["--quick", "--out", str(tmp_path / "o"), "--theory", str(tmp_path / "t.md"), "--no-plot",
               "--no-progress", "--caches", str(tmp_path / "absent")])
    assert rc == 0
    assert "not a folder" in capsys.readouterr().err
    assert not (tmp_path / "o" / "bounds.png").exists()


def test_rope_rotates_pairs_and_keeps_relative_positions(rng):
    d = 8
    x, y = rng.standard_normal(d), rng.standard_normal(d)
    assert np.linalg.norm(sweep.rope(x, 7)) == pytest.approx(np.linalg.norm(x))
    assert np.allclose(sweep.rope(x, 0), x)
    # q(m) . k(n) depends on m - n only: the property RoPE exists for
    a = sweep.rope(x, 5) @ sweep.rope(y, 2)
    b = sweep.rope(x, 13) @ sweep.rope(y, 10)
    assert a == pytest.approx(b, rel=1e-12)
    # the first pair turns by the position itself (frequency 1): half-split layout
    e = np.zeros(d)
    e[0] = 1.0
    r = sweep.rope(e, 0.5)
    assert r[0] == pytest.approx(math.cos(0.5)) and r[d // 2] == pytest.approx(math.sin(0.5))
    with pytest.raises(ValueError):
        sweep.rope(np.ones(3), 1)


def test_cache_loader_accepts_per_layer_names(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {}
    for layer in range(2):
        arrays[f"layer{layer}_K"] = rng.standard_normal((2, 30, 4))
        arrays[f"layer{layer}_V"] = rng.standard_normal((2, 30, 4))
        arrays[f"layer{layer}_Q"] = rng.standard_normal((4, 30, 4))
    np.savez(tmp_path / "c.npz", **arrays)
    found = sweep.load_caches(tmp_path, max_tokens=20)
    assert [n for n, *_ in found] == ["cache:c.npz:layer0", "cache:c.npz:layer1"]
    assert all(K.shape == (2, 20, 4) and Q.shape == (4, 20, 4) for _, K, _, Q in found)


def test_synthetic_streams_have_the_stated_structure():
    K, V, Q = sweep.synthetic_stream("lowrank", 16, 64, 2, 4, 0)
    assert K.shape == (2, 64, 16) and Q.shape == (4, 64, 16)
    s = np.linalg.svd(K[0], compute_uv=False)
    assert s[4] < 0.2 * s[3]  # true rank d/4 = 4 plus small noise
    logits = np.einsum("td,sd->ts", Q[0], K[0]) / 4
    assert logits.std() == pytest.approx(sweep.TARGET_LOGIT_STD, rel=0.5)
    Ks, _, _ = sweep.synthetic_stream("sink", 16, 64, 2, 4, 0)
    norms = np.linalg.norm(Ks[0], axis=1)
    assert norms[0] > 4 * np.median(norms[1:])  # one dominant token


def test_theory_page_states_its_scope_and_sweeps_the_model_by_default(quick_run):
    import argparse

    from subspace_ref.lab.bounds.sweep import add_arguments, capture_model

    _, _, theory = quick_run
    assert "## Scope and limits" in theory.read_text()
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert capture_model(p.parse_args([])) and not capture_model(p.parse_args(["--quick"]))
    assert not capture_model(p.parse_args(["--no-capture-default-model"]))
