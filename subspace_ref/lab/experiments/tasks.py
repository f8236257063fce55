"""``tasks``: accuracy tasks on the shipped model under every KV cache (issue 12).

* long-range recall (:mod:`subspace_ref.lab.tasks.needle`) by context length x needle depth, with a
  no-needle control per cell;
* next-token top-1 accuracy by position bucket and a LAMBADA-style last-identifier task
  (:mod:`subspace_ref.lab.tasks.next_token`) on held-out windows.

Methods: the full cache; this project's static (calibrated bases), adaptive (calibrated τ) and rotating
states at r = d/4 and d/2; and every entry of :func:`subspace_ref.lab.baselines.methods_at` at 50%,
25% and 12.5% of the full fp16 cache **of each instance's length** (byte accounting of
:mod:`subspace_ref.byte_convention`; static bases from the ``calibrate`` helpers as in
``subspace-kv baselines``). Every score comes from one teacher-forced pass, which equals greedy
token-by-token decoding for each cache. Task instances are saved in ``OUT/tasks_instances.json``;
results in ``OUT/tasks.json``; figures ``OUT/figures/tasks_*.png``; ``DOCS/tasks.md`` is
generated from the JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

from subspace_ref.lab.experiments import _common as C
from subspace_ref.lab.experiments.baselines import RANK_GRID, bases_for
from subspace_ref.lab.experiments.page import Page, model_scope, table

DEFAULT_OUT = Path("results/tasks")
LENGTHS, DEPTHS = (256, 512, 1000), (0.1, 0.5, 0.9)
TASK_SEED = 12
BUDGETS = (0.5, 0.25, 0.125)
OWN_FRACTIONS = (1 / 4, 1 / 2)
#: budgets of issue 16's frontier configurations (docs/baselines.md "Issue 16: the goal at matched bytes")
FRONTIER_BUDGETS = (0.25, 0.125)
#: which of :func:`~subspace_ref.lab.experiments.baselines.frontier_methods` are the frontier rows: the
#: allocator at the budget, with 4 sinks + an exact window, and at the quantisation row's bytes
#: (the best subspace rows of docs/baselines.md against eviction, H2O and quantisation)
FRONTIER_KEYS = ("allocator", "allocator + sinks + window", "allocator, exact tokens chosen", "allocator @ quant bytes + sinks + window")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_common_arguments(parser, default_profile="quick")
    parser.set_defaults(out=DEFAULT_OUT, threads=2)
    parser.add_argument("--needles", type=int, default=8, help="instances per (length, depth) cell (default 8; --quick 2)")
    parser.add_argument("--windows", type=int, default=8, help="held-out windows for next-token / LAMBADA (default 8; --quick 1)")
    parser.add_argument("--seed", type=int, default=TASK_SEED, help=f"task seed (default {TASK_SEED})")
    parser.add_argument("--batch", type=int, default=8, help="sequences per forward pass")
    parser.add_argument("--quick", action="store_true", help="tests: short instances, 2 budgets' worth of methods")
    parser.add_argument("--docs", type=Path, default=C.DEFAULT_DOCS, help="where tasks.md and its figures go (default docs)")
    parser.add_argument("--no-docs", action="store_true", help="do not write the docs page")
    parser.add_argument("--page-only", action="store_true", help="rewrite DOCS/tasks.md and its figures from OUT/tasks.json (no model runs)")


# ----------------------------------------------------------------------------- methods
def frontier_at(geom, fraction: float, cal: dict) -> list:
    """The :data:`FRONTIER_KEYS` configurations at ``fraction`` of ``geom`` (its context: the
    instance length; the exact window is context/32 tokens as in ``subspace-kv baselines``)."""
    from subspace_ref.lab.experiments.baselines import frontier_methods

    ms = [m for m in frontier_methods(geom, fraction, cal) if m.name.startswith("allocator") and "pre-RoPE rank <=" not in m.name]
    chosen = [m for m in ms if "chosen" in m.name]
    plain = [m for m in ms if "sinks" not in m.name]
    window = [m for m in ms if "sinks" in m.name and "@" not in m.name and "chosen" not in m.name]
    at = [m for m in ms if "@" in m.name]
    if len(plain) != 1 or len(window) != 1 or len(chosen) != 1 or len(at) > 1:
        raise ValueError(f"fraction: expected one allocator row of each kind at {fraction}, got {[m.name for m in ms]}")
    return plain + window + chosen + at


def method_plan(model, lengths, budgets=BUDGETS, own=True, frontier=None) -> list[dict]:
    """One entry per method: ``key``, ``family``, ``budget`` and ``at`` (length -> method object, or
    a tuple for own states). Baselines come from :func:`subspace_ref.lab.baselines.methods_at` at the
    geometry of each length (the same byte accounting as ``subspace-kv baselines``). ``frontier``:
    :func:`~subspace_ref.hf.calibration_losses` output; then the frontier
    configurations of issue 16 (:func:`frontier_at`) are added at the budgets of
    :data:`FRONTIER_BUDGETS`, allocated for each length's geometry."""
    from subspace_ref.lab.baselines import methods_at
    from subspace_ref.byte_convention import Geometry

    plan = [dict(key="full cache", family="full", budget=None, at={L: None for L in lengths})]
    if own:
        d = Geometry.of_model(model, max(lengths)).head_dim
        for r in C.ranks_from(OWN_FRACTIONS, d):
            for kind in ("static", "adaptive", "rotating"):
                plan.append(dict(key=f"{kind} r{r}", family=f"own {kind}", budget=None, at={L: (kind, r) for L in lengths}))
    for f in budgets:
        per_len = {L: methods_at(Geometry.of_model(model, L), f) for L in lengths}
        for i, m in enumerate(per_len[lengths[0]]):
            plan.append(dict(key=f"{100 * f:g}% {m.family}", family=m.family, budget=f, at={L: per_len[L][i] for L in lengths}))
        if frontier is not None and f in FRONTIER_BUDGETS:
            per_len = {L: frontier_at(Geometry.of_model(model, L), f, frontier) for L in lengths}
            for i, key in enumerate(FRONTIER_KEYS[: len(per_len[lengths[0]])]):
                plan.append(dict(key=f"{100 * f:g}% {key}", family="subspace (issue 16)", budget=f, at={L: per_len[L][i] for L in lengths}))
    return plan


