"""The variants runner (issue 11): verdict rule on made-up numbers, and an end-to-end run on the
tiny random Llama whose rows land in the report."""

from __future__ import annotations

import argparse

import pytest

from subspace_ref.hf_requirements import MIN_TRANSFORMERS

pytest.importorskip("torch")
pytest.importorskip("transformers", minversion=MIN_TRANSFORMERS)  # older: generate has no cache= (skipped, both versions named)

from subspace_ref.lab.experiments import variants as V  # noqa: E402
from subspace_ref.lab.experiments.variant_rows import Variant, plain_rank, static_bases  # noqa: E402

TINY = ["--model", "tiny-random", "--profile", "tiny", "--no-progress"]


@pytest.mark.parametrize(
    "ratio, ci, expected",
    [
        (1.00, (-3.0, -1.0), "pays off"),  # same bytes, significantly better
        (0.50, (-0.5, 0.8), "pays off"),  # half the bytes, no significant loss
        (0.50, (0.2, 0.9), "trade-off"),  # half the bytes, significantly worse
        (1.00, (0.2, 0.9), "costs"),  # same bytes, significantly worse
        (1.30, (-0.5, 0.5), "costs"),  # more bytes for nothing
        (1.30, (-2.0, -1.0), "trade-off"),  # more bytes, significantly better
        (1.00, (-0.5, 0.5), "no effect"),  # same bytes, no significant difference
        (0.95, (-0.5, 0.5), "no effect"),  # a 5% saving is below the 10% that counts
        (None, (-2.0, -1.0), "trade-off"),
    ],
)
def test_verdict_rule(ratio, ci, expected):
    assert V.verdict(ratio, ci) == expected


def test_tiny_run_scores_rows_against_their_plain_method(tmp_path, monkeypatch):
    p = argparse.ArgumentParser()
    V.add_arguments(p)
    args = p.parse_args([*TINY, "--out", str(tmp_path)])
    ctx = V.C.make_context(args)

    def one_row(ctx, record, svd):
        # a lower-rank static state: fewer bytes than the plain static row, so its bytes ratio is < 1
        r = max(1, plain_rank(ctx, record) // 2)
        from subspace_ref.hf import static_states

        return [Variant(name=f"static r{r}", group="rope", plain="static", factory=static_states(static_bases(record, svd, r)))]

    monkeypatch.setattr(V, "group_rows", lambda ctx, record, svd, groups: (one_row(ctx, record, svd), ["storage"]))
    out = V.variants_run(ctx)
    names = [r["name"] for r in out["rows"]]
    assert names[:3] == [f"{n} r{out['rank']}" for n in ("static", "adaptive", "rotating")]
    row = out["rows"][-1]
    assert row["bytes_vs_plain"] < 1.0 and row["verdict"] in ("pays off", "trade-off", "costs", "no effect")
    assert row["vs_plain_pct_ci"][0] <= row["vs_plain_pct"] <= row["vs_plain_pct_ci"][1]
    assert out["groups_missing"] == ["storage"]

    from subspace_ref.lab.experiments.report import write_report

    page = write_report(tmp_path, tmp_path / "docs").read_text()
    assert "## 8. Variants and ablations" in page and row["name"] in page and "Groups with no rows in this run: storage" in page
