"""``baselines``: KV-cache compression baselines against subspace projection at matched KV bytes.

On the shipped model, held-out windows (seed 0) are scored under every method of
:mod:`subspace_ref.lab.baselines` configured for 50%, 25% and 12.5% of the full fp16 cache
(:func:`subspace_ref.lab.baselines.methods_at`; bytes per token counted by
:mod:`subspace_ref.byte_convention`, scales, sinks, scores and bases included). Static bases come
from the calibration windows (training split, seed 1) by the ``calibrate`` helpers. Writes
``OUT/baselines.json``, ``OUT/baselines.csv``, ``OUT/baselines_tokens.npz`` (per-token NLL),
``OUT/figures/baselines_pareto.png`` and ``baselines_position.png``, and regenerates
``DOCS/baselines.md`` with the figures copied to ``DOCS/figures``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from subspace_ref.lab.experiments import _common as C

DEFAULT_OUT = Path("results/baselines")
QUICK_CONTEXT = 256
#: the issue's three budgets, then two smaller ones to show where eviction starts to lose
EXTRA_BUDGETS = (0.5, 0.25, 0.125, 0.0625, 0.03125)
DEFAULT_WINDOWS = 24


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_common_arguments(parser, default_profile="full")
    parser.set_defaults(out=DEFAULT_OUT)
    parser.add_argument("--windows", type=int, default=None, help=f"held-out evaluation windows (default {DEFAULT_WINDOWS}; --quick 2)")
    parser.add_argument(
        "--budgets",
        type=lambda s: tuple(float(x) for x in s.split(",")),
        default=EXTRA_BUDGETS,
        help="fractions of the full cache (default 0.5,0.25,0.125 plus 0.0625,0.03125 for the Pareto front)",
    )
    parser.add_argument("--batch", type=int, default=4, help="windows per forward pass (default 4)")
    parser.add_argument("--quick", action="store_true", help=f"tests: 2 windows of {QUICK_CONTEXT} tokens, 2 calibration windows")
    parser.add_argument("--docs", type=Path, default=C.DEFAULT_DOCS, help="where baselines.md and its figures go (default docs)")
    parser.add_argument("--no-docs", action="store_true", help="do not write the docs page")


# ----------------------------------------------------------------------------- scoring
#: where a row's numbers come from, for rows whose method class describes another evaluation
CACHE_SOURCE = dict(
    SubspaceWindow="this project (SubspaceCache of static states; the window as a mask over its logits, as the eviction rows)",
)


def score(model, ids: np.ndarray, method, bases: list | None, batch: int, rope=None) -> tuple[np.ndarray, float]:
    """Per-token NLL (n, T-1) of ``ids`` under ``method`` (None: stock) and the seconds taken.
    Every subspace row runs teacher-forced through a ``SubspaceCache``: uniform rows of
    ``static_states``, allocations (``method.allocation``) of ``allocated_states`` (``rope``: the
    model's, for pre-RoPE heads), the windowed row of ``static_states`` under a window mask."""
    import torch

    from subspace_ref.lab.baselines import Subspace, SubspaceWindow, token_logprobs
    from subspace_ref.hf import allocated_states, static_states, teacher_forced

    start = time.perf_counter()
    out = []
    with torch.no_grad():
        for i in range(0, len(ids), batch):
            x = torch.as_tensor(ids[i : i + batch], dtype=torch.long)
            if hasattr(method, "allocation"):  # uniform pre-RoPE and allocator rows: one LayerState per layer
                lp = teacher_forced(model, x, allocated_states(bases, method.allocation, rope=rope), backend="torch").token_logprobs
            elif isinstance(method, Subspace):
                lp = teacher_forced(model, x, method.factory(bases), backend=method.backend).token_logprobs
            elif isinstance(method, SubspaceWindow):
                lp = windowed_logprobs(model, x, static_states(bases), method.window)
            else:
                lp = token_logprobs(model, x, method).numpy()
            out.append(-np.asarray(lp, dtype=np.float64))
    return np.concatenate(out, axis=0), time.perf_counter() - start


def windowed_logprobs(model, x, factory, window: int) -> np.ndarray:
    """Token log-probabilities (B, T-1) of ``x`` through a ``SubspaceCache`` of ``factory`` when
    each position attends only its last ``window`` tokens: the subspace attention applies the
    4-d mask to its coefficient logits, which equals a cache that evicts older coefficients (as
    the eviction rows, lab/baselines/_attention.py)."""
    import torch

    from subspace_ref.lab.baselines import window_keep
    from subspace_ref.hf import SubspaceCache
    from subspace_ref.hf.attention import subspace_attention_enabled

    T = x.shape[1]
    mask = window_keep(T, T, window, 0, x.device)[None, None].expand(x.shape[0], 1, T, T)
    with torch.no_grad(), subspace_attention_enabled(model):
        cache = SubspaceCache(model.config, factory, backend="torch")
        logits = model(input_ids=x, attention_mask=mask, cache=cache, use_cache=True).logits
    logp = torch.log_softmax(logits[:, :-1].to(torch.float64), dim=-1)
    return logp.gather(-1, x[:, 1:, None])[..., 0].numpy()


def bases_for(svd: list[dict], r: int, rv: int) -> list:
    from subspace_ref.lab.experiments.calibrate import basis_from_svd

    return [basis_from_svd(entry, r, rv, 1.0) for entry in svd]


def by_position(nll: np.ndarray, edges: list[int]) -> dict:
    """Perplexity per context-length bucket (column t of ``nll`` predicts with t+1 tokens of context)."""
    ctx_len = np.arange(1, nll.shape[1] + 1)
    return {
        C.bucket_label(a, b): float(np.exp(nll[:, (ctx_len >= a) & (ctx_len < b)].mean()))
        for a, b in zip(edges[:-1], edges[1:])
        if ((ctx_len >= a) & (ctx_len < b)).any()
    }


def compare(a: np.ndarray, b: np.ndarray) -> dict:
    """Mean NLL difference a - b (nats/token), perplexity ratio ppl(a)/ppl(b) - 1 and its 95%
    interval from resampling whole evaluation windows (the independent unit; paired:
    :func:`subspace_ref.lab.experiments.statistics.relative_perplexity_interval`)."""
    from subspace_ref.lab.experiments.statistics import relative_perplexity_interval

    diff = a - b
    lo, hi = relative_perplexity_interval(list(a), list(b))
    return dict(
        delta_nll=float(diff.mean()), ci=[lo, hi], ppl_ratio=float(np.exp(diff.mean())), verdict="tie" if lo <= 0 <= hi else ("worse" if lo > 0 else "better")
    )


# ----------------------------------------------------------------------------- issue 16's configurations
#: budgets at which the allocator and the uniform low-bit configurations are run
FRONTIER_BUDGETS = (0.5, 0.25, 0.125)
#: the ranks the allocator measures (every 4th of the shipped model's 64)
RANK_GRID = tuple(range(0, 65, 4))


def frontier_bases(alloc, cal) -> tuple:
    """The (svd, svd_pre, rope) that the simulation
    :meth:`~subspace_ref.lab.baselines.frontier.Frontier.with_bases` takes (tests/test_baselines.py,
    lab/experiments/tasks.py), with each plane head's key rows (``cal.planes``) in place of its
    post-RoPE SVD rows: a plane basis is a post-RoPE static basis (spec/rope.md R1), so it is
    evaluated as one."""
    svd = cal.svd
    if not any(h.key_basis == "plane" for layer in alloc.heads for h in layer):
        return svd, cal.svd_pre, cal.rope
    out = []
    for li, layer in enumerate(alloc.heads):
        Wk = svd[li]["Wk"].copy()
        for h, c in enumerate(layer):
            if c.key_basis == "plane":
                Wk[h] = cal.planes[li][h]
        out.append({**svd[li], "Wk": Wk})
    return out, cal.svd_pre, cal.rope


def uniform(geom, fraction: float, bits: int, key_basis: str, group: int = 32, window: int = 0, sinks: int = 0):
    """The largest r + r_v (r >= r_v, r - r_v <= 1) at ``bits`` on both sides that fits ``fraction``."""
    from subspace_ref.allocation import Allocation, HeadAllocation

    best = None
    for total in range(2, geom.head_dim + geom.value_dim + 1):
        r, rv = (total + 1) // 2, total // 2
        a = Allocation(
            tuple(tuple(HeadAllocation(r, rv, bits, bits, key_basis) for _ in range(geom.kv_heads)) for _ in range(geom.layers)),
            group,
            fraction * geom.full_bytes_per_token,
            window,
            sinks,
        )
        if a.bytes(geom).fraction <= fraction + 1e-12:
            best = a
    return best


def frontier_methods(geom, fraction: float, cal, group: int = 32) -> list:
    """Issue 16's configurations at ``fraction`` as allocations (each decoded by a
    ``SubspaceCache`` of ``allocated_states``): uniform pre-RoPE int4 and int2, uniform pre-RoPE
    int4 with an exact window of context/32 tokens and 4 sinks, the allocator's choice, the
    allocator with the same window and sinks (each on the loss tables measured for its exact
    tokens, :meth:`~subspace_ref.hf.CalibrationLosses.tables`), and the allocation
    ``subspace-kv calibrate`` makes by default (sinks and window chosen by the loss,
    :meth:`~subspace_ref.hf.CalibrationLosses.allocate_best`)."""
    from subspace_ref.allocation import allocate
    from subspace_ref.hf.calibrate_checkpoint import AUTO_PRE_ROPE_RANK, resolve_pre_rope_rank
    from subspace_ref.lab.baselines.frontier import Frontier

    out = []
    w = geom.context // 32  # 32 exact recent tokens at the page's 1024
    for bits, window, sinks in ((4, 0, 0), (2, 0, 0), (4, w, 4)):
        a = uniform(geom, fraction, bits, "pre_rope", group, window, sinks)
        if a is not None:
            h = a.heads[0][0]
            exact = f" + sinks {sinks} + window {window}" if window else ""
            out.append(Frontier(a, f"pre-RoPE r={h.rank_k}/{h.rank_v} int{bits}{exact}"))
    a = allocate(cal.tables(0, 0), geom, compression_ratio=fraction, group=group)
    out.append(Frontier(a, f"allocator {100 * fraction:g}%"))
    a = allocate(cal.tables(4, w), geom, compression_ratio=fraction, group=group, window=w, sinks=4)
    out.append(Frontier(a, f"allocator {100 * fraction:g}% + sinks 4 + window {w}"))
    if group == cal.group:  # the front door's choice: sinks and window chosen by the same loss
        a = cal.allocate_best(geom, compression_ratio=fraction)
        out.append(Frontier(a, f"allocator {100 * fraction:g}%, exact tokens chosen (sinks {a.sinks} + window {a.window})"))
        cap = resolve_pre_rope_rank(AUTO_PRE_ROPE_RANK, geom.head_dim)  # the front door's default cap (L6.4)
        a = cal.allocate_best(geom, compression_ratio=fraction, max_pre_rope_rank=cap)
        out.append(Frontier(a, f"allocator {100 * fraction:g}%, pre-RoPE rank <= {cap}, exact tokens chosen (sinks {a.sinks} + window {a.window})"))
    bits = int(round(16 * fraction))
    if bits in (2, 4, 8):  # at the bytes of the quantisation row of this budget (above the budget)
        from subspace_ref.lab.baselines.quantized import QuantizedKV

        target = QuantizedKV(bits=bits, group=64).bytes(geom).per_token
        a = allocate(cal.tables(4, w), geom, bytes_per_token=target, group=group, window=w, sinks=4)
        out.append(Frontier(a, f"allocator @ {target:.0f} bytes + sinks 4 + window {w}"))
    return out


frontier_allocations = frontier_methods


# ----------------------------------------------------------------------------- the run
def run_comparison(ctx: C.Context, n_windows: int, batch: int, budgets=EXTRA_BUDGETS) -> dict:
    from subspace_ref.lab.baselines import H2O, SlidingWindow, StreamingLLM, Subspace, methods_at
    from subspace_ref.byte_convention import Geometry, full_bytes
    from subspace_ref.hf.calibration_losses import calibration_losses, capture_windows, layer_svd

    model = ctx.model
    geom = Geometry.of_model(model, ctx.context)
    ids = ctx.eval_windows(n_windows)
    cal = capture_windows(model, ctx.calib_windows(), queries=False, batch=batch)
    svd = layer_svd(cal)
    calib_tokens = cal.num_tokens
    del cal
    edges = C.position_edges(ctx.context)
    frontier = calibration_losses(model, ctx.calib_windows(), batch=batch, svd=svd, ranks=RANK_GRID)

    plan = [(None, None)] + [(f, m) for f in budgets for m in methods_at(geom, f) + (frontier_methods(geom, f, frontier) if f in FRONTIER_BUDGETS else [])]
    C_ = geom.context
    checks = [
        SlidingWindow(window=C_),
        StreamingLLM(sinks=4, window=C_ - 4),
        H2O(heavy=C_ // 2, recent=C_ - C_ // 2),
        Subspace(rank_k=geom.head_dim, rank_v=geom.value_dim),
    ]
    rows, tokens = [], {}
    stock = None
    bar = ctx.bar(total=len(plan) + len(checks), desc="baselines")
    for budget, m in plan:
        if m is not None and hasattr(m, "allocation"):
            bases = frontier.bases(m.allocation)
        else:
            bases = bases_for(svd, m.rank_k, m.rank_v) if m is not None and hasattr(m, "rank_k") else None
        nll, secs = score(model, ids, m, bases, batch, rope=frontier.rope)
        b = full_bytes(geom) if m is None else m.bytes(geom)
        name = "full cache (stock)" if m is None else m.name
        row = dict(
            budget=budget,
            family="stock" if m is None else m.family,
            method=name,
            source="transformers DynamicCache + sdpa" if m is None else CACHE_SOURCE.get(type(m).__name__, m.source),
            bytes_per_token=b.per_token,
            fraction_of_full=b.fraction,
            within_budget=True if budget is None else b.fraction <= budget + 1e-9,
            bytes_parts=b.parts,
            ppl=float(np.exp(nll.mean())),
            nll=float(nll.mean()),
            seconds=round(secs, 2),
            by_position=by_position(nll, edges),
        )
        if m is not None and hasattr(m, "allocation"):
            row["allocation"] = m.allocation.to_dict()
        if m is None:
            stock = nll
        else:
            cmp = compare(nll, stock)
            row.update(
                delta_ppl=row["ppl"] - float(np.exp(stock.mean())),
                delta_pct=100 * (cmp["ppl_ratio"] - 1),
                delta_nll=cmp["delta_nll"],
                delta_pct_ci=[100 * cmp["ci"][0], 100 * cmp["ci"][1]],
            )
        tokens[f"{budget}|{name}"] = nll.astype(np.float32)
        rows.append(row)
        bar.update()
    full_checks = []
    for m in checks:  # every method at the full budget must reproduce the stock model
        bases = bases_for(svd, m.rank_k, m.rank_v) if hasattr(m, "rank_k") else None
        nll, _ = score(model, ids, m, bases, batch)
        full_checks.append(dict(method=m.name, max_abs_token_nll_diff=float(np.abs(nll - stock).max())))
        bar.update()
    bar.close()

    verdicts, pairwise = [], []
    for f in budgets:
        at = [r for r in rows if r["budget"] == f]
        sub = [r for r in at if r["family"].startswith("subspace")]
        oth = [r for r in at if not r["family"].startswith("subspace")]
        best_base = min([r for r in oth if r["within_budget"]] or oth, key=lambda r: r["ppl"])
        for s_ in sub:
            c = compare(tokens[f"{f}|{s_['method']}"], tokens[f"{f}|{best_base['method']}"])
            verdicts.append(
                dict(
                    budget=f,
                    subspace=s_["method"],
                    subspace_family=s_["family"],
                    subspace_within_budget=s_["within_budget"],
                    baseline=best_base["method"],
                    baseline_family=best_base["family"],
                    subspace_ppl=s_["ppl"],
                    baseline_ppl=best_base["ppl"],
                    **c,
                )
            )
            for r in oth:
                c = compare(tokens[f"{f}|{s_['method']}"], tokens[f"{f}|{r['method']}"])
                pairwise.append(dict(budget=f, subspace=s_["method"], baseline=r["method"], baseline_within_budget=r["within_budget"], **c))
    return dict(
        meta=C.meta(ctx, "baselines", eval_windows=int(len(ids)), calibration_tokens=int(calib_tokens), batch=batch),
        geometry=dict(
            layers=geom.layers,
            kv_heads=geom.kv_heads,
            head_dim=geom.head_dim,
            value_dim=geom.value_dim,
            context=geom.context,
            float_bytes=geom.float_bytes,
            full_bytes_per_token=geom.full_bytes_per_token,
        ),
        budgets=list(budgets),
        position_edges=edges,
        rows=rows,
        full_budget_checks=full_checks,
        verdicts=verdicts,
        pairwise=pairwise,
    ), tokens


# ----------------------------------------------------------------------------- figures
FAMILY_STYLE = {
    "quantized KV": ("tab:orange", "s"),
    "sliding window": ("tab:gray", "v"),
    "StreamingLLM": ("tab:brown", "^"),
    "H2O": ("tab:purple", "D"),
    "subspace": ("tab:blue", "o"),
    "subspace INT8": ("tab:green", "o"),
    "subspace + window": ("tab:cyan", "P"),
    "subspace (issue 16)": ("tab:red", "*"),
}


def figures(record: dict, folder: Path) -> list[Path]:
    plt = C.pyplot()
    rows = [r for r in record["rows"] if r["budget"] is not None]
    stock = next(r for r in record["rows"] if r["budget"] is None)
    fams = [f for f in FAMILY_STYLE if any(r["family"] == f for r in rows)]
    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    for fam in fams:
        pts = sorted((r["fraction_of_full"], r["ppl"]) for r in rows if r["family"] == fam)
        col, mk = FAMILY_STYLE[fam]
        ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], marker=mk, color=col, label=fam)
    ax.axhline(stock["ppl"], color="k", ls="--", lw=0.8, label=f"full cache ({stock['ppl']:.3f})")
    for f in record["budgets"]:
        ax.axvline(100 * f, color="0.85", lw=0.6, zorder=0)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted(set(100 * f for f in record["budgets"]) | {100.0})
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t:g}%" for t in ticks])
    ax.set_xlabel("KV bytes per token (% of the fp16 full cache)")
    ax.set_ylabel("perplexity (held-out, log scale)")
    ax.set_title(f"Perplexity vs KV bytes, shipped model, {record['meta']['eval_windows']} windows x {record['geometry']['context']} tokens")
    ax.legend(ncol=2)
    p1 = C.save_figure(fig, folder / "baselines_pareto.png")

    budgets = record["budgets"]
    fig, axes = plt.subplots(1, len(budgets), figsize=(2.8 * len(budgets), 3.2), sharey=True)
    labels = list(stock["by_position"])
    x = np.arange(len(labels))
    for ax, f in zip(np.atleast_1d(axes), budgets):
        for fam in fams:
            r = next((r for r in rows if r["budget"] == f and r["family"] == fam), None)
            if r is None:
                continue
            col, mk = FAMILY_STYLE[fam]
            ax.plot(x, [r["by_position"][k] for k in labels], marker=mk, color=col, label=fam, ms=4)
        ax.plot(x, [stock["by_position"][k] for k in labels], "k--", lw=0.8, label="full cache")
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=30)
        ax.set_yscale("log")
        ax.set_title(f"budget {100 * f:g}%")
        ax.set_xlabel("context length (tokens)")
    np.atleast_1d(axes)[0].set_ylabel("perplexity (log scale)")
    np.atleast_1d(axes)[-1].legend(fontsize=6)
    p2 = C.save_figure(fig, folder / "baselines_position.png")
    return [p1, p2]