def logits_of(model, ids: np.ndarray, m, svd, own_options: dict):
    """Logits (B, T, V) of ``ids`` under method ``m`` (None: stock)."""
    import torch

    from subspace_ref.lab.baselines import Subspace, SubspaceWindow, applied
    from subspace_ref.hf import adaptive_states, allocated_states, rotating_states, static_states, teacher_forced

    x = torch.as_tensor(np.asarray(ids), dtype=torch.long)
    with torch.no_grad():
        if m is None:
            return model(input_ids=x).logits
        if isinstance(m, tuple):
            kind, r = m
            if kind == "static":
                fac, be = static_states(bases_for(svd, r, r)), "torch"
            elif kind == "adaptive":
                tk, tv = own_options["tau"][str(r)]["tau_k"], own_options["tau"][str(r)]["tau_v"]
                fac = adaptive_states(rank_k=r, rank_v=r, tau_k=lambda li: tk[li], tau_v=lambda li: tv[li],
                                      max_chunk=own_options["max_chunk"], sketch_reset=True)
                be = "torch"
            else:
                fac, be = rotating_states(rank_k=r, rank_v=r, refresh_every=own_options["refresh_every"]), "torch"
            return teacher_forced(model, x, fac, backend=be, keep_logits=True).logits
        if isinstance(m, Subspace):
            return teacher_forced(model, x, m.factory(bases_for(svd, m.rank_k, m.rank_v)), backend=m.backend, keep_logits=True).logits
        if hasattr(m, "allocation"):  # issue 16's configurations, decoded by a SubspaceCache of their layer states
            cal = own_options["frontier"]
            factory = allocated_states(cal.bases(m.allocation), m.allocation, rope=cal.rope)
            return teacher_forced(model, x, factory, backend="torch", keep_logits=True).logits
        if isinstance(m, SubspaceWindow):
            m = m.with_bases(bases_for(svd, m.rank_k, m.rank_v))
        with applied(model, m):
            return model(input_ids=x).logits


def method_bytes(m, L: int, model) -> dict | None:
    from subspace_ref.byte_convention import Geometry

    if m is None or isinstance(m, tuple):
        return None
    b = m.bytes(Geometry.of_model(model, L))
    out = dict(name=m.name, bytes_per_token=b.per_token, fraction_of_full=b.fraction)
    if hasattr(m, "allocation"):
        out["allocation"] = m.allocation.to_dict()
    return out


# ----------------------------------------------------------------------------- the run
def build_instances(ctx, lengths, depths, n_needles, n_windows, seed) -> dict:
    from subspace_ref.lab.tasks import lambada_targets, make_needles

    needles = make_needles(C.stream("heldout"), lengths, depths, n_needles, seed)
    wins = C.windows("heldout", n_windows, ctx.context, seed)
    targets = lambada_targets(wins, seed=seed)
    return dict(seed=seed, lengths=list(lengths), depths=list(depths), needles=[x.as_dict() for x in needles],
                windows=wins.tolist(), lambada=[list(map(int, t)) for t in targets])


