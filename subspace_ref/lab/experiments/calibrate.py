"""``calibrate``: per-layer, per-head static bases from calibration text, ranks by energy, the
logit scale gamma by MSE on held-out calibration text, and the adaptive thresholds tau.

Data: windows of the stdlib corpus *training* split (seed 1 for the bases, seed 2 for the
held-out calibration set that fits gamma and measures residuals); never the evaluation split.

* Bases (spec A5, seed 001 §10, seed 003 SubSpace-G): the SVD of every layer's and KV head's
  post-RoPE keys and values over all calibration tokens (uncentred). The full right-singular
  basis is saved, so every rank -- uniform r, or per head the least r keeping a fraction
  e in {90, 95, 98, 99}% of the energy -- is its first rows.
* gamma (seed 001 §4): "unit" (1), "paper" (sqrt(r/d)), and "mse", the least-squares fit of the
  exact logits by the projected ones on the *held-out* calibration set (spec A5 step 4). Fitted
  on the calibration tokens themselves it is exactly 1 -- with B the top eigenvectors of KᵀK,
  (I - P_B) KᵀK P_B = 0 kills the cross term -- which the output records as a check.
* tau (seed 001 §10): run an adaptive state whose only trigger is the maximum chunk length L over
  the held-out calibration windows, record every post-warm-up token's relative residuals
  rho_k, rho_v (spec A7 step 2) against the basis of its chunk, and set tau_k, tau_v at their
  95th percentiles, per layer and rank.

Writes ``OUT/calibration.json`` (ranks, gammas, residual percentiles, tau, provenance) and
``OUT/calibration/svd.npz`` (per layer: right-singular vectors and singular values).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from subspace_ref.lab.experiments import _common as C
from subspace_ref.hf.calibration_losses import capture_windows, layer_svd

if TYPE_CHECKING:
    from subspace_ref.calibration import StaticBasis

TAU_PERCENTILE = 95.0
PERCENTILES = (50, 90, 95, 99)


# ----------------------------------------------------------------------------- capture / SVD
def energy_ranks(S: np.ndarray, energy: float) -> list[int]:
    """Per head, the least r keeping ``energy`` of the squared singular values (spec A5 step 2)."""
    from subspace_ref.calibration import energy_rank

    return [energy_rank(S[h], energy) for h in range(S.shape[0])]


def energy_at(S: np.ndarray, r: int) -> np.ndarray:
    """Per head, the fraction of energy in the top r directions."""
    p = S.astype(np.float64) ** 2
    tot = p.sum(axis=-1)
    return np.where(tot > 0, p[..., :r].sum(axis=-1) / np.where(tot > 0, tot, 1), 1.0)


def basis_from_svd(entry: dict, rank_k, rank_v, gamma) -> "StaticBasis":
    """A :class:`~subspace_ref.StaticBasis` of one layer: each head's first rank rows, zero
    padded; ranks an int or one per head; gamma a number or one per head."""
    from subspace_ref.calibration import StaticBasis

    H, dim, _ = entry["Wk"].shape
    dim_v = entry["Wv"].shape[-1]
    rk = [int(rank_k)] * H if np.isscalar(rank_k) else [int(x) for x in rank_k]
    rv = [int(rank_v)] * H if np.isscalar(rank_v) else [int(x) for x in rank_v]
    B = np.zeros((H, max(rk), dim))
    E = np.zeros((H, max(rv), dim_v))
    for h in range(H):
        B[h, : rk[h]] = entry["Wk"][h, : rk[h]]
        E[h, : rv[h]] = entry["Wv"][h, : rv[h]]
    g = np.broadcast_to(np.asarray(gamma, dtype=np.float64), (H,)).copy()
    return StaticBasis(B=B, E=E, gamma=g, rank_k=tuple(rk), rank_v=tuple(rv))


def _spread(n: int, m: int) -> np.ndarray:
    return np.unique(np.linspace(0, n - 1, num=min(n, m)).round().astype(int))


def mse_gamma_heldout(entry: dict, layer_cap, rank_k, max_queries: int = 4096, max_keys: int = 2048) -> np.ndarray:
    """Per KV head, gamma minimising the squared error of the projected logits against the exact
    ones on held-out calibration tokens (spec A5 step 4, but on data the basis was not fit to).
    Evenly spaced subsets of at most ``max_queries`` queries and ``max_keys`` keys bound the cost."""
    from subspace_ref.calibration import mse_gamma

    K = layer_cap.keys
    Q = layer_cap.queries
    H = K.shape[0]
    group = Q.shape[0] // H
    basis = basis_from_svd(entry, rank_k, 1, 1.0)
    kk = K[:, _spread(K.shape[1], max_keys)]
    qi = _spread(Q.shape[1], max(1, max_queries // group))
    Qg = Q[:, qi].reshape(H, group * qi.size, Q.shape[2])
    return mse_gamma(Qg, kk, basis.B)


def in_sample_gamma(model, ids: np.ndarray, rank: int) -> float:
    """gamma="mse" fitted on the calibration tokens themselves (one window): exactly 1 up to
    rounding (module docstring). Returns the largest |gamma - 1| over layers and heads."""
    cap = capture_windows(model, ids[:1])
    worst = 0.0
    for layer in cap.layers:
        from subspace_ref import calibrate as _cal

        b = _cal(layer.keys, layer.values, rank_k=rank, rank_v=rank, queries=layer.queries, gamma="mse")
        worst = max(worst, float(np.abs(b.gamma - 1.0).max()))
    return worst


# ----------------------------------------------------------------------------- residuals and tau
def _state_backend(preferred: str) -> str:
    if preferred == "numpy":
        return "numpy"
    try:
        from subspace_ref.registry import get_backend

        return "torch" if get_backend("torch").availability() else "numpy"
    except (ValueError, ImportError):
        return "numpy"


def residual_trace(
    K: np.ndarray,
    V: np.ndarray,
    rank: int,
    *,
    tau_k: float = 0.999999,
    tau_v: float = 0.999999,
    max_chunk: int = 256,
    sketch_reset: bool = False,
    engine: str = "numpy",
):
    """Append one window's keys/values (H, T, d) to an adaptive state (spec A7) and return
    ``(rho_k, rho_v, state)``: per head and token the relative residual of the token against the
    basis of its chunk (A7 step 2, recomputed from the stored coefficients), and the state (its
    ``chunk_bounds`` mark the triggers). With the default tau only the length L triggers."""
    from subspace_ref import SubspaceState
    from subspace_ref.arrays import to_numpy

    H, T, d = K.shape
    st = SubspaceState.adaptive(  # track=False: A7's residuals with the length trigger only (A7.4 grows no row at tau ~ 1)
        H, d, V.shape[2], rank_k=rank, rank_v=rank, tau_k=tau_k, tau_v=tau_v, max_chunk=max_chunk, sketch_reset=sketch_reset, dtype=np.float64, track=False
    )
    if engine != "numpy":
        import torch

        st = st.to(engine)
        st.append(torch.from_numpy(np.ascontiguousarray(K)), torch.from_numpy(np.ascontiguousarray(V)))
    else:
        st.append(K, V)
    lay = st.layout
    ck = to_numpy(lay.key_coef)[0, :, :T].astype(np.float64)
    cv = to_numpy(lay.value_coef)[0, :, :T].astype(np.float64)

    def rho(X, Cf):
        nx = (X * X).sum(-1)
        res = np.maximum(nx - (Cf * Cf).sum(-1), 0.0)
        return np.where(nx > 0, np.sqrt(res / np.where(nx > 0, nx, 1.0)), 0.0)

    return rho(K, ck), rho(V, cv), st


def measure_tau(holdout_cap, n_windows: int, ranks: list[int], max_chunk: int, backend: str, bar=None) -> dict:
    """Residual percentiles and tau (95th percentile) per rank and layer from the held-out
    calibration capture (windows concatenated: ``n_windows`` equal parts)."""
    engine = _state_backend(backend)
    out = {}
    jobs = [(r, li) for r in ranks for li in range(len(holdout_cap.layers))]
    it = bar(jobs, desc="tau: residual percentiles") if bar else jobs
    per: dict = {}
    for r, li in it:
        layer = holdout_cap.layers[li]
        T = layer.keys.shape[1] // n_windows
        warm = r  # spec A7 step 0: the first W = min(rank_k, rank_v) = r tokens are stored exactly
        rk, rv = [], []
        for w in range(n_windows):
            sl = slice(w * T, (w + 1) * T)
            a, b, _ = residual_trace(layer.keys[:, sl], layer.values[:, sl], r, max_chunk=max_chunk, engine=engine)
            rk.append(a[:, warm:].ravel())
            rv.append(b[:, warm:].ravel())
        per[(r, li)] = (np.concatenate(rk), np.concatenate(rv))
    for r in ranks:
        entry = {"k": {}, "v": {}, "tau_k": [], "tau_v": []}
        for side in ("k", "v"):
            for p in PERCENTILES:
                entry[side][f"p{p}"] = [float(np.percentile(per[(r, li)][0 if side == "k" else 1], p)) for li in range(len(holdout_cap.layers))]
        entry["tau_k"] = [float(np.clip(x, 0.01, 0.999)) for x in entry["k"][f"p{int(TAU_PERCENTILE)}"]]
        entry["tau_v"] = [float(np.clip(x, 0.01, 0.999)) for x in entry["v"][f"p{int(TAU_PERCENTILE)}"]]
        out[str(r)] = entry
    return dict(percentile=TAU_PERCENTILE, max_chunk=max_chunk, engine=engine, by_rank=out)


# ----------------------------------------------------------------------------- the subcommand
def calibrate_run(ctx: C.Context) -> dict:
    """Everything above for ``ctx``; writes and returns the calibration record."""
    p, d = ctx.profile, ctx.d
    model = ctx.model
    steps = ctx.bar(total=5, desc="calibrate")
    cal_ids = ctx.calib_windows()
    cap = capture_windows(model, cal_ids, queries=False, batch=p.batch)
    steps.update()
    svd = layer_svd(cap)
    n_tokens = cap.num_tokens
    del cap
    try:  # pre-RoPE keys (rotation undone) for the seed 003 RoPE ablation
        svd_pre = layer_svd(capture_windows(model, cal_ids, rope=False, queries=False, batch=p.batch))
    except ValueError:  # no rotary module
        svd_pre = None
    steps.update()
    hold_ids = ctx.holdout_windows()
    hold = capture_windows(model, hold_ids, batch=p.batch)
    steps.update()
    uniform = C.ranks_from(p.rank_fractions, d)
    online = C.ranks_from(p.online_fractions, d)
    energies = {f"{e:g}": {"k": [energy_ranks(s["Sk"], e) for s in svd], "v": [energy_ranks(s["Sv"], e) for s in svd]} for e in p.energies}
    gamma_mse: dict[str, list] = {}
    for r in sorted(set(uniform) | set(online)):
        gamma_mse[f"r{r}"] = [mse_gamma_heldout(s, lc, r).tolist() for s, lc in zip(svd, hold.layers)]
    for e, ranks in energies.items():
        gamma_mse[f"e{e}"] = [mse_gamma_heldout(s, lc, rk).tolist() for s, lc, rk in zip(svd, hold.layers, ranks["k"])]
    steps.update()
    tau_ranks = sorted(set(online) | set(C.ranks_from(p.bounds_fractions, d)))
    tau = measure_tau(hold, len(hold_ids), tau_ranks, p.max_chunk, getattr(ctx.args, "backend", "torch"), bar=ctx.bar)
    steps.update()
    steps.close()
    ratio = []
    for r in uniform:
        for g_layer in gamma_mse[f"r{r}"]:
            ratio += [g / math.sqrt(r / d) for g in g_layer]
    try:
        insample = in_sample_gamma(model, cal_ids, C.ranks_from([1 / 4], d)[0])
    except np.linalg.LinAlgError:  # the library's calibrate uses gesdd, which can fail to converge
        insample = None
    svd_path = ctx.out / "calibration" / "svd.npz"
    svd_path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {f"{k}_{i}": v for i, s in enumerate(svd) for k, v in s.items()}
    if svd_pre is not None:
        arrays.update({f"pre{k}_{i}": v for i, s in enumerate(svd_pre) for k, v in s.items()})
    np.savez_compressed(svd_path, **arrays)
    record = dict(
        meta=C.meta(ctx, "calibrate"),
        d=d,
        d_v=int(svd[0]["Wv"].shape[-1]),
        layers=len(svd),
        kv_heads=int(svd[0]["Wk"].shape[0]),
        calibration_tokens=n_tokens,
        holdout_tokens=hold.num_tokens,
        uniform_ranks=uniform,
        online_ranks=online,
        energy_ranks=energies,
        energy_at_rank={str(r): {"k": [energy_at(s["Sk"], r).tolist() for s in svd], "v": [energy_at(s["Sv"], r).tolist() for s in svd]} for r in uniform},
        gamma_mse=gamma_mse,
        gamma_mse_over_paper=dict(min=min(ratio), median=float(np.median(ratio)), max=max(ratio), n=len(ratio)),
        gamma_in_sample_max_abs_deviation=insample,
        tau=tau,
        energy_at_rank_pre_rope=None if svd_pre is None else {str(r): [energy_at(s["Sk"], r).tolist() for s in svd_pre] for r in uniform},
        files=dict(svd=str(svd_path.relative_to(ctx.out)), pre_rope=svd_pre is not None),
    )
    C.write_json(ctx.out / "calibration.json", record)
    return record


def load_svd(out: Path, pre_rope: bool = False) -> list[dict] | None:
    """Per-layer SVDs saved by ``calibrate`` (``pre_rope``: of the un-rotated keys; None if absent)."""
    prefix = "pre" if pre_rope else ""
    with np.load(Path(out) / "calibration" / "svd.npz") as z:
        layers = sorted({int(k.split("_")[1]) for k in z.files if k.startswith(prefix + "Wk_")})
        if not layers:
            return None
        return [{k: z[f"{prefix}{k}_{i}"] for k in ("Wk", "Sk", "Wv", "Sv")} for i in layers]


def _matches(record: dict, ctx: C.Context) -> bool:
    return C.matches(record, ctx) and (ctx.out / record["files"]["svd"]).exists()


def ensure_calibration(ctx: C.Context) -> tuple[dict, list[dict]]:
    """The calibration of this model, context and profile from ``OUT`` (computed when missing or
    stale) and the per-layer SVDs."""
    record = C.read_json(ctx.out / "calibration.json")
    if record is None or not _matches(record, ctx):
        record = calibrate_run(ctx)
    return record, load_svd(ctx.out)


def static_basis(record: dict, svd: list[dict], layer: int, *, rank=None, energy: str | None = None, gamma: str = "unit") -> "StaticBasis":
    """The saved basis of one layer at a uniform ``rank`` or per-head ``energy`` ranks, with gamma
    "unit", "paper" (sqrt(r_h/d)) or "mse" (the held-out fit)."""
    d = record["d"]
    if energy is not None:
        rk, rv = record["energy_ranks"][energy]["k"][layer], record["energy_ranks"][energy]["v"][layer]
        key = f"e{energy}"
    else:
        rk = rv = int(rank)
        key = f"r{int(rank)}"
    ranks = rk if not np.isscalar(rk) else [rk] * record["kv_heads"]
    if gamma == "unit":
        g = 1.0
    elif gamma == "paper":
        g = np.sqrt(np.asarray(ranks, dtype=np.float64) / d)
    elif gamma == "mse":
        g = np.asarray(record["gamma_mse"][key][layer])
    else:
        raise ValueError(f"gamma must be unit, paper or mse, got {gamma!r}")
    return basis_from_svd(svd[layer], rk, rv, g)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_common_arguments(parser)


def run(args: argparse.Namespace) -> int:
    ctx = C.make_context(args)
    rec = calibrate_run(ctx)
    print(
        f"calibrate: {rec['layers']} layers x {rec['kv_heads']} KV heads, d={rec['d']}, {rec['calibration_tokens']} calibration tokens -> {ctx.out / 'calibration.json'}"
    )
    for e, ranks in rec["energy_ranks"].items():
        print(f"  energy {float(e):.0%}: key ranks {ranks['k']}, value ranks {ranks['v']}")
    g = rec["gamma_mse_over_paper"]
    print(
        f"  gamma_mse / sqrt(r/d): median {g['median']:.3f} (min {g['min']:.3f}, max {g['max']:.3f}); in-sample |gamma_mse - 1| <= {rec['gamma_in_sample_max_abs_deviation']}"
    )
    for r, t in rec["tau"]["by_rank"].items():
        print(f"  r={r}: tau_k per layer {[round(x, 3) for x in t['tau_k']]}, tau_v {[round(x, 3) for x in t['tau_v']]}")
    return 0
