"""``ppl``: perplexity on held-out text against rank, for every kind of compressed cache.

Held-out windows of the stdlib corpus (seed 0, the model's full context by default) are scored
teacher-forced through a :class:`~subspace_ref.hf.SubspaceCache` -- which equals token-by-token
decoding with that cache (spec/models.md M6) -- and against the stock model. Runs:

* static states (seed 001 §4/§10, seed 003 SubSpace-G) at uniform ranks r = r_v, with gamma
  1, sqrt(r/d) (seed 001's default gamma_B^0) and the held-out MSE fit; keys-only and
  values-only (the other side exact); INT8 coefficients (spec A10); per-head ranks by energy
  {90, 95, 98, 99}% against uniform ranks;
* adaptive states (seed 001 §5) at tau = the 95th percentile of the calibration residuals
  (``calibrate``), maximum chunk L, with and without ``sketch_reset`` (spec A7.1);
* rotating states (seed 003 SubSpace-A), refresh every m tokens.

Each run records perplexity, its change from the stock model with a 95% interval that resamples
whole windows (:mod:`~subspace_ref.lab.experiments.statistics`), perplexity by context-length bucket, chunks per head, and KV bytes per token: what the
states really hold (``state.nbytes`` summed over layers and windows, divided by the tokens)
beside the uncompressed K/V in the same dtype. Writes ``OUT/ppl.json``, ``OUT/ppl.csv``,
``OUT/ppl_tokens.npz`` (per-token NLL of every run, for paired tests) and three figures.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from subspace_ref.lab.experiments import _common as C
from subspace_ref.lab.experiments import statistics as S
from subspace_ref.lab.experiments.page import pct_ci, text_table
from subspace_ref.lab.experiments.calibrate import basis_from_svd, ensure_calibration, load_svd, static_basis


# ----------------------------------------------------------------------------- scoring
def score(model, ids: np.ndarray, factory=None, *, backend: str = "torch", batch: int = 4) -> dict:
    """Per-token NLL (n, T-1) of windows ``ids`` (n, T) with a fresh cache of ``factory`` per
    batch of windows (None: the stock model), the cache's bytes and chunk counts."""
    import torch

    from subspace_ref.hf import SubspaceCache, teacher_forced
    from subspace_ref.hf.attention import subspace_attention_enabled

    nll, nbytes, full, chunks = [], 0, 0, []
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(ids), batch):
            x = torch.as_tensor(ids[i : i + batch], dtype=torch.long)
            if factory is None:
                res = teacher_forced(model, x, None)
                nll.append(-res.token_logprobs)
                continue
            # teacher_forced's own path (spec/models.md M6), keeping the cache to read its states
            with subspace_attention_enabled(model):
                cache = SubspaceCache(model.config, factory, backend=backend)
                logits = model(input_ids=x, cache=cache, use_cache=True).logits
            logp = torch.log_softmax(logits[:, :-1].to(torch.float64), dim=-1)
            nll.append(-logp.gather(-1, x[:, 1:, None])[..., 0].cpu().numpy())
            nbytes += cache.nbytes
            full += cache.full_cache_nbytes
            chunks += [np.asarray(s.num_chunks).ravel() for s in cache.states if s is not None]
    tokens = ids.shape[0] * ids.shape[1]
    ch = np.concatenate(chunks) if chunks else np.zeros(0)
    return dict(
        nll=np.concatenate(nll, axis=0), bytes_per_token=nbytes / tokens if factory is not None else None,
        full_bytes_per_token=full / tokens if factory is not None else None,
        chunks_mean=float(ch.mean()) if ch.size else None, chunks_max=int(ch.max()) if ch.size else None,
        seconds=round(time.perf_counter() - start, 2),
    )


