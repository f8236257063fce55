"""Each verdict's rule reads all the data its claim is about (issue 20): keys *and* values, every
rank, both sketch variants, the comparator at matched bytes. Each test changes only the part of
the data a chosen slice would have ignored and checks that the verdict moves."""

from __future__ import annotations

import numpy as np
import pytest

from subspace_ref.lab.experiments import falsify as F
from subspace_ref.lab.experiments import rules as R

BUCKETS = ["1-63", "64-255", "256-511", "512-1023"]


def row(method="static", rank=16, delta=0.5, compress="both", **kw):
    r = dict(method=method, name=f"{method} r{rank} {compress} {kw.get('sketch_reset', '')}{kw.get('energy', '')}", rank=rank,
             rank_k=rank, rank_v=rank, rank_max=rank, delta_pct=delta, compress=compress, gamma="unit", coefficients="float",
             ppl=10 * (1 + delta / 100))
    r.update(kw)
    return r


def test_low_rank_reads_both_sides_and_every_small_rank():
    d = 64
    keys_only = [row(rank=8, delta=0.1, compress="keys"), row(rank=8, delta=0.1, compress="values")]
    assert F.verdict_low_rank(keys_only + [row(rank=16, delta=2.0)], d)["verdict"] == "refuted"
    # the smallest rank failing does not hide a larger rank ≤ d/4 that meets 1%
    assert F.verdict_low_rank([row(rank=4, delta=9.0), row(rank=16, delta=0.8)], d)["verdict"] == "supported"


def test_adaptive_vs_static_reads_every_rank_and_both_variants():
    static = [row(rank=r, delta=1.0) for r in (8, 16, 32)]
    ada = [row("adaptive", rank=r, delta=2.0, sketch_reset=False) for r in (8, 16, 32)]
    assert F.verdict_adaptive_vs_static(static + ada)["verdict"] == "refuted"
    # the reset variant better at two of three ranks turns it: both variants are read
    reset = [row("adaptive", rank=r, delta=0.5, sketch_reset=True) for r in (8, 16)]
    v = F.verdict_adaptive_vs_static(static + ada + reset)
    assert v["verdict"] == "supported" and len(v["comparisons"]) == 3


def test_online_significance_reads_every_rank():
    comps = [dict(rank=r, online="rotating", delta_nll=-0.01, delta_nll_ci=[-0.02, -0.001]) for r in (8, 16)]
    assert F.verdict_online_significance(comps)["verdict"] == "supported"
    comps += [dict(rank=r, online="adaptive", delta_nll=0.01, delta_nll_ci=[-0.001, 0.02]) for r in (32, 48)]
    assert F.verdict_online_significance(comps)["verdict"] == "refuted"


def ada(values, reset, delta=1.0, rank=16):
    return row("adaptive", rank=rank, delta=delta, sketch_reset=reset, by_position={b: dict(delta_pct=v) for b, v in zip(BUCKETS, values)})


def test_context_verdict_reads_both_sketch_variants():
    sharp, flat = [0.0, 0.5, 1.5, 4.0], [0.0, 0.5, 0.8, 1.2]
    assert F.verdict_context([ada(sharp, True), ada(sharp, False, delta=5.0)], 64, BUCKETS)["verdict"] == "refuted"
    assert F.verdict_context([ada(flat, True), ada(flat, False, delta=5.0)], 64, BUCKETS)["verdict"] == "supported"
    # the chosen (best) run alone would say refuted; the other variant disagrees
    v = F.verdict_context([ada(sharp, True, delta=0.5), ada(flat, False, delta=5.0)], 64, BUCKETS)
    assert v["verdict"] == "inconclusive" and set(v["variants"]) == {"sketch_reset", "paper sketches"}


@pytest.mark.parametrize("pair", [f"{a} ~ {b}" for a, b in F.PREDICTOR_PAIRS])
def test_predictor_verdict_reads_keys_and_values(pair):
    good = {f"{a} ~ {b}": dict(rho=0.8, p=1e-6, n=50) for a, b in F.PREDICTOR_PAIRS}
    assert F.verdict_predictors(good)["verdict"] == "supported"
    assert F.verdict_predictors({**good, pair: dict(rho=0.2, p=0.3, n=50)})["verdict"] == "refuted"


def test_predictor_verdict_reads_every_rank():
    good = {f"{a} ~ {b}": dict(rho=0.8, p=1e-6, n=50) for a, b in F.PREDICTOR_PAIRS}
    within = {r: {k: dict(rho=0.6) for k in good} for r in ("4", "8", "16")}
    assert F.verdict_predictors(good, within)["verdict"] == "supported"
    within["8"] = {k: dict(rho=0.0) for k in good}
    within["16"] = {k: dict(rho=0.0) for k in good}
    assert F.verdict_predictors(good, within)["verdict"] == "refuted"