def instances_hash(inst: dict) -> str:
    return hashlib.sha256(json.dumps(inst, sort_keys=True).encode()).hexdigest()[:16]


def evaluate(ctx, inst: dict, plan: list[dict], svd, batch: int, tau: dict, frontier=None) -> list[dict]:
    from subspace_ref.lab.experiments.statistics import bootstrap_ci
    from subspace_ref.lab.tasks import score_answer
    from subspace_ref.lab.tasks.next_token import lambada_correct, next_token_correct

    model, p = ctx.model, ctx.profile
    own_options = dict(max_chunk=p.max_chunk, refresh_every=p.refresh_every, tau=tau, frontier=frontier)
    wins = np.asarray(inst["windows"])
    Lw = wins.shape[1]
    edges = C.position_edges(Lw)
    targets = [tuple(t) for t in inst["lambada"]]
    rows = []
    bar = ctx.bar(total=len(plan), desc="tasks")
    for entry in plan:
        t0 = time.perf_counter()
        cells = []
        for L in inst["lengths"]:
            for depth in inst["depths"]:
                for with_needle in (True, False):
                    if not with_needle and entry["budget"] is not None or not with_needle and entry["family"] != "full":
                        continue
                    xs = [x for x in inst["needles"] if x["length"] == L and x["depth"] == depth and x["needle"] == with_needle]
                    ok = []
                    for i in range(0, len(xs), batch):
                        ids = np.array([x["ids"] for x in xs[i : i + batch]])
                        ok.append(score_answer(logits_of(model, ids, entry["at"][L], svd, own_options), ids, xs[0]["answer_len"]))
                    ok = np.concatenate(ok)
                    lo, hi = bootstrap_ci(ok, seed=0)
                    cells.append(dict(length=L, depth=depth, needle=with_needle, n=int(ok.size), accuracy=float(ok.mean()), ci=[lo, hi],
                                      correct=ok.astype(int).tolist()))
        m_w = entry["at"].get(Lw, None) if Lw in entry["at"] else None
        nt, lam = [], []
        for i in range(0, len(wins), batch):
            lg = logits_of(model, wins[i : i + batch], m_w, svd, own_options)
            nt.append(next_token_correct(lg, wins[i : i + batch]))
            tg = [(w - i, s, n) for w, s, n in targets if i <= w < i + batch]
            lam.append(lambada_correct(lg, wins[i : i + batch], tg))
        nt = np.concatenate(nt, axis=0)
        lam = np.concatenate(lam) if lam else np.zeros(0, bool)
        grp = np.repeat(np.arange(nt.shape[0])[:, None], nt.shape[1], axis=1)
        ctx_len = np.arange(1, nt.shape[1] + 1)
        by_pos = {}
        for a, b in zip(edges[:-1], edges[1:]):
            sel = (ctx_len >= a) & (ctx_len < b)
            if sel.any():
                lo, hi = bootstrap_ci(nt[:, sel], groups=grp[:, sel])
                by_pos[C.bucket_label(a, b)] = dict(accuracy=float(nt[:, sel].mean()), ci=[lo, hi])
        lam_groups = np.array([w for w, _, _ in targets])
        lam_pos = np.array([s for _, s, _ in targets])
        lam_by = {}
        for a, b in zip(edges[:-1], edges[1:]):
            sel = (lam_pos >= a) & (lam_pos < b)
            if sel.any():
                lam_by[C.bucket_label(a, b)] = dict(n=int(sel.sum()), accuracy=float(lam[sel].mean()), ci=list(bootstrap_ci(lam[sel], groups=lam_groups[sel])))
        row = dict(key=entry["key"], family=entry["family"], budget=entry["budget"],
                   bytes={str(L): method_bytes(entry["at"][L], L, model) for L in entry["at"]},
                   needle=cells,
                   next_token=dict(accuracy=float(nt.mean()), ci=list(bootstrap_ci(nt, groups=grp)), by_position=by_pos,
                                   correct_per_window=nt.sum(axis=1).astype(int).tolist(), tokens_per_window=int(nt.shape[1])),
                   lambada=dict(n=int(lam.size), accuracy=float(lam.mean()) if lam.size else float("nan"),
                                ci=list(bootstrap_ci(lam, groups=lam_groups)), by_position=lam_by, correct=lam.astype(int).tolist(),
                                windows=lam_groups.astype(int).tolist()),
                   seconds=round(time.perf_counter() - t0, 2))
        rows.append(row)
        bar.update()
    bar.close()
    return rows


