"""``spectra``: is the KV cache low-rank? Direct spectral diagnostics (seed 001 §11 "Hypothesis
validation", seed 003 "Error localization" and "RoPE ablations").

On held-out windows at the model's full context:

* singular values of each layer's and KV head's keys and values (uncentred, all windows stacked),
  post-RoPE (what the cache stores) and pre-RoPE (rotation undone, ``capture(rope=False)``);
  energy kept against rank r and the ranks keeping 90/95/99% of it;
* across chunks: the same windows cut into chunks of C/4 tokens; per chunk the rank keeping 95%
  of *its* energy, the energy the global top-d/4 basis keeps of it, the energy its own top-d/4
  basis keeps (what an oracle per-chunk basis could gain over a static one), and the overlap
  ||B_chunk B_globalᵀ||_F² / r of the two subspaces;
* residual traces (seed 001 §7 "Diagnostics"): rho_k, rho_v of every token against its chunk's
  basis in an adaptive state (spec A7) at r = d/4 and the calibrated tau, with and without
  ``sketch_reset``, with the chunk boundaries (``state.chunk_bounds``) marking the triggers.

Writes ``OUT/spectra.json`` and figures ``spectra_energy.png``, ``spectra_sigma.png``,
``spectra_chunks.png``, ``residual_traces.png``.
"""

from __future__ import annotations

import argparse

import numpy as np

from subspace_ref.lab.experiments import _common as C
from subspace_ref.lab.experiments.calibrate import ensure_calibration, energy_at, energy_ranks, residual_trace, _state_backend
from subspace_ref.hf.calibration_losses import capture_windows, layer_svd

LEVELS = (0.90, 0.95, 0.99)


def _summary(S: np.ndarray) -> dict:
    """Per head: normalised singular values, energy curve, ranks at LEVELS."""
    p = S.astype(np.float64) ** 2
    tot = p.sum(axis=-1, keepdims=True)
    curve = np.cumsum(p, axis=-1) / np.where(tot > 0, tot, 1)
    return dict(
        sigma=(S / np.maximum(S[:, :1], 1e-300)).tolist(),
        energy=curve.tolist(),
        ranks={f"{e:g}": energy_ranks(S, e) for e in LEVELS},
    )


def chunk_stats(X: np.ndarray, n_windows: int, chunk: int, W_global: np.ndarray, r: int) -> dict:
    """Per head and chunk of ``chunk`` tokens (windows never straddled): r95 of the chunk, energy
    kept by the global top-r basis and by the chunk's own top-r basis, subspace overlap."""
    H, N, dim = X.shape
    T = N // n_windows
    out = dict(r95=[], global_energy=[], own_energy=[], overlap=[])
    for h in range(H):
        Bg = W_global[h, :r]
        rows = {k: [] for k in out}
        for w in range(n_windows):
            for a in range(0, T - chunk + 1, chunk):
                Y = X[h, w * T + a : w * T + a + chunk].astype(np.float64)
                _, s, wt = C.svd(Y)
                tot = float((s**2).sum())
                rows["r95"].append(energy_ranks(s[None], 0.95)[0])
                rows["global_energy"].append(float(((Y @ Bg.T) ** 2).sum()) / tot if tot > 0 else 1.0)
                rows["own_energy"].append(float((s[:r] ** 2).sum()) / tot if tot > 0 else 1.0)
                Bc = wt[:r]
                rows["overlap"].append(float(((Bc @ Bg.T) ** 2).sum()) / r)
        for k in out:
            out[k].append(rows[k])
    return out