def score_projected(model, ids: np.ndarray, bases: list, *, side: str = "both", pre_rope: bool = False, batch: int = 4) -> dict:
    """Per-token NLL with exact attention over projected keys/values (lab/experiments/_project.py):
    the seed 003 pre-RoPE ablation, and the cross-check of the cache path."""
    import torch

    from subspace_ref.lab.experiments._project import projected

    nll = []
    start = time.perf_counter()
    with torch.no_grad(), projected(model, bases, side, pre_rope):
        for i in range(0, len(ids), batch):
            x = torch.as_tensor(ids[i : i + batch], dtype=torch.long)
            logp = torch.log_softmax(model(input_ids=x, use_cache=False).logits[:, :-1].to(torch.float64), dim=-1)
            nll.append(-logp.gather(-1, x[:, 1:, None])[..., 0].cpu().numpy())
    return dict(nll=np.concatenate(nll, axis=0), bytes_per_token=None, full_bytes_per_token=None, chunks_mean=None, chunks_max=None,
                seconds=round(time.perf_counter() - start, 2))


def projection_check(ctx: C.Context, record: dict, svd: list[dict], ids: np.ndarray, tokens: dict, rows: list[dict]) -> dict:
    """The static cache (coefficient space) against exact attention over K P_B, V P_E at r ≈ d/4:
    the largest per-token NLL difference (they compute the same thing, spec A2)."""
    cands = [r for r in rows if r["method"] == "static" and r["gamma"] == "unit" and r["compress"] == "both"
             and r["coefficients"] == "float" and not r.get("energy")]
    if not cands:
        return {}
    run = min(cands, key=lambda r: abs(r["rank"] - ctx.d / 4))
    bases = [static_basis(record, svd, li, rank=run["rank"], gamma="unit") for li in range(len(svd))]
    res = score_projected(ctx.model, ids, bases, batch=ctx.profile.batch)
    diff = float(np.abs(res["nll"] - tokens[run["name"]].astype(np.float64)).max())
    return dict(projection_vs_cache=dict(run=run["name"], max_abs_token_nll_diff=diff))


def by_position(nll: np.ndarray, edges: list[int]) -> dict:
    """Mean NLL per context-length bucket; column t of ``nll`` predicts with context length t+1."""
    ctx_len = np.arange(1, nll.shape[1] + 1)
    out = {}
    for a, b in zip(edges[:-1], edges[1:]):
        m = (ctx_len >= a) & (ctx_len < b)  # a window of T tokens has context lengths 1..T-1
        if m.any():
            out[C.bucket_label(a, b)] = float(nll[:, m].mean())
    return out


def full_cache_bytes_per_token(facts: dict, itemsize: int = 4) -> int:
    """Uncompressed K and V per token over all layers and KV heads, in ``itemsize`` bytes."""
    return facts["layers"] * facts["kv_heads"] * 2 * facts["head_dim"] * itemsize


# ----------------------------------------------------------------------------- the grid
def grid(ctx: C.Context, record: dict) -> list[dict]:
    """Every run of the profile, as specs that :func:`factory` turns into state factories."""
    p = ctx.profile
    d = ctx.d
    runs = []
    uniform = record["uniform_ranks"]
    for r in uniform:
        for g in p.gammas:
            runs.append(dict(method="static", rank=r, gamma=g, compress="both", coefficients="float"))
        if p.sides:
            runs.append(dict(method="static", rank=r, gamma="unit", compress="keys", coefficients="float"))
            runs.append(dict(method="static", rank=r, gamma="unit", compress="values", coefficients="float"))
        if p.int8:
            runs.append(dict(method="static", rank=r, gamma="unit", compress="both", coefficients="int8"))
    if record.get("files", {}).get("pre_rope") and p.pre_rope:
        for r in uniform:  # seed 003 RoPE ablation: keys projected on a pre-RoPE basis, rotation re-applied
            runs.append(dict(method="static-pre", rank=r, gamma="unit", compress="both", coefficients="float"))
    for e in record["energy_ranks"]:
        for g in [x for x in ("unit", "mse") if x in p.gammas]:
            runs.append(dict(method="static", energy=e, gamma=g, compress="both", coefficients="float"))
    taus = record["tau"]["by_rank"]
    layers = len(record["energy_at_rank"][str(uniform[0])]["k"])
    r4 = min(record["online_ranks"], key=lambda x: abs(x - d / 4))
    for r in record["online_ranks"]:
        for reset in p.sketch_resets:
            runs.append(dict(method="adaptive", rank=r, gamma="unit", sketch_reset=reset, tau_k=taus[str(r)]["tau_k"],
                             tau_v=taus[str(r)]["tau_v"], tau_source="calibrated", max_chunk=p.max_chunk, compress="both", coefficients="float"))
        if r == r4:
            for t in p.paper_taus:  # seed 001 §10: "typical targets τ ≈ 0.1–0.2"
                runs.append(dict(method="adaptive", rank=r, gamma="unit", sketch_reset=True, tau_k=[t] * layers, tau_v=[t] * layers,
                                 tau_source=f"paper {t:g}", max_chunk=p.max_chunk, compress="both", coefficients="float"))
        if p.rotating:
            runs.append(dict(method="rotating", rank=r, gamma="unit", refresh_every=p.refresh_every, compress="both", coefficients="float"))
    for spec in runs:
        spec["name"] = run_name(spec)
        spec["d"] = d
    return runs