def run_suite(ctx, n_needles, n_windows, seed, batch, lengths=LENGTHS, depths=DEPTHS, budgets=BUDGETS) -> tuple[dict, dict]:
    from subspace_ref.lab.experiments.calibrate import measure_tau
    from subspace_ref.hf.calibration_losses import capture_windows, layer_svd

    lengths = tuple(min(L, ctx.context) for L in lengths)
    inst = build_instances(ctx, lengths, depths, n_needles, n_windows, seed)
    cal = capture_windows(ctx.model, ctx.calib_windows(), queries=False, batch=batch)
    svd = layer_svd(cal)
    del cal
    # seed 001 §10: tau at the 95th percentile of held-out calibration residuals, per rank and layer
    hold_ids = ctx.holdout_windows()
    hold = capture_windows(ctx.model, hold_ids, queries=False, batch=batch)
    tau = measure_tau(hold, len(hold_ids), C.ranks_from(OWN_FRACTIONS, ctx.d), ctx.profile.max_chunk, "torch")
    del hold
    lens = tuple(sorted(set(lengths) | {ctx.context}))
    frontier = None
    if any(f in FRONTIER_BUDGETS for f in budgets):
        from subspace_ref.hf.calibration_losses import calibration_losses

        # the calibration of `subspace-kv baselines` (its default profile's windows), so the
        # frontier rows use the bases and allocations of docs/baselines.md
        frontier = calibration_losses(ctx.model, C.windows("train", C.PROFILES["full"].calib_windows, ctx.context, C.SEED_BASES), batch=batch, ranks=RANK_GRID)
    plan = method_plan(ctx.model, lens, budgets, frontier=frontier)
    rows = evaluate(ctx, inst, plan, svd, batch, tau["by_rank"], frontier)
    record = dict(meta=C.meta(ctx, "tasks", task_seed=seed, instances_sha256=instances_hash(inst), needles_per_cell=n_needles,
                              windows=n_windows, lambada_targets=len(inst["lambada"]), budgets=list(budgets),
                              own_ranks=C.ranks_from(OWN_FRACTIONS, ctx.d),
                              adaptive_tau={r: dict(tau_k=e["tau_k"], tau_v=e["tau_v"]) for r, e in tau["by_rank"].items()}),
                  lengths=list(lengths), depths=list(depths), window_length=ctx.context, rows=rows)
    return record, inst