def spectra_run(ctx: C.Context) -> dict:
    record, svd_cal = ensure_calibration(ctx)
    p, d = ctx.profile, ctx.d
    ids = ctx.eval_windows(p.spectra_windows)
    n, T = ids.shape
    steps = ctx.bar(total=4, desc="spectra")
    post = capture_windows(ctx.model, ids, queries=False, batch=p.batch)
    svd_post = layer_svd(post)
    steps.update()
    pre = capture_windows(ctx.model, ids, rope=False, queries=False, batch=p.batch)
    svd_pre = layer_svd(pre)
    del pre
    steps.update()
    r4 = C.ranks_from([1 / 4], d)[0]
    chunk = max(8, T // 4)
    layers = []
    for li, (sp, sq, layer) in enumerate(zip(svd_post, svd_pre, post.layers)):
        entry = {}
        for side, key in (("keys", "k"), ("values", "v")):
            X = layer.keys if key == "k" else layer.values
            entry[side] = dict(
                post=_summary(sp["S" + key]), pre=_summary(sq["S" + key]),
                energy_at_d4_post=energy_at(sp["S" + key], r4).tolist(), energy_at_d4_pre=energy_at(sq["S" + key], r4).tolist(),
                chunks=chunk_stats(X, n, chunk, svd_cal[li]["W" + key], r4),
            )
        layers.append(entry)
    steps.update()
    # residual traces on the first window at r = d/4 (the nearest calibrated online rank)
    online = record["online_ranks"]
    rt = min(online, key=lambda x: abs(x - r4))
    taus = record["tau"]["by_rank"][str(rt)]
    engine = _state_backend(getattr(ctx.args, "backend", "torch"))
    traces = []
    for li, layer in enumerate(post.layers):
        per = {}
        for reset in (False, True):
            rk, rv, st = residual_trace(layer.keys[:, :T], layer.values[:, :T], rt, tau_k=taus["tau_k"][li], tau_v=taus["tau_v"][li],
                                        max_chunk=p.max_chunk, sketch_reset=reset, engine=engine)
            bounds = [st.chunk_bounds(h) for h in range(st.heads)]
            per["reset" if reset else "paper"] = dict(
                rho_k=np.round(rk, 4).tolist(), rho_v=np.round(rv, 4).tolist(),
                chunk_starts=[[a for a, _ in b] for b in bounds], chunks=[len(b) for b in bounds],
                above_tau_k=float((rk[:, rt:] > taus["tau_k"][li]).mean()), above_tau_v=float((rv[:, rt:] > taus["tau_v"][li]).mean()),
            )
        traces.append(dict(layer=li, tau_k=taus["tau_k"][li], tau_v=taus["tau_v"][li], **per))
    steps.update()
    steps.close()
    out = dict(
        meta=C.meta(ctx, "spectra"), d=d, windows=n, context=T, tokens=int(n * T), chunk=chunk, rank_d4=r4,
        trace_rank=rt, trace_max_chunk=p.max_chunk, levels=list(LEVELS), layers=layers, traces=traces,
    )
    C.write_json(ctx.out / "spectra.json", out)
    plot(ctx, out)
    return out


# ----------------------------------------------------------------------------- figures
def plot(ctx: C.Context, out: dict) -> None:
    plt = C.pyplot()
    L = len(out["layers"])
    d = out["d"]
    fig, axes = plt.subplots(2, L, figsize=(2.2 * L + 1, 4.4), sharey=True, squeeze=False)
    for li, entry in enumerate(out["layers"]):
        for row, side in enumerate(("keys", "values")):
            ax = axes[row, li]
            for h, curve in enumerate(entry[side]["post"]["energy"]):
                ax.plot(range(1, d + 1), curve, color=f"C{h}", lw=1, label=f"head {h} post-RoPE" if side == "keys" else f"head {h}")
                if side == "keys":
                    ax.plot(range(1, d + 1), entry[side]["pre"]["energy"][h], color=f"C{h}", lw=1, ls="--", label=f"head {h} pre-RoPE")
            ax.axvline(d / 4, color="grey", lw=0.6, ls=":")
            ax.axhline(0.95, color="grey", lw=0.6, ls="--")
            ax.set_title(f"layer {li} {side}")
            ax.set_xlabel("rank r")
            ax.set_ylim(0, 1.01)
            if li == 0:
                ax.set_ylabel("energy kept")
    C.legend_right(fig, axes[0, 0])
    fig.suptitle(f"Energy of K/V kept by the top-r directions ({out['tokens']} held-out tokens); dotted: d/4, dashed: 95%")
    fig.tight_layout()
    C.save_figure(fig, ctx.figures / "spectra_energy.png")

    fig, axes = plt.subplots(1, 2, figsize=(7, 3.0), sharey=True)
    for col, side in enumerate(("keys", "values")):
        ax = axes[col]
        for li, entry in enumerate(out["layers"]):
            for h, s in enumerate(entry[side]["post"]["sigma"]):
                ax.semilogy(range(1, len(s) + 1), np.maximum(s, 1e-8), color=f"C{li}", lw=0.8, alpha=0.9, label=f"layer {li}" if h == 0 else None)
        ax.set_title(f"{side}: σ_i / σ_1 (post-RoPE), every head")
        ax.set_xlabel("i")
    axes[-1].legend(**C.LEGEND_OUTSIDE)
    fig.tight_layout()
    C.save_figure(fig, ctx.figures / "spectra_sigma.png")

    fig, axes = plt.subplots(1, 2, figsize=(7.5, 3.0))
    labels, r95, gl, own = [], [], [], []
    for li, entry in enumerate(out["layers"]):
        for side in ("keys", "values"):
            ch = entry[side]["chunks"]
            for h in range(len(ch["r95"])):
                labels.append(f"L{li}{side[0]}{h}")
                r95.append(ch["r95"][h])
                gl.append(ch["global_energy"][h])
                own.append(ch["own_energy"][h])
    axes[0].boxplot(r95, showfliers=True, flierprops=dict(markersize=2))
    axes[0].set_xticks(range(1, len(labels) + 1), labels, rotation=90, fontsize=8)
    axes[0].set_ylabel(f"rank for 95% energy of a {out['chunk']}-token chunk")
    axes[0].axhline(d / 4, color="grey", lw=0.6, ls=":")
    x = np.arange(len(labels))
    axes[1].bar(x - 0.2, [np.mean(g) for g in gl], width=0.4, label="global (static) top-d/4 basis")
    axes[1].bar(x + 0.2, [np.mean(o) for o in own], width=0.4, label="chunk's own top-d/4 basis")
    axes[1].set_xticks(x, labels, rotation=90, fontsize=8)
    axes[1].set_ylabel("energy of the chunk kept (mean)")
    axes[1].set_ylim(0, 1)
    axes[1].legend(fontsize=8)
    fig.suptitle("Across chunks: L<layer><k|v><head>")
    fig.tight_layout()
    C.save_figure(fig, ctx.figures / "spectra_chunks.png")

    traces = out["traces"]
    show = sorted({0, len(traces) - 1})
    fig, axes = plt.subplots(len(show) * 2, 1, figsize=(7.5, 2.0 * 2 * len(show)), sharex=True, squeeze=False)
    for i, li in enumerate(show):
        tr = traces[li]
        for j, variant in enumerate(("paper", "reset")):
            ax = axes[2 * i + j, 0]
            v = tr[variant]
            ax.plot(v["rho_k"][0], lw=0.5, color="C0", label="ρ_k (head 0)")
            ax.plot(v["rho_v"][0], lw=0.5, color="C1", label="ρ_v (head 0)")
            ax.axhline(tr["tau_k"], color="C0", ls="--", lw=0.7)
            ax.axhline(tr["tau_v"], color="C1", ls="--", lw=0.7)
            for s in v["chunk_starts"][0][1:]:
                ax.axvline(s, color="k", lw=0.3, alpha=0.5)
            name = "paper sketches" if variant == "paper" else "sketch_reset"
            ax.set_title(f"layer {li}, {name}: {v['chunks'][0]} chunks (grey lines = triggers), τ_k={tr['tau_k']:.2f}, τ_v={tr['tau_v']:.2f}", fontsize=8)
            ax.set_ylim(0, 1)
            ax.set_ylabel("ρ")
    axes[0, 0].legend(fontsize=8, loc="lower right")
    axes[-1, 0].set_xlabel("position")
    fig.tight_layout()
    C.save_figure(fig, ctx.figures / "residual_traces.png")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_common_arguments(parser)


def run(args: argparse.Namespace) -> int:
    ctx = C.make_context(args)
    out = spectra_run(ctx)
    print(f"spectra: {out['tokens']} held-out tokens -> {ctx.out / 'spectra.json'}")
    for li, e in enumerate(out["layers"]):
        for side in ("keys", "values"):
            print(f"  layer {li} {side:<6}: r95 post-RoPE {e[side]['post']['ranks']['0.95']}, pre-RoPE {e[side]['pre']['ranks']['0.95']}; "
                  f"energy at d/4 {[round(x, 3) for x in e[side]['energy_at_d4_post']]}")
    return 0