# ----------------------------------------------------------------------------- the page
def _pct(x):
    return f"{100 * x:.1f}%"


def markdown(record: dict, command: str) -> str:
    g, meta = record["geometry"], record["meta"]
    rows = record["rows"]
    stock = next(r for r in rows if r["budget"] is None)
    labels = list(stock["by_position"])
    L = []
    L.append("# Baselines at matched KV bytes\n")
    L.append(
        f"_Generated by `{command}`{' on ' + meta['date'] if meta.get('date') else ''} in {meta['runtime_s']:.0f} s ({meta['environment'].get('cpu_count')} CPUs, "
        f"{meta['settings'].get('backend')} backend); do not edit by hand: rerun the command._\n"
    )
    L.append(
        f"Model: {meta['model'].get('description')} ({g['layers']} layers x {g['kv_heads']} KV heads, d = {g['head_dim']}). "
        f"Evaluation: {meta['eval_windows']} held-out windows of {g['context']} tokens (corpus seed {C.SEED_EVAL}); "
        f"static bases from {meta['calibration_tokens']} calibration tokens of the training split (seed {C.SEED_BASES}), "
        f"gamma = 1. Full cache: {g['full_bytes_per_token']:.0f} bytes/token in fp16.\n"
    )
    L.append("## Byte accounting\n")
    L.append(
        "Bytes per token are what each cache holds at the end of a window of the evaluation length, divided by it, "
        "over all layers and KV heads, with every float stored in fp16 (`subspace_ref/byte_convention.py`):\n"
    )
    L.append(
        "* **quantised KV**: packed codes + fp16 scale and zero point per channel per 64-token group (keys) and per token "
        "(values); the keys of an unfinished group stay fp16 (KIVI). Bit widths are fixed (8/4/2 at 50/25/12.5%), so "
        "their scales put them *above* the budget; they are plotted at their real bytes."
    )
    L.append("* **sliding window / StreamingLLM**: the kept tokens only (post-RoPE keys need no position index); 4 sinks.")
    L.append(
        "* **H2O**: the kept tokens + a float32 accumulated score and an int16 position per kept token and KV head; heavy and recent halves of the capacity."
    )
    L.append(
        "* **subspace**: r + r_v coefficients per token and head (fp16; or int8 + one float32 scale per token and side, "
        "spec A10) + the bases (fp16) and gamma, amortised over the window (per sequence, though shared). "
        "**subspace + window**: the coefficients of the last half of the window only, at correspondingly larger ranks.\n"
    )
    L.append("## Results\n")
    L.append(
        f"Perplexity of the full cache: **{stock['ppl']:.4f}**. Δ is relative to it; the interval is the 95% "
        f"percentile interval of the perplexity ratio minus one when the {meta['eval_windows']} evaluation windows (the "
        "independent unit: tokens within a window are correlated) are resampled with replacement, paired with the full "
        "cache on the same draw (`lab/experiments/statistics.py`).\n"
    )
    L.append("| budget | method | bytes/token | % of full | ppl | Δppl | Δ% | Δ% 95% CI | " + " | ".join(f"ppl @ {k}" for k in labels) + " |")
    L.append("|---|---|---:|---:|---:|---:|---:|---|" + "---:|" * len(labels))
    L.append(
        f"| 100% | full cache (stock) | {stock['bytes_per_token']:.0f} | 100% | {stock['ppl']:.4f} | | | | "
        + " | ".join(f"{stock['by_position'][k]:.3f}" for k in labels)
        + " |"
    )
    for r in rows:
        if r["budget"] is None:
            continue
        over = "" if r["within_budget"] else " ⚠"
        lo, hi = r["delta_pct_ci"]
        L.append(
            f"| {100 * r['budget']:g}% | {r['method']} | {r['bytes_per_token']:.1f} | {_pct(r['fraction_of_full'])}{over} | "
            f"{r['ppl']:.4f} | {r['delta_ppl']:+.4f} | {r['delta_pct']:+.2f}% | [{lo:+.2f}, {hi:+.2f}] | "
            + " | ".join(f"{r['by_position'][k]:.3f}" for k in labels)
            + " |"
        )
    L.append("\n⚠ above the budget (quantisation scales; see above).\n")
    L.append("![Perplexity vs KV bytes](figures/baselines_pareto.png)\n")
    L.append("![Perplexity by context position](figures/baselines_position.png)\n")
    L.append("## Verdict (from the numbers above)\n")
    L.append(verdict_text(record))
    L += frontier_sections(record)
    L.append("\n## Checks\n")
    L.append("Each method at the full budget (capacity = window length; full ranks) against the stock model, largest per-token NLL difference:\n")
    for c in record["full_budget_checks"]:
        L.append(f"* {c['method']}: {c['max_abs_token_nll_diff']:.2e}")
    L.append("\n## Where each implementation comes from\n")
    seen = {}
    for r in rows:
        seen.setdefault(r["family"], r["source"])
    for fam, src in seen.items():
        L.append(f"* **{fam}**: {src}")
    L.append(
        "\nEviction methods run as a permanent per-head mask over a transformers `DynamicCache` through one attention "
        "function (`subspace_ref/lab/baselines/_attention.py`): attending the kept subset equals attending an evicting "
        "cache; H2O loops over query positions inside each layer so a teacher-forced window equals decoding "
        "(tests/test_baselines.py compares with one-token steps). transformers' `QuantizedCache` was not used: its "
        "quanto/hqq backends are not installed (no network) and its fp8 backend returns unquantised states on "
        "the prefill call. Not implemented: ShadowKV, SnapKV, Scissorhands, Quest (seed 001 §11 lists them).\n"
    )
    L.append("Outputs: `baselines.json`, `baselines.csv`, `baselines_tokens.npz` (per-token NLL) in the output folder.\n")
    return "\n".join(L) + "\n"