def run_name(spec: dict) -> str:
    m = spec["method"]
    if m == "static":
        what = f"e{float(spec['energy']):.0%}" if spec.get("energy") else f"r{spec['rank']}"
        tail = "" if spec["compress"] == "both" else f" {spec['compress']}-only"
        tail += " int8" if spec["coefficients"] == "int8" else ""
        return f"static {what} γ={spec['gamma']}{tail}"
    if m == "static-pre":
        return f"static pre-RoPE basis r{spec['rank']} γ={spec['gamma']}"
    if m == "adaptive":
        tau = "" if spec.get("tau_source", "calibrated") == "calibrated" else f" τ={spec['tau_source'].split()[-1]}"
        return f"adaptive r{spec['rank']}{' reset' if spec['sketch_reset'] else ''}{tau}"
    return f"rotating r{spec['rank']} m{spec['refresh_every']}"


def factory(spec: dict, record: dict, svd: list[dict]):
    from subspace_ref.hf import adaptive_states, rotating_states, static_states

    m = spec["method"]
    if m == "static":
        bases = [static_basis(record, svd, li, rank=spec.get("rank"), energy=spec.get("energy"), gamma=spec["gamma"]) for li in range(len(svd))]
        return static_states(bases, compress=spec["compress"], coefficients=spec["coefficients"])
    if m == "adaptive":
        tk, tv = list(spec["tau_k"]), list(spec["tau_v"])
        return adaptive_states(rank_k=spec["rank"], rank_v=spec["rank"], tau_k=lambda li: tk[li], tau_v=lambda li: tv[li],
                               max_chunk=spec["max_chunk"], sketch_reset=spec["sketch_reset"])
    if m == "rotating":
        return rotating_states(rank_k=spec["rank"], rank_v=spec["rank"], refresh_every=spec["refresh_every"])
    raise ValueError(f"unknown method {m!r}")


def mean_ranks(spec: dict, record: dict) -> tuple[float, float, int]:
    """(mean key rank, mean value rank, largest rank) over layers and heads."""
    if spec.get("energy"):
        rk = np.asarray(record["energy_ranks"][spec["energy"]]["k"], dtype=float)
        rv = np.asarray(record["energy_ranks"][spec["energy"]]["v"], dtype=float)
        return float(rk.mean()), float(rv.mean()), int(max(rk.max(), rv.max()))
    d = record["d"]
    r = spec["rank"]
    rk = d if spec["compress"] == "values" else r
    rv = d if spec["compress"] == "keys" else r
    return float(rk), float(rv), int(max(rk, rv))