def test_fd_claim_reads_values_too():
    keys_good = {"fd_eps_k ~ max_chunk_residual_k": dict(rho=0.9, p=1e-9, n=90),
                 "fd_eps_v ~ max_chunk_residual_v": dict(rho=0.9, p=1e-9, n=90)}
    assert F.claim_fd_residuals(keys_good)["held"]
    values_bad = {**keys_good, "fd_eps_v ~ max_chunk_residual_v": dict(rho=0.25, p=0.02, n=90)}
    c = F.claim_fd_residuals(values_bad)
    assert not c["held"] and "values" in c["numbers"]


def test_adaptive_savings_claim_reads_every_rank():
    def a(rank, comp):
        return row("adaptive", rank=rank, compression=comp, bytes_per_token=100 / comp, chunks_mean=3.0, tau_source="calibrated")

    assert F.claim_adaptive_savings([a(16, 2.0), a(32, 1.4)])["held"]
    c = F.claim_adaptive_savings([a(16, 2.0), a(48, 0.9)])  # r = 48 stores more than the full cache
    assert not c["held"] and "r48" in c["numbers"]


def test_energy_claim_compares_with_measured_runs_at_no_more_bytes():
    # uniform r32 is cheap and good, r48 dear and good: interpolating between r16 and r48 in log-bytes
    # would credit the energy run, but the measured r32 below its bytes beats it
    uni = [row(rank=16, delta=40.0, bytes_per_token=100), row(rank=32, delta=1.0, bytes_per_token=200),
           row(rank=48, delta=0.2, bytes_per_token=300)]
    energy = row(rank=44, delta=3.0, energy=0.98, bytes_per_token=250)
    assert not F.claim_energy_ranks(uni + [energy])["held"]
    better = row(rank=44, delta=0.5, energy=0.98, bytes_per_token=250)
    assert F.claim_energy_ranks(uni + [better])["held"]
    # an energy run cheaper than every uniform run is not judged
    assert F.claim_energy_ranks(uni + [row(rank=4, delta=0.1, energy=0.9, bytes_per_token=50)]) is None


def test_gamma_claim_reads_every_rank():
    def g(rank, gamma, delta):
        return row(rank=rank, delta=delta, gamma=gamma, compression=2.0, bytes_per_token=100, full_bytes_per_token=200)

    rows = [g(16, "unit", 5.0), g(16, "paper", 5.5), g(32, "unit", 1.0), g(32, "paper", 9.0)]
    ppl = dict(d=64, runs=rows, baseline=dict(ppl=10.0), context=1024)
    calib = dict(energy_at_rank={})
    gamma = next(c for c in F.claims(ppl, None, calib, None) if c["source"] == "seed 001 §4" and "default" in c["claim"])
    assert not gamma["held"] and "r=32" in gamma["numbers"]


def test_every_falsifier_and_revised_claim_has_one_rule_with_its_history():
    assert set(R.FALSIFIERS) == {"001-1", "001-2", "001-3", "001-4", "003-1", "003-2", "003-3"}
    for rule in list(R.FALSIFIERS.values()) + list(R.CLAIMS.values()):
        assert rule.text and (rule.history() == "no") == (not rule.revisions)
    assert R.FALSIFIERS["001-3"].revised_after_numbers and not R.FALSIFIERS["001-1"].revised_after_numbers
    assert "fixed before looking" not in (F.__doc__ or "")


def test_falsifier_4_probes_several_queries_per_state():
    pos = F.query_positions(1024, 4)
    assert pos[0] == 1023 and len(pos) == 4 and min(pos) >= 512
    assert F.query_positions(24, 1) == [23]
    assert np.all(np.diff(pos) < 0)


def test_rope_verdict_reads_every_layer_and_the_perplexity_runs():
    def spectra(layers):
        return dict(layers=[dict(keys=dict(post=dict(ranks={"0.95": post}), pre=dict(ranks={"0.95": pre}))) for post, pre in layers])

    low = ([20, 20], [20, 20])
    assert F.verdict_rope(spectra([low, low]), d=64)["verdict"] == "supported"
    # a later layer whose keys need r near d under RoPE only: the heads of every layer are counted
    assert F.verdict_rope(spectra([low, ([60, 60], [20, 20]), ([60, 60], [20, 20])]), d=64)["verdict"] == "refuted"
    # and the perplexity runs: the post-RoPE basis needs r = 48 for 1%, the pre-RoPE basis 16
    rows = [row(rank=16, delta=5.0), row(rank=48, delta=0.8), row("static-pre", rank=16, delta=0.9)]
    assert F.verdict_rope(spectra([low, low]), d=64, rows=rows)["verdict"] == "refuted"