WORD = {"better": "wins", "worse": "loses", "tie": "ties"}
ISSUE16 = "subspace (issue 16)"


def goal_check(record: dict) -> list[dict]:
    """Issue 16's goal per budget of FRONTIER_BUDGETS: every quantisation, window, StreamingLLM
    and H2O row against the best subspace row with no more bytes."""
    out = []
    for f in record["budgets"]:
        if f not in FRONTIER_BUDGETS:
            continue
        at = [r for r in record["rows"] if r["budget"] == f]
        for r in at:
            fit = [
                s
                for s in at
                if s["family"].startswith("subspace") and s["bytes_per_token"] <= r["bytes_per_token"] + 1e-9
            ]
            if r["family"].startswith("subspace") or not fit:
                continue
            best = min(fit, key=lambda s: s["ppl"])
            pair = next(p for p in record["pairwise"] if p["budget"] == f and p["subspace"] == best["method"] and p["baseline"] == r["method"])
            out.append(
                dict(
                    budget=f,
                    subspace=best["method"],
                    subspace_bytes=best["bytes_per_token"],
                    baseline=r["method"],
                    baseline_bytes=r["bytes_per_token"],
                    pct=100 * (pair["ppl_ratio"] - 1),
                    ci=[100 * x for x in pair["ci"]],
                    holds=pair["ppl_ratio"] < 1,
                    verdict=pair["verdict"],
                )
            )
    return out