# ----------------------------------------------------------------------------- figures
def figures(record: dict, folder: Path) -> list[Path]:
    plt = C.pyplot()
    rows = record["rows"]
    Ls, Ds = record["lengths"], record["depths"]
    cells = [(L, d) for L in Ls for d in Ds]
    M = np.array([[next(c["accuracy"] for c in r["needle"] if c["length"] == L and c["depth"] == d and c["needle"]) for L, d in cells]
                  for r in rows])
    fig, ax = plt.subplots(figsize=(1.0 + 0.75 * len(cells), 1.2 + 0.3 * len(rows)))
    im = ax.imshow(M, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    for i in range(M.shape[0]):
        for j in range(M.shape[1]):
            ax.text(j, i, f"{M[i, j]:.2f}", ha="center", va="center", fontsize=8, color="w" if M[i, j] < 0.5 else "k")
    ax.set_xticks(range(len(cells)), [f"{L} B\n{d:.0%}" for L, d in cells])
    ax.set_yticks(range(len(rows)), [r["key"] for r in rows])
    ax.set_xlabel("context length (bytes) and needle depth")
    fig.colorbar(im, ax=ax, label="recall (share of instances)", fraction=0.04, pad=0.02)
    ax.set_title("Recall by method, context length and needle depth")
    fig.tight_layout()
    p1 = C.save_figure(fig, folder / "tasks_needle_heatmaps.png")

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    labels = list(rows[0]["next_token"]["by_position"])
    x = np.arange(len(labels))
    for r in rows:
        style = "k-" if r["family"] == "full" else ("--" if r["budget"] is None else "-")
        lw = 1.6 if r["family"] == "full" else 0.7
        axes[0].plot(x, [r["next_token"]["by_position"][k]["accuracy"] for k in labels], style, lw=lw, label=r["key"])
        lab = [k for k in labels if k in r["lambada"]["by_position"]]
        axes[1].plot([labels.index(k) for k in lab], [r["lambada"]["by_position"][k]["accuracy"] for k in lab], style, lw=lw)
    for ax, t in zip(axes, ("next-token top-1 accuracy", "LAMBADA-style last identifier accuracy")):
        ax.set_xticks(x)
        ax.set_xticklabels(labels)
        ax.set_xlabel("position (context length, bytes)")
        ax.set_title(t)
    fig.tight_layout()
    C.legend_right(fig, axes[0])
    p2 = C.save_figure(fig, folder / "tasks_by_position.png")
    return [p1, p2]


# ----------------------------------------------------------------------------- the page
def recall_validity(full_row: dict, lengths) -> dict:
    """Per length: the full cache's recall with and without the needle and the paired bootstrap
    interval of their difference (same haystacks and queries); the task is *valid* at a length
    when that interval lies above 0, i.e. the needle measurably helps."""
    from subspace_ref.lab.experiments.statistics import bootstrap_ci

    out = {}
    for L in lengths:
        withn = [c for c in full_row["needle"] if c["length"] == L and c["needle"]]
        ctrl = {c["depth"]: c for c in full_row["needle"] if c["length"] == L and not c["needle"]}
        a = np.concatenate([c["correct"] for c in withn])
        b = np.concatenate([ctrl[c["depth"]]["correct"] for c in withn])
        lo, hi = bootstrap_ci(a - b)
        out[L] = dict(needle=float(a.mean()), control=float(b.mean()), difference=float((a - b).mean()), ci=[lo, hi], valid=bool(lo > 0))
    return out


def recall_at(row: dict, lengths) -> dict:
    """Recall of ``row`` pooled over the needle instances of ``lengths`` only (the valid ones: a
    length where the needle does not help measures no retrieval), instances resampled."""
    from subspace_ref.lab.experiments.statistics import bootstrap_ci

    ok = [np.asarray(c["correct"], dtype=float) for c in row["needle"] if c["needle"] and c["length"] in lengths]
    if not ok:
        return dict(accuracy=float("nan"), ci=[float("nan"), float("nan")], n=0)
    x = np.concatenate(ok)
    return dict(accuracy=float(x.mean()), ci=list(bootstrap_ci(x)), n=int(x.size))


def paired_difference(a: dict, b: dict, valid_lengths) -> dict | None:
    """Row ``a`` minus row ``b`` on the same task instances, per task, with paired 95% bootstrap
    intervals over the independent unit: a needle instance (recall, valid lengths only), a
    window (next-token: per-window accuracy, windows of one length), a window's LAMBADA targets
    (resampled whole). None when the rows carry no per-unit results (a record from before they
    were saved)."""
    from subspace_ref.lab.experiments.statistics import bootstrap_ci

    if "correct_per_window" not in a["next_token"] or "correct_per_window" not in b["next_token"]:
        return None

    def needles(r):
        return np.concatenate([np.asarray(c["correct"], float) for c in r["needle"] if c["needle"] and c["length"] in valid_lengths] or [np.zeros(0)])

    out = {}
    x = needles(a) - needles(b)
    out["recall"] = dict(difference=float(x.mean()) if x.size else float("nan"), ci=list(bootstrap_ci(x)))
    n = a["next_token"]["tokens_per_window"]
    x = (np.asarray(a["next_token"]["correct_per_window"]) - np.asarray(b["next_token"]["correct_per_window"])) / n
    out["next_token"] = dict(difference=float(x.mean()), ci=list(bootstrap_ci(x)))
    x = np.asarray(a["lambada"]["correct"], float) - np.asarray(b["lambada"]["correct"], float)
    out["lambada"] = dict(difference=float(x.mean()) if x.size else float("nan"), ci=list(bootstrap_ci(x, groups=a["lambada"]["windows"])))
    return out


def _diff(v: dict) -> str:
    lo, hi = v["ci"]
    word = "ties" if lo <= 0 <= hi else ("higher" if lo > 0 else "lower")
    return f"{v['difference']:+.3f} [{lo:+.3f}, {hi:+.3f}] ({word})"


def frontier_section(record: dict, valid) -> list[str]:
    """Issue 16 acceptance: the frontier rows against the quantisation row of their budget."""
    rows = record["rows"]
    Lw = str(record["window_length"])
    out, body, words = [], [], []
    for f in record["meta"]["budgets"]:
        quant = next((r for r in rows if r["budget"] == f and r["family"] == "quantized KV"), None)
        front = [r for r in rows if r["budget"] == f and r["family"] == "subspace (issue 16)"]
        if quant is None or not front:
            continue
        qb = quant["bytes"][Lw]
        for r in front:
            d = paired_difference(r, quant, valid)
            if d is None:
                return []
            b = r["bytes"][Lw]
            body.append([f"{100 * f:g}%", f"{b['name']} ({b['bytes_per_token']:.0f})", f"{qb['name']} ({qb['bytes_per_token']:.0f})",
                         _diff(d["recall"]), _diff(d["next_token"]), _diff(d["lambada"])])
            if "@" in b["name"]:
                words.append((f, b, qb, d))
    if not body:
        return []
    heads = [h for r in rows if r["family"] == "subspace (issue 16)" for e in r["bytes"].values() if e and e.get("allocation")
             for layer in e["allocation"]["heads"] for h in layer]
    kinds = {k: sum(h["key_basis"] == k for h in heads) for k in ("pre_rope", "post_rope", "plane")}
    out += ["## Issue 16: frontier configurations against quantisation at matched bytes", "",
            "The frontier configurations are the best subspace rows of `docs/baselines.md` at 25% and 12.5% of the fp16 bytes "
            "(section \"Issue 16: the goal at matched bytes\"): the byte-budget allocator (`subspace_ref/allocation.py`: per layer "
            "and KV head the key basis kind, r_k, r_v and the bits of each side) at the budget, with 4 sinks + an exact window of "
            "L/32 tokens, and the same at exactly the bytes of the quantisation row of the budget (`@ N bytes`). They are "
            "calibrated and allocated as `subspace-kv baselines` does (8 calibration windows of the training split, seed 1), for "
            "each instance's length L, and decoded by a `SubspaceCache` of their layer states (`subspace_ref.hf.allocated_states`, teacher-forced). "
            f"Key basis kinds chosen over all their heads and lengths: {kinds['pre_rope']} pre-RoPE, {kinds['post_rope']} post-RoPE, "
            f"{kinds['plane']} RoPE-plane (spec/rope.md P4)"
            + (": the plane kind, a candidate of every head, was never the cheapest for its measured loss, so it changes no "
               "configuration here." if kinds["plane"] == 0 else "."), "",
            "Differences are frontier minus quantisation on the same instances (paired): recall over the needle instances of the "
            "valid lengths, next-token top-1 per window, LAMBADA-style per target with windows resampled; 95% bootstrap intervals "
            "(seed 0). 'higher / lower / ties': the interval lies above 0 / below 0 / contains 0. Bytes per token at "
            f"{Lw} tokens.", ""]
    out += table(["budget", "frontier row (bytes)", "quantisation row (bytes)", "Δ recall", "Δ next-token top-1", "Δ LAMBADA-style"], body, "llllll")
    out.append("")  # a list right after a table would be read as more table rows
    for f, b, qb, d in words:
        parts = [f"{name} {v['difference']:+.3f} [{v['ci'][0]:+.3f}, {v['ci'][1]:+.3f}]" for name, v in
                 (("recall", d["recall"]), ("next-token", d["next_token"]), ("LAMBADA", d["lambada"]))]
        res = [("ties" if v["ci"][0] <= 0 <= v["ci"][1] else ("wins" if v["ci"][0] > 0 else "loses")) for v in (d["recall"], d["next_token"], d["lambada"])]
        verdict = ("loses measurably on " + ", ".join(n for n, w in zip(("recall", "next-token", "LAMBADA"), res) if w == "loses")) if "loses" in res else \
                  ("wins measurably on " + ", ".join(n for n, w in zip(("recall", "next-token", "LAMBADA"), res) if w == "wins") if "wins" in res else "is not resolved from it on any task")
        out.append(f"* **{100 * f:g}%, same bytes**: *{b['name']}* ({b['bytes_per_token']:.0f} bytes/token) against *{qb['name']}* "
                   f"({qb['bytes_per_token']:.0f}): {'; '.join(parts)}; it {verdict}.")
    out.append("")
    return out


def _ci(v: dict) -> str:
    lo, hi = v["ci"]
    return f"{v['accuracy']:.3f} [{lo:.3f}, {hi:.3f}]"


def write_page(record: dict, command: str, docs: Path, figures_from: Path) -> Path:
    """``DOCS/tasks.md`` and its figures, from the ``tasks.json`` record alone."""
    meta, rows = record["meta"], record["rows"]
    full = rows[0]
    page = Page(Path(docs) / "tasks.md", figures_from)
    page.add("# Accuracy tasks under compressed KV caches", "",
             f"_Generated by `{command}` in {meta['runtime_s']:.0f} s ({meta['environment'].get('cpu_count')} CPUs, "
             f"{meta['settings'].get('threads', '')}); do not edit by hand: rerun the command "
             "(`subspace-kv tasks --page-only` rewrites this page from the saved `tasks.json`)._", "",
             f"Model: {meta['model'].get('description')}. Task seed {meta['task_seed']}; instances (sha256 prefix "
             f"`{meta['instances_sha256']}`) are saved in `tasks_instances.json` in the output folder, so two runs compare exactly. "
             "All intervals are 95% percentile bootstrap intervals (seed 0) that resample the independent unit: a needle "
             "instance for recall, a whole window for next-token and LAMBADA (`subspace_ref/lab/experiments/statistics.py`).", "",
             "Terms: a *window* is one held-out text sequence that is scored; *sliding window* is the name of a baseline "
             "that keeps only the most recent tokens (`docs/baselines.md`).", "",
             "## Tasks", "",
             f"* **Recall (needle in a haystack)**: held-out code of {', '.join(map(str, record['lengths']))} bytes; at "
             f"{', '.join(f'{d:.0%}' for d in record['depths'])} of the way in, a distinct held-out line of 50-80 bytes; the context "
             "ends with that line's first 32 bytes and the answer is its next 6 bytes (greedy exact match). "
             f"{meta['needles_per_cell']} instances per cell, plus a *control* (same haystack and query, no needle) scored under the full cache.",
             f"* **Next-token top-1** on {meta['windows']} held-out windows of {record['window_length']} bytes, by position.",
             f"* **LAMBADA-style**: {meta['lambada_targets']} targets: the last identifier (>= 3 bytes) of a line that already occurred "
             "earlier in the window; every byte must be the greedy prediction.", "",
             "Methods: the full cache; static (calibrated bases, γ = 1), adaptive (τ per layer at the 95th percentile of held-out "
             "calibration residuals, seed 001 §10; sketches reset at chunk boundaries) and "
             f"rotating states at r = {', '.join(map(str, meta['own_ranks']))} (no byte budget: ranks shown); every baseline of "
             "`subspace_ref.lab.baselines.methods_at` at 50/25/12.5% of the full fp16 cache, configured for the length of each "
             "instance (a sliding window of capacity f·L for an L-byte instance), bytes counted by `subspace_ref/byte_convention.py`; "
             "and at 25% and 12.5% the frontier configurations of issue 16 (the byte-budget allocator, section below).", "",
             "## Validity of the recall task", "")
    validity = recall_validity(full, record["lengths"])
    valid = [L for L, v in validity.items() if v["valid"]]
    page.add("The task is valid at a length when the full cache recalls measurably more with the needle than without it: the "
             "paired bootstrap interval of (with needle − control) over the same haystacks lies above 0. "
             + (f"**Valid at {', '.join(map(str, valid))} bytes**" if valid else "**Valid at no length**")
             + (f"; at {', '.join(str(x) for x in validity if x not in valid)} bytes the needle does not measurably help, so recall "
                "there is no retrieval test and the summary leaves it out." if len(valid) < len(validity) else ".")
             + " (The shipped model learned to copy from a fine-tune with copied spans and repeated halves: "
             "`subspace_ref/lab/train_default_model.py`; trained on code alone it scored no better than the control at any length.)", "")
    page.table(["length", "with needle", "control", "difference [95% CI]", "valid"],
               [[Lx, f"{v['needle']:.3f}", f"{v['control']:.3f}", f"{v['difference']:+.3f} [{v['ci'][0]:+.3f}, {v['ci'][1]:+.3f}]",
                 "yes" if v["valid"] else "no"] for Lx, v in validity.items()], "rllll")
    ctrl = {(c["length"], c["depth"]): c for c in full["needle"] if not c["needle"]}
    page.table(["length", "depth", "with needle", "control (no needle)"],
               [[c["length"], f"{c['depth']:.0%}", _ci(c), _ci(ctrl[c["length"], c["depth"]])] for c in full["needle"] if c["needle"]], "rrll")
    page.add("## Summary", "",
             f"Recall pools the needle instances of the valid lengths only ({', '.join(map(str, valid)) or 'none'} bytes: "
             f"{len(valid) * len(record['depths']) * meta['needles_per_cell']} instances per method); its interval resamples instances, "
             "next-token and LAMBADA intervals resample whole windows.", "")
    body = []
    for r in rows:
        b = r["bytes"].get(str(record["window_length"]))
        bb = f"{100 * b['fraction_of_full']:.1f}% ({b['name']})" if b else ("100%" if r["family"] == "full" else "rank " + r["key"].split()[-1])
        body.append([r["key"], bb, _ci(recall_at(r, valid)), _ci(r["next_token"]), _ci(r["lambada"]), f"{r['seconds']:.0f}"])
    page.table(["method", f"bytes (% of full, at {record['window_length']})", "recall (valid lengths)", "next-token top-1", "LAMBADA-style", "s"],
               body, "lrlllr")
    for line in frontier_section(record, valid):
        page.add(line)
    labels = list(full["next_token"]["by_position"])
    page.add("## Next-token top-1 accuracy by position", "")
    page.table(["method"] + labels, [[r["key"]] + [_ci(r["next_token"]["by_position"][k]) for k in labels] for r in rows])
    lam = [k for k in labels if k in full["lambada"]["by_position"]]
    page.add("## LAMBADA-style accuracy by position", "")
    page.table(["method"] + [f"{k} (n={full['lambada']['by_position'][k]['n']})" for k in lam],
               [[r["key"]] + [_ci(r["lambada"]["by_position"][k]) if k in r["lambada"]["by_position"] else "–" for k in lam] for r in rows])
    page.figure("tasks_needle_heatmaps.png", "Recall by method (rows), context length and needle depth (columns).")
    page.figure("tasks_by_position.png", "Next-token and LAMBADA-style accuracy by position.")
    page.scope_and_limits(model_scope(meta["model"]) + [
        f"Sample sizes: {meta['needles_per_cell']} needle instances per (length, depth) cell, so a recall difference of a cell is "
        "resolved only to about ±0.3; the summary pools the cells of the valid lengths. "
        f"{meta['windows']} windows for next-token and LAMBADA; {meta['lambada_targets']} LAMBADA-style targets in all.",
        "Recall is valid only where the full cache beats its no-needle control (table above); elsewhere the model does not "
        "retrieve, and no cache can be judged on retrieval there.",
        "Byte budgets are fractions of each instance's own full fp16 cache; this project's own states are shown by rank, "
        "without a budget (`docs/experiments.md` has their bytes).",
    ])
    page.add("Outputs: `tasks.json`, `tasks_instances.json` in the output folder.")
    return page.write()


def page_only(args: argparse.Namespace) -> int:
    """Rewrite the page and its figures from ``OUT/tasks.json`` without rerunning the tasks."""
    record = C.read_json(Path(args.out) / "tasks.json")
    if record is None:
        print(f"tasks --page-only: no {Path(args.out) / 'tasks.json'}; run `subspace-kv tasks` first", file=sys.stderr)
        return 2
    figures(record, Path(args.out) / "figures")
    path = write_page(record, record["meta"].get("command", "subspace-kv tasks"), Path(args.docs), Path(args.out) / "figures")
    print(f"tasks: page {path} from {Path(args.out) / 'tasks.json'}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.page_only:
        return page_only(args)
    lengths, depths, budgets = LENGTHS, DEPTHS, BUDGETS
    if args.quick:
        args.profile = "tiny"
        args.context = args.context or 256
        lengths, depths, budgets = (192, 256), (0.1, 0.9), (0.5,)
        args.needles = min(args.needles, 2)
        args.windows = min(args.windows, 1)
    ctx = C.make_context(args)
    record, inst = run_suite(ctx, args.needles, args.windows, args.seed, args.batch, lengths, depths, budgets)
    record["meta"]["runtime_s"] = round(time.perf_counter() - ctx.started, 2)
    record["meta"]["settings"]["threads"] = f"{args.threads} threads"
    record["meta"]["command"] = "subspace-kv tasks" + (" --quick" if args.quick else "") + ("" if args.model == "default" else f" --model {args.model}")
    C.write_json(ctx.out / "tasks.json", record)
    C.write_json(ctx.out / "tasks_instances.json", inst)
    figures(record, ctx.figures)
    if not args.no_docs:
        write_page(record, record["meta"]["command"], Path(args.docs), ctx.figures)
    print(f"tasks: {len(record['rows'])} methods, {record['meta']['runtime_s']:.0f} s -> {ctx.out / 'tasks.json'}")
    valid = [L for L, v in recall_validity(record["rows"][0], record["lengths"]).items() if v["valid"]]
    print(f"  recall pooled over the valid lengths {valid or 'none'} (the needle measurably helps the full cache)")
    for r in record["rows"]:
        print(f"  {r['key']:<28} recall {recall_at(r, valid)['accuracy']:.3f}  next-token {r['next_token']['accuracy']:.3f}  "
              f"lambada {r['lambada']['accuracy']:.3f}  {r['seconds']:.0f}s")
    return 0