def summarize_run(spec: dict, res: dict, base: dict, edges: list[int], record: dict) -> dict:
    nll, nll0 = res["nll"], base["nll"]
    lo, hi = S.relative_perplexity_interval(list(nll), list(nll0))  # whole windows resampled, paired
    mean_nll = float(nll.mean())
    rk, rv, rmax = mean_ranks(spec, record)
    pos = by_position(nll, edges)
    pos0 = base["by_position"]
    row = {k: v for k, v in spec.items() if k not in ("tau_k", "tau_v")}
    if spec["method"] == "adaptive":
        row["tau_k_mean"] = float(np.mean(spec["tau_k"]))
        row["tau_v_mean"] = float(np.mean(spec["tau_v"]))
        row["tau_k"], row["tau_v"] = list(spec["tau_k"]), list(spec["tau_v"])
    row.update(
        rank_k=rk, rank_v=rv, rank_max=rmax, ppl=math.exp(mean_nll), nll=mean_nll,
        delta_pct=C.percent(math.exp(mean_nll - base["nll_mean"]) - 1.0),
        delta_pct_ci=[C.percent(lo), C.percent(hi)],
        bytes_per_token=res["bytes_per_token"], full_bytes_per_token=res["full_bytes_per_token"],
        compression=res["full_bytes_per_token"] / res["bytes_per_token"] if res["bytes_per_token"] else None,
        chunks_mean=res["chunks_mean"], chunks_max=res["chunks_max"], seconds=res["seconds"],
        by_position={k: dict(ppl=math.exp(v), delta_pct=C.percent(math.exp(v - pos0[k]) - 1.0)) for k, v in pos.items()},
    )
    return row