def allocation_table(alloc: dict) -> list[str]:
    """One line per layer: each KV head's key basis, r_k x bits_k, value basis (identity: "id"), r_v x bits_v."""
    short = {"post_rope": "post", "pre_rope": "pre", "plane": "planes", "identity": "id", "subspace": ""}
    lines = []
    for li, layer in enumerate(alloc["heads"]):
        cells = [f"h{h}: K {short[c['key_basis']]} {c['rank_k']}x{c['bits_k']}b, V {short[c.get('value_basis', 'subspace')]} {c['rank_v']}x{c['bits_v']}b".replace("V  ", "V ")
                 for h, c in enumerate(layer)]
        lines.append(f"  * layer {li}: " + "; ".join(cells))
    return lines


def frontier_sections(record: dict) -> list[str]:
    L = ["\n## Issue 16: the goal at matched bytes\n"]
    L.append(
        "Goal: at 25% and at 12.5% of the fp16 bytes the best subspace configuration has lower perplexity than every "
        "quantisation, window, StreamingLLM and H2O row at no more bytes. Each baseline row is paired with the best "
        "subspace row of its budget that has no more bytes than it (the quantisation rows sit above their budget, so the "
        "allocator is also run at exactly their bytes: rows '@ N bytes'). Interval: 95%, evaluation windows "
        "resampled, paired.\n"
    )
    L.append("| budget | best subspace row (bytes) | against (bytes) | Δ% ppl | 95% CI | lower ppl? |")
    L.append("|---|---|---|---:|---|---|")
    for g in goal_check(record):
        L.append(
            f"| {100 * g['budget']:g}% | {g['subspace']} ({g['subspace_bytes']:.0f}) | {g['baseline']} ({g['baseline_bytes']:.0f}) | "
            f"{g['pct']:+.2f}% | [{g['ci'][0]:+.2f}, {g['ci'][1]:+.2f}] | {'yes' if g['holds'] else '**no**'} ({WORD[g['verdict']]}) |"
        )
    L.append("\nThe configurations (`subspace_ref/allocation.py`, spec/layer_state.md, spec/quantization.md):\n")
    L.append(
        "* **pre-RoPE r=a/b intB**: static key bases calibrated on un-rotated keys (spec/rope.md P2: c_t = B R_t⁻¹ k_t, "
        "the key rebuilt and rotated to its position), value bases as before, both sides' coefficients int4/int2 with "
        "KIVI's groups (keys per channel over 32 tokens, the unfinished group exact and counted in fp16; values per token; "
        "fp16 scale and zero point each), uniform ranks. **+ sinks 4 + window W**: the same with the first 4 and the "
        "last W tokens exact (their fp16 K/V counted), ranks shrunk to fit."
    )
    L.append(
        "* **allocator p%**: `CalibrationLosses.allocate(compression_ratio=p)` (`subspace_ref.hf.calibration_losses`, "
        "what `subspace-kv calibrate` runs): per layer and KV head the key basis kind (post-RoPE, pre-RoPE, whole RoPE "
        "planes chosen by the same measured loss: spec/rope.md P4, or the identity: plain quantised keys), the value "
        "basis kind (subspace or identity), r_k, r_v and the bits of each side (16/8/4/2), greedy on the lower convex "
        "hulls of the measured calibration losses per byte (the Fisher loss: each token's key and value error weighted by "
        "the gradient of the calibration text's next-token loss, counting the queries that read the token compressed; "
        "`allocation.side_losses`, spec/layer_state.md L6.2), or the best uniform allocation when its loss is lower (L6.1). "
        "**+ sinks 4 + window W**: the same with the first 4 and the last W tokens exact (their fp16 K/V counted), "
        "the allocator spending what is left. **exact tokens chosen**: the (sinks, window) pair of least loss among the "
        "measured ones (`CalibrationLosses.allocate_best`), what `subspace-kv calibrate --max-pre-rope-rank none` does. "
        "**pre-RoPE rank <= R, exact tokens chosen**: what `subspace-kv calibrate` does by default, the same with pre-RoPE "
        "keys of rank at most R = d/4 (spec/layer_state.md L6.4), whose per-token rebuild costs at most R d multiply-adds."
    )
    L.append(
        "* Every subspace row is decoded by the project's cache: teacher-forced through a `SubspaceCache` "
        "(`subspace_ref.hf.teacher_forced`, torch backend; equal to token-by-token decoding, spec/models.md), the "
        "uniform rows with `static_states`, the rows above with `allocated_states(cal.bases(allocation), allocation, "
        "rope=cal.rope)`: one `LayerState` per layer, heads of one configuration in one group (spec/layer_state.md L2); "
        "`subspace + window` with `static_states` under a window mask over its logits (the eviction rows' device). "
        "`subspace_ref/lab/baselines/frontier.py` simulates the allocation rows as exact attention over the state's "
        "reconstruction (spec/quantization.md Q2.1); `tests/test_baselines.py` checks that it and the cache agree.\n"
    )
    heads = [h for r in record["rows"] if "allocation" in r for layer in r["allocation"]["heads"] for h in layer]
    kinds = {k: sum(h["key_basis"] == k for h in heads) for k in ("pre_rope", "post_rope", "plane", "identity")}
    vid = sum(h.get("value_basis") == "identity" for h in heads)
    L.append(
        f"* Key basis kinds over the {len(heads)} heads of every allocation row: {kinds['pre_rope']} pre-RoPE, {kinds['post_rope']} "
        f"post-RoPE, {kinds['plane']} RoPE-plane (spec/rope.md P4), {kinds['identity']} identity; {vid} identity value sides"
        + (": the plane kind was a candidate of every head and never the cheapest for its measured loss, so it changes "
           "no configuration here.\n" if kinds["plane"] == 0 and heads else ".\n")
    )
    for r in record["rows"]:
        if "allocation" in r and r["budget"] in (0.25, 0.125) and r["method"].startswith("allocator"):
            L.append(f"* Where the bytes go, **{r['method']}** ({r['bytes_per_token']:.0f} bytes/token):")
            L += allocation_table(r["allocation"])
    L.append("\n## Scope and limits\n")
    L.append(
        "* One model: the shipped 3.3M-parameter byte-level Llama (4 layers, 2 KV heads of d = 64, context 1024) trained "
        "on the Python standard library. Its attention is mostly local (a 512-token window loses almost nothing), which "
        "favours eviction; a larger model with long-range retrieval, other tokenisers or other text may rank the methods "
        "differently. Nothing here is evidence for a larger model."
    )
    n, T = record["meta"]["eval_windows"], record["geometry"]["context"]
    L.append(
        f"* Sample: {n} held-out windows of {T} tokens ({n * (T - 1)} predicted tokens). The independent unit is the "
        "window (tokens inside one are correlated), so the intervals resample windows; the number was set by the "
        "CPU time of one regeneration on 2 shared cores, and the interval widths above show what it resolves: "
        "differences well inside them are not resolved, and more windows (`--windows`) narrow them as 1/sqrt(n)."
    )
    L.append(
        "* The allocator's loss is measured on the first calibration tokens: a first-order (gradient-weighted) estimate of "
        "each head's effect on the NLL, summed over heads as if their errors were independent; where it ranks "
        "configurations differently from the measured perplexity, the table says so."
    )
    L.append(
        "* Storage against the count: the cache stores bases, scales and zero points in fp16 as counted; float "
        "coefficients and exact tokens are held in float32 and counted at 2 bytes (byte_convention.py); bases are "
        "counted per sequence, although shared."
    )
    return L


