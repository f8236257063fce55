"""``variants``: the papers' variants and ablations (issue 11) against the plain methods.

Every row of every group in :mod:`subspace_ref.lab.experiments.variant_rows` is scored on the same
held-out windows as the plain static, adaptive and rotating states at the same rank
(:func:`~subspace_ref.lab.experiments.variant_rows.plain_rank`) and as the stock model. A row
records perplexity, its change from the stock model and from its plain method (95% interval
resampling whole held-out windows, paired: :mod:`~subspace_ref.lab.experiments.statistics`), KV bytes per token as the states hold them,
chunks per head, and a verdict:

* **pays off**: it costs at most 2% more bytes than its plain method and is significantly
  better, or it saves at least 10% of the bytes and is not significantly worse;
* **costs**: significantly worse at no byte saving, or more bytes for no significant gain;
* **no effect**: bytes within -10%..+2% of its plain method's and no significant difference;
* **trade-off**: anything else (e.g. fewer bytes and significantly worse): the table says how much.

Writes ``OUT/variants.json`` and ``OUT/variants.csv``; ``report`` turns them into the variants
section of docs/experiments.md.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math

import numpy as np

from subspace_ref.lab.experiments import _common as C
from subspace_ref.lab.experiments.calibrate import ensure_calibration
from subspace_ref.lab.experiments import statistics as S
from subspace_ref.lab.experiments.page import num, pct_ci, text_table
from subspace_ref.lab.experiments.ppl import score
from subspace_ref.lab.experiments.variant_rows import GROUPS, Variant, plain_rank, plain_rows

#: a variant "saves" bytes below this share of its plain method's, and "matches" them below the other
SAVING, MATCHED = 0.90, 1.02


def group_rows(ctx: C.Context, record: dict, svd: list[dict], groups=GROUPS) -> tuple[list[Variant], list[str]]:
    """The rows of each group whose module exists, and the groups that have none."""
    rows, missing = [], []
    for group in groups:
        name = f"subspace_ref.lab.experiments.variant_rows.{group}"
        if importlib.util.find_spec(name) is None:
            missing.append(group)
            continue
        rows += importlib.import_module(name).variants(ctx, record, svd)
    return rows, missing


def verdict(bytes_ratio: float | None, ci: tuple[float, float]) -> str:
    """Spec of the module docstring; ``ci`` is the interval of the perplexity change vs plain (%)."""
    if bytes_ratio is None:
        return "trade-off"
    better, worse = ci[1] < 0, ci[0] > 0
    if (bytes_ratio <= MATCHED and better) or (bytes_ratio <= SAVING and not worse):
        return "pays off"
    if (bytes_ratio > SAVING and worse) or (bytes_ratio > MATCHED and not better):
        return "costs"
    if bytes_ratio > SAVING and not (better or worse):
        return "no effect"
    return "trade-off"


def _score(ctx: C.Context, ids: np.ndarray, row: Variant) -> dict:
    if row.scorer is not None:
        return row.scorer(ctx.model, ids)
    return score(ctx.model, ids, row.factory, backend=row.backend, batch=ctx.profile.batch)


def summarize(name: str, group: str, plain: str, res: dict, base: dict, ref: dict | None, note: str = "", extra: dict | None = None) -> dict:
    nll = res["nll"].astype(np.float64)
    out = dict(name=name, group=group, plain=plain, ppl=math.exp(nll.mean()),
               delta_pct=C.percent(math.exp(nll.mean() - base["nll"].mean()) - 1.0),
               bytes_per_token=res["bytes_per_token"], full_bytes_per_token=res["full_bytes_per_token"],
               chunks_mean=res["chunks_mean"], chunks_max=res["chunks_max"], seconds=res["seconds"], note=note, extra=extra or {})
    if ref is not None:
        ref_nll = ref["nll"].astype(np.float64)
        lo, hi = S.relative_perplexity_interval(list(nll), list(ref_nll))  # whole windows resampled, paired
        out["vs_plain_pct"] = C.percent(math.exp(nll.mean() - ref_nll.mean()) - 1.0)
        out["vs_plain_pct_ci"] = [C.percent(lo), C.percent(hi)]
        ratio = None
        if res["bytes_per_token"] and ref["bytes_per_token"]:
            ratio = res["bytes_per_token"] / ref["bytes_per_token"]
        out["bytes_vs_plain"] = ratio
        out["verdict"] = verdict(ratio, tuple(out["vs_plain_pct_ci"]))
    return out


def variants_run(ctx: C.Context, groups=GROUPS) -> dict:
    record, svd = ensure_calibration(ctx)
    ids = ctx.eval_windows()
    base = score(ctx.model, ids, None, batch=ctx.profile.batch)
    rank = plain_rank(ctx, record)
    plain_res = {}
    for name, factory in ctx.bar(list(plain_rows(ctx, record, svd).items()), desc="plain rows"):
        plain_res[name] = score(ctx.model, ids, factory, batch=ctx.profile.batch)
    rows, missing = group_rows(ctx, record, svd, groups)
    out_rows = [summarize(f"{n} r{rank}", "plain", n, r, base, None) for n, r in plain_res.items()]
    bar = ctx.bar(rows, desc="variants")
    for row in bar:
        bar.set_postfix_str(row.name)
        res = _score(ctx, ids, row)
        out_rows.append(summarize(row.name, row.group, row.plain, res, base, plain_res[row.plain], row.note, row.extra))
    out = dict(meta=C.meta(ctx, "variants"), rank=rank, d=ctx.d, windows=int(ids.shape[0]), context=int(ids.shape[1]),
               stock_ppl=math.exp(float(base["nll"].mean())), groups_missing=missing,
               rule=dict(saving=SAVING, matched=MATCHED, bootstrap_unit="window", level=S.LEVEL), rows=out_rows)
    C.write_json(ctx.out / "variants.json", out)
    C.write_csv(ctx.out / "variants.csv", [{k: v for k, v in r.items() if k != "extra"} for r in out_rows])
    return out


def table(out: dict) -> str:
    body = [[r["name"], r["group"], f"{r['ppl']:.3f}", pct_ci(r["vs_plain_pct"], r["vs_plain_pct_ci"]) if r.get("vs_plain_pct_ci") else "–",
             num(r["bytes_per_token"], ".0f"), num(r.get("bytes_vs_plain"), ".3f"), num(r["chunks_mean"], ".1f"), r.get("verdict", "")]
            for r in out["rows"]]
    return text_table(["variant", "group", "ppl", "vs plain [95% interval]", "B/token", "bytes/plain", "chunks", "verdict"], body, "llrrrrrl")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_common_arguments(parser, default_profile="full")
    parser.add_argument("--groups", type=lambda s: tuple(s.split(",")), default=GROUPS, help=f"variant groups (default {','.join(GROUPS)})")


def run(args: argparse.Namespace) -> int:
    unknown = set(args.groups) - set(GROUPS)
    if unknown:
        raise SystemExit(f"--groups: unknown {sorted(unknown)}; expected some of {', '.join(GROUPS)}")
    ctx = C.make_context(args)
    out = variants_run(ctx, args.groups)
    print(table(out))
    if out["groups_missing"]:
        print(f"groups without rows: {', '.join(out['groups_missing'])}")
    return 0