def ppl_run(ctx: C.Context, *, only: set[str] | None = None) -> dict:
    """Score the baseline and every run of the grid; write the outputs and return the record.
    ``only``: restrict to these method names (for main_job's short table)."""
    record, svd = ensure_calibration(ctx)
    ids = ctx.eval_windows()
    edges = C.position_edges(ids.shape[1])
    base = score(ctx.model, ids, None, batch=ctx.profile.batch)
    base["nll_mean"] = float(base["nll"].mean())
    base["by_position"] = by_position(base["nll"], edges)
    specs = grid(ctx, record)
    if only is not None:
        specs = [s for s in specs if s["name"] in only]
    rows, tokens = [], {"baseline": base["nll"].astype(np.float32)}
    backend = getattr(ctx.args, "backend", "torch")
    bar = ctx.bar(specs, desc="ppl runs")
    svd_pre = load_svd(ctx.out, pre_rope=True) if any(s["method"] == "static-pre" for s in specs) else None
    for spec in bar:
        bar.set_postfix_str(spec["name"])
        if spec["method"] == "static-pre":
            bases = [basis_from_svd(pre, spec["rank"], spec["rank"], 1.0) for pre in svd_pre]
            res = score_projected(ctx.model, ids, bases, pre_rope=True, batch=ctx.profile.batch)
        else:
            be = "numpy" if spec["coefficients"] == "int8" else backend
            res = score(ctx.model, ids, factory(spec, record, svd), backend=be, batch=ctx.profile.batch)
        rows.append(summarize_run(spec, res, base, edges, record))
        tokens[spec["name"]] = res["nll"].astype(np.float32)
    for row in rows:  # a pre-RoPE basis stores what a static state of the same rank stores
        if row["method"] == "static-pre":
            twin = [x for x in rows if x["method"] == "static" and x.get("rank") == row["rank"] and x["compress"] == "both"
                    and x["coefficients"] == "float" and not x.get("energy")]
            if twin:
                row["bytes_per_token"], row["full_bytes_per_token"], row["compression"] = (
                    twin[0]["bytes_per_token"], twin[0]["full_bytes_per_token"], twin[0]["compression"])
    checks = projection_check(ctx, record, svd, ids, tokens, rows)
    full_bpt = full_cache_bytes_per_token(ctx.facts, 4)
    out = dict(
        meta=C.meta(ctx, "ppl"),
        d=ctx.d, tokens=int(ids.size), windows=int(ids.shape[0]), context=int(ids.shape[1]),
        position_edges=edges, bootstrap=dict(unit="window", windows=int(ids.shape[0]), reps=S.REPS, level=S.LEVEL),
        baseline=dict(ppl=math.exp(base["nll_mean"]), nll=base["nll_mean"], seconds=base["seconds"],
                      by_position={k: dict(ppl=math.exp(v)) for k, v in base["by_position"].items()},
                      full_bytes_per_token_float32=full_bpt, full_bytes_per_token_float16=full_bpt // 2),
        runs=rows, checks=checks, by_position_rank=by_position_rank(rows, ctx.d),
    )
    C.write_json(ctx.out / "ppl.json", out)
    C.write_csv(ctx.out / "ppl.csv", rows)
    np.savez_compressed(ctx.out / "ppl_tokens.npz", **{_key(k): v for k, v in tokens.items()})
    plot(ctx, out)
    return out


def by_position_rank(rows: list[dict], d: int) -> int:
    """The rank the by-position figure shows: that of the adaptive run with the lowest Δppl (the
    operating point falsifier 001-3 examines), else the uniform rank nearest d/4."""
    ada = [r for r in rows if r["method"] == "adaptive"]
    if ada:
        return min(ada, key=lambda r: r["delta_pct"])["rank"]
    return min({r["rank"] for r in rows if r.get("rank")}, key=lambda x: abs(x - d / 4))


def _key(name: str) -> str:
    return name.replace(" ", "_").replace("γ", "g").replace("%", "pct").replace("=", "")


def load_tokens(out) -> dict:
    """Per-token NLL arrays of ``ppl_tokens.npz`` keyed like the runs' names (see :func:`_key`)."""
    with np.load(out / "ppl_tokens.npz") as z:
        return {k: z[k] for k in z.files}


def token_key(name: str) -> str:
    return _key(name)


# ----------------------------------------------------------------------------- figures
SERIES = [
    ("static γ=unit", dict(method="static", gamma="unit", compress="both", coefficients="float"), dict(color="C0", marker="o")),
    ("static γ=√(r/d)", dict(method="static", gamma="paper", compress="both", coefficients="float"), dict(color="C1", marker="v", ls="--")),
    ("static γ=MSE", dict(method="static", gamma="mse", compress="both", coefficients="float"), dict(color="C2", marker="^")),
    ("static keys-only", dict(method="static", compress="keys"), dict(color="C7", marker="<", ls=":")),
    ("static values-only", dict(method="static", compress="values"), dict(color="C8", marker=">", ls=":")),
    ("static INT8", dict(method="static", coefficients="int8"), dict(color="C9", marker="x", ls="-.")),
    ("static, pre-RoPE basis (ablation)", dict(method="static-pre"), dict(color="k", marker=".", ls="--")),
    ("adaptive", dict(method="adaptive", sketch_reset=False, tau_source="calibrated"), dict(color="C3", marker="s")),
    ("adaptive + sketch_reset", dict(method="adaptive", sketch_reset=True, tau_source="calibrated"), dict(color="C4", marker="D")),
    ("adaptive, seed 001's τ = 0.2", dict(method="adaptive", tau_source="paper 0.2"), dict(color="C6", marker="*", ls="none")),
    ("rotating", dict(method="rotating"), dict(color="C5", marker="P")),
]


def select(rows: list[dict], **want) -> list[dict]:
    return [r for r in rows if all(r.get(k) == v for k, v in want.items())]


def plot(ctx: C.Context, out: dict) -> None:
    plt = C.pyplot()
    rows = out["runs"]
    d = out["d"]
    uniform = [r for r in rows if not r.get("energy")]
    energy = [r for r in rows if r.get("energy")]

    def yv(x):  # drawn as measured: a negative Δppl (the cache beat the stock model by noise) sits below 0
        return x

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, want, style in SERIES:
        pts = sorted(select(uniform, **want), key=lambda r: r["rank"])
        if pts:
            ax.plot([r["rank"] for r in pts], [yv(r["delta_pct"]) for r in pts], label=label, ms=4, lw=1, **style)
    for g, mk in (("unit", "*"), ("mse", "h")):
        pts = [r for r in energy if r["gamma"] == g]
        if pts:
            ax.scatter([0.5 * (r["rank_k"] + r["rank_v"]) for r in pts], [yv(r["delta_pct"]) for r in pts], marker=mk, s=40,
                       color="k" if g == "unit" else "C2", zorder=5, label=f"static per-head energy ranks γ={g} (mean rank)")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.axvline(d / 4, color="grey", lw=0.8, ls=":")
    C.symlog_percent(ax)
    ax.axhline(0.0, color="k", lw=0.5)
    ax.text(d / 4, ax.get_ylim()[1], " d/4", va="top", fontsize=8, color="grey")
    ax.set_xlabel("rank r = r_v (per KV head)")
    ax.set_ylabel("Δppl over the stock model (%)\n(log beyond ±1%, linear inside)")
    ax.set_title(f"Held-out perplexity vs rank ({out['windows']} windows of {out['context']} tokens); dashed: +1%")
    ax.legend(**C.LEGEND_OUTSIDE)
    C.save_figure(fig, ctx.figures / "ppl_vs_rank.png")

    target = out["by_position_rank"]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    buckets = list(out["baseline"]["by_position"])
    for label, want, style in SERIES:
        pts = select(uniform, rank=target, **want)
        if pts:
            r = pts[0]
            ax.plot(range(len(buckets)), [r["by_position"][b]["delta_pct"] for b in buckets], label=label, ms=4, lw=1, **style)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.axhline(0.0, color="k", lw=0.5)
    ax.set_xticks(range(len(buckets)), [f"{b}\n(ppl₀ {out['baseline']['by_position'][b]['ppl']:.2f})" for b in buckets])
    ax.set_xlabel("context length of the predicted token (tokens)")
    ax.set_ylabel("perplexity increase (%)")
    ax.set_title(f"Degradation with context length at r = {target} (d = {d})")
    ax.legend(**C.LEGEND_OUTSIDE)
    C.save_figure(fig, ctx.figures / "ppl_by_position.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, want, style in SERIES:
        pts = sorted(select(uniform, **want), key=lambda r: r["bytes_per_token"])
        if pts:
            ax.plot([r["bytes_per_token"] for r in pts], [yv(r["delta_pct"]) for r in pts], label=label, ms=4, lw=1, **style)
    for g, mk in (("unit", "*"), ("mse", "h")):
        pts = sorted([r for r in energy if r["gamma"] == g], key=lambda r: r["bytes_per_token"])
        if pts:
            ax.scatter([r["bytes_per_token"] for r in pts], [yv(r["delta_pct"]) for r in pts], marker=mk, s=40,
                       color="k" if g == "unit" else "C2", zorder=5, label=f"per-head energy ranks γ={g}")
    full = out["baseline"]["full_bytes_per_token_float32"]
    ax.axvline(full, color="k", lw=0.8, ls="--")
    ax.text(full, 1.0, " full K/V (fp32)", fontsize=8, rotation=90, va="bottom")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    C.symlog_percent(ax)
    ax.axhline(0.0, color="k", lw=0.5)
    ax.set_xlabel("KV bytes per token (state.nbytes / tokens, all layers)")
    ax.set_ylabel("Δppl (%), log beyond ±1%")
    ax.set_title("Quality against memory")
    ax.legend(**C.LEGEND_OUTSIDE)
    C.save_figure(fig, ctx.figures / "ppl_vs_bytes.png")


# ----------------------------------------------------------------------------- CLI
def table(out: dict, rows: list[dict] | None = None) -> str:
    """The printed table: method, rank, ppl, Δppl % with its 95% interval (windows resampled), KV bytes/token, chunks."""
    rows = out["runs"] if rows is None else rows
    b = out["baseline"]
    body = [["stock model (full K/V, fp32)", out["d"], f"{b['ppl']:.3f}", "", f"{b['full_bytes_per_token_float32']:.0f}", ""]]
    for r in rows:
        rk = f"{r['rank_k']:.1f}/{r['rank_v']:.1f}" if r.get("energy") else f"{r['rank_k']:.0f}/{r['rank_v']:.0f}"
        body.append([r["name"], rk, f"{r['ppl']:.3f}", pct_ci(r["delta_pct"], r["delta_pct_ci"]), f"{r['bytes_per_token']:.0f}",
                     "" if r["chunks_mean"] is None else f"{r['chunks_mean']:.1f}"])
    return text_table(["method", "rank k/v", "ppl", "Δppl % [95% interval]", "KV B/token", "chunks"], body, "lrrrrr")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_common_arguments(parser)


def run(args: argparse.Namespace) -> int:
    ctx = C.make_context(args)
    out = ppl_run(ctx)
    print(f"ppl: {len(out['runs'])} runs on {out['tokens']} held-out tokens -> {ctx.out / 'ppl.json'}")
    print(table(out))
    return 0