def verdict_text(record: dict) -> str:
    """Plain statements from the numbers: per budget, each subspace entry against the best baseline
    that fits the budget (paired by window, 95% interval from resampling whole windows)."""
    out, summary = [], []
    rows = record["rows"]
    for f in record["budgets"]:
        vs = [v for v in record["verdicts"] if v["budget"] == f]
        if not vs:
            continue
        base = vs[0]
        line = [f"* **{100 * f:g}%**: best baseline within the budget *{base['baseline']}* ({base['baseline_family']}), ppl {base['baseline_ppl']:.4f}."]
        for v in vs:
            pct = 100 * (v["ppl_ratio"] - 1)
            over = " (above the budget)" if not v["subspace_within_budget"] else ""
            line.append(f"*{v['subspace']}*{over} {WORD[v['verdict']]}: ppl {v['subspace_ppl']:.4f} ({pct:+.2f}%).")
        out.append(" ".join(line))
        fit = [v for v in vs if v["subspace_within_budget"]] or vs
        best = min(fit, key=lambda v: v["subspace_ppl"])
        summary.append((f, best))
    head = []
    for word in ("better", "tie", "worse"):
        at = [(f, v) for f, v in summary if v["verdict"] == word]
        if at:
            head.append(
                f"{WORD[word]} at " + ", ".join(f"{100 * f:g}% ({v['subspace']}, {100 * (v['ppl_ratio'] - 1):+.2f}% ppl vs {v['baseline']})" for f, v in at)
            )
    text = ["**Summary.** The best subspace entry within each budget " + "; ".join(head) + "."]
    stock = next(r for r in rows if r["budget"] is None)
    wins = sorted((r for r in rows if r["family"] == "sliding window" and r["delta_pct"] < 1.0), key=lambda r: r["fraction_of_full"])
    if wins:
        w = wins[0]
        text.append(
            f"On this model a plain {w['method']} ({100 * w['fraction_of_full']:g}% of the bytes) stays within "
            f"{w['delta_pct']:+.2f}% of the full cache's perplexity {stock['ppl']:.4f}: context further back than that "
            "contributes little to its predictions, so token eviction is cheap here, whereas projection perturbs "
            "every cached key and value, recent ones included."
        )
    pure = [v for v in record["verdicts"] if v["subspace_family"] in ("subspace", "subspace INT8") and v["subspace_within_budget"]]
    if pure:
        b = min(pure, key=lambda v: abs(v["ppl_ratio"] - 1))
        text.append(
            f"Projection alone (no window) comes closest at {100 * b['budget']:g}% with {b['subspace']}: {100 * (b['ppl_ratio'] - 1):+.2f}% vs {b['baseline']}."
        )
    text.append("")
    text += out
    text.append(
        "\n'wins / loses / ties': the 95% interval of the perplexity ratio (subspace over baseline) minus one, whole "
        "evaluation windows resampled, lies below 0 / above 0 / contains 0. Percentages are the perplexity ratio minus one (negative: "
        "subspace better). Every pairing is in `baselines.json` (`pairwise`)."
    )
    return "\n".join(text)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.profile = "tiny"
        args.context = args.context or QUICK_CONTEXT
    ctx = C.make_context(args)
    n = args.windows or (2 if args.quick else DEFAULT_WINDOWS)
    record, tokens = run_comparison(ctx, n, args.batch, args.budgets)
    record["meta"]["runtime_s"] = round(time.perf_counter() - ctx.started, 2)
    record["meta"]["date"] = time.strftime("%Y-%m-%d")
    C.write_json(ctx.out / "baselines.json", record)
    C.write_csv(ctx.out / "baselines.csv", record["rows"])
    np.savez_compressed(ctx.out / "baselines_tokens.npz", **{k.replace("/", "_"): v for k, v in tokens.items()})
    figs = figures(record, ctx.figures)
    command = (
        "subspace-kv baselines"
        + (" --quick" if args.quick else "")
        + (f" --windows {args.windows}" if args.windows else "")
        + ("" if tuple(args.budgets) == EXTRA_BUDGETS else " --budgets " + ",".join(f"{f:g}" for f in args.budgets))
        + ("" if args.model == "default" else f" --model {args.model}")
    )
    if not args.no_docs:
        docs = Path(args.docs)
        (docs / "figures").mkdir(parents=True, exist_ok=True)
        for p in figs:
            shutil.copyfile(p, docs / "figures" / p.name)
        (docs / "baselines.md").write_text(markdown(record, command))
    stock = next(r for r in record["rows"] if r["budget"] is None)
    print(
        f"baselines: {record['meta']['eval_windows']} windows x {ctx.context} tokens, full cache ppl {stock['ppl']:.4f}, "
        f"{record['meta']['runtime_s']:.0f} s -> {ctx.out / 'baselines.json'}"
    )
    for r in record["rows"]:
        if r["budget"] is not None:
            print(f"  {100 * r['budget']:5.1f}%  {r['method']:<36} {100 * r['fraction_of_full']:5.1f}%  ppl {r['ppl']:.4f} ({r['delta_pct']:+.2f}%)")
    print(verdict_text(record))
    return 0


if __name__ == "__main__":  # pragma: no cover
    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(run(p.parse_args()))
