"""``check(q, K, V, state)``: every bound of spec/bounds.md measured on one state (spec B0).

Given the exact history a state was built from, the report holds, for every statement of
:data:`subspace_ref.lab.bounds.statements.CLAIMS`, the measured quantity, the bound, their ratio,
whether it held (within the rounding allowance of spec B0) and whether the statement is a
guarantee for this input (its condition is met) or the paper's form that is known to fail.
Each row is the worst over heads; the seeds' predictors (FD eps, residuals per chunk, observed
errors) are reported beside the rows.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from subspace_ref.linalg import svd

from subspace_ref import frequent_directions as fd
from subspace_ref.arrays import to_numpy
from subspace_ref.jsonable import jsonable
from subspace_ref.lab.bounds import statements as st

#: Multiple of n*u in every rounding allowance (spec B0): covers both sides of a comparison,
#: each accumulating at most ~n*u relative error (Higham's gamma_n) in dot products, norms and SVDs.
ROUNDING_FACTOR = 8.0

#: Below this magnitude a square underflows (float64): norms of such vectors compute as 0, so
#: every linear allowance has this absolute floor per accumulated term (spec B0).
UNDERFLOW = math.sqrt(np.finfo(np.float64).tiny)

#: The states whose coefficients are orthogonal projections, k_hat_i = P_{B_j} k_i (spec A6, A7).
PROJECTION_KINDS = ("static", "adaptive")


@dataclass
class BoundRow:
    """One statement evaluated on one input: the worst head (largest measured/bound)."""

    id: str
    title: str
    measured: float
    bound: float
    ratio: float  # measured / bound; nan when measured is within the rounding allowance
    held: bool
    guarantee: bool
    status: str
    allowance: float
    where: str
    applicable: bool = True
    reason: str = ""  # why a paper form is (or is not) guaranteed here

    def to_dict(self) -> dict:
        return {k: jsonable(v) for k, v in asdict(self).items()}


@dataclass
class BoundsReport:
    """Rows (one per statement of spec/bounds.md), predictors and facts about the input."""

    rows: list[BoundRow]
    predictors: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    def row(self, claim_id: str) -> BoundRow:
        for r in self.rows:
            if r.id == claim_id:
                return r
        raise KeyError(f"no row {claim_id!r}; rows are {[r.id for r in self.rows]}")

    def __getitem__(self, claim_id: str) -> BoundRow:
        return self.row(claim_id)

    @property
    def violations(self) -> list[BoundRow]:
        """Guaranteed rows that did not hold: each one is a bug in the code or in spec/bounds.md."""
        return [r for r in self.rows if r.applicable and r.guarantee and not r.held]

    @property
    def failures(self) -> list[BoundRow]:
        """Rows (guaranteed or not) whose measured quantity exceeded the bound."""
        return [r for r in self.rows if r.applicable and not r.held]

    def to_dict(self) -> dict:
        return {
            "rows": [r.to_dict() for r in self.rows],
            "predictors": jsonable(self.predictors),
            "info": jsonable(self.info),
        }

    def __str__(self) -> str:
        head = f"{'claim':<7} {'measured':>11} {'bound':>11} {'ratio':>9}  {'held':<4}  {'status':<44} where"
        lines = [self._title(), head, "-" * len(head)]
        for r in self.rows:
            if not r.applicable:
                lines.append(f"{r.id:<7} {'':>11} {'':>11} {'':>9}  {'':<4}  {r.status:<44}")
                continue
            held = "yes" if r.held else "NO"
            lines.append(f"{r.id:<7} {r.measured:>11.4g} {r.bound:>11.4g} {_fmt_ratio(r.ratio):>9}  {held:<4}  {r.status:<44} {r.where}")
        p = self.predictors
        lines.append("")
        lines.append(
            "predictors: logit error {0:.4g}, output error {1:.4g}, max chunk residual K {2:.4g} / V {3:.4g}, "
            "FD eps K {4} / V {5}".format(
                p["logit_error"], p["output_error"], p["max_chunk_residual_k"], p["max_chunk_residual_v"],
                _fmt_opt(p["fd_eps_k"]), _fmt_opt(p["fd_eps_v"]),
            )
        )
        if self.violations:
            lines.append("VIOLATED GUARANTEES: " + ", ".join(r.id for r in self.violations))
        return "\n".join(lines)

    def _title(self) -> str:
        i = self.info
        return (
            f"bounds of spec/bounds.md on a {i['kind']} state: {i['heads']} KV heads, {i['query_heads']} query heads, "
            f"d={i['d']}, d_v={i['d_v']}, T={i['tokens']}, chunks={i['chunks']}, gamma={[round(g, 4) for g in i['gamma']]}"
        )


def _fmt_ratio(x: float) -> str:
    return "inf" if x == math.inf else ("~0 (rnd)" if x != x else f"{x:.3g}")


def _fmt_opt(x) -> str:
    return "n/a" if x is None else f"{x:.4g}"


# --------------------------------------------------------------------------- per-head quantities
@dataclass
class _Head:
    """Everything one KV head contributes to the statements."""

    K: np.ndarray
    V: np.ndarray
    K_hat: np.ndarray
    V_hat: np.ndarray
    gamma: float
    chunks: list
    key_residual_ops: list  # ||K_j (I - P_{B_j})||_op per non-empty chunk (the paper's dK_j)
    value_residual_ops: list
    key_recon_row_max: float  # max_i ||k_i - k_hat_i||
    key_hat_row_max: float  # max_i ||k_hat_i||
    key_row_max: float
    key_recon_op: float  # ||K - K_hat||_op
    key_gamma_recon_op: float  # ||K - gamma K_hat||_op
    value_recon_ops: list  # ||V_j - V_hat_j||_op per chunk
    value_row_max: float
    value_hat_row_max: float
    value_frob: float
    energy_proj: float  # sum_j ||V_j P_{E_j}||_F^2 / ||V||_F^2
    energy_kept: float  # 1 - ||V - V_hat||_F^2 / ||V||_F^2
    key_orth_error: float  # max_j max |B_j B_j^T - I| over the non-zero rows
    value_orth_error: float
    # max_i |k_hat_i - P_{B_j} k_i|: not rounding only when a chunk's bases grew after token i was
    # stored (spec A7.4 step 1), so k_hat_i projects on the rows in use then
    key_growth_gap: float = 0.0
    value_growth_gap: float = 0.0


def _op(x: np.ndarray) -> float:
    return float(np.linalg.norm(x, 2)) if x.size else 0.0


def _rows(x: np.ndarray) -> np.ndarray:
    return np.linalg.norm(x, axis=-1) if x.size else np.zeros(0)


def _head(state, h: int, K: np.ndarray, V: np.ndarray, K_hat: np.ndarray, V_hat: np.ndarray) -> _Head:
    lay = state.layout
    host = lay.map_arrays(lambda _, x: to_numpy(x))
    kb = host.basis("key", (0, h), np.float64)  # decoded as stored (spec/storage.md S2)
    vb = host.basis("value", (0, h), np.float64)
    chunks = [(a, b, j) for j, (a, b) in enumerate(state.chunk_bounds(h)) if b > a]
    key_res, val_res, val_rec, proj_energy, gap_k, gap_v = [], [], [], 0.0, 0.0, 0.0
    for a, b, j in chunks:
        B, E = kb[j], vb[j]  # zero padding rows add nothing to P = B^T B
        key_res.append(_op(K[a:b] - (K[a:b] @ B.T) @ B))
        val_res.append(_op(V[a:b] - (V[a:b] @ E.T) @ E))
        gap_k = max(gap_k, float(_rows(K_hat[a:b] - (K[a:b] @ B.T) @ B).max(initial=0.0)))
        gap_v = max(gap_v, float(_rows(V_hat[a:b] - (V[a:b] @ E.T) @ E).max(initial=0.0)))
        val_rec.append(_op(V[a:b] - V_hat[a:b]))
        proj_energy += float(np.sum((V[a:b] @ E.T) ** 2))
    gamma = float(to_numpy(lay.gamma)[h])
    v_frob2 = float(np.sum(V * V))
    return _Head(
        K=K, V=V, K_hat=K_hat, V_hat=V_hat, gamma=gamma, chunks=chunks,
        key_residual_ops=key_res, value_residual_ops=val_res,
        key_recon_row_max=float(_rows(K - K_hat).max(initial=0.0)),
        key_hat_row_max=float(_rows(K_hat).max(initial=0.0)),
        key_row_max=float(_rows(K).max(initial=0.0)),
        key_recon_op=_op(K - K_hat),
        key_gamma_recon_op=_op(K - gamma * K_hat),
        value_recon_ops=val_rec,
        value_row_max=float(_rows(V).max(initial=0.0)),
        value_hat_row_max=float(_rows(V_hat).max(initial=0.0)),
        value_frob=math.sqrt(v_frob2),
        energy_proj=proj_energy / v_frob2 if v_frob2 > 0 else 1.0,
        energy_kept=1.0 - float(np.sum((V - V_hat) ** 2)) / v_frob2 if v_frob2 > 0 else 1.0,
        key_orth_error=_orth_error(kb, chunks),
        value_orth_error=_orth_error(vb, chunks),
        key_growth_gap=gap_k,
        value_growth_gap=gap_v,
    )


def _softmax(x: np.ndarray) -> np.ndarray:
    w = np.exp(x - x.max())
    return w / w.sum()


# --------------------------------------------------------------------------- evaluation of one query head
@dataclass
class _Eval:
    """One statement on one head: measured, bound, allowance, whether its condition is met."""

    measured: float
    bound: float
    allowance: float
    guarantee: bool
    applicable: bool = True
    basis: str = ""  # why the statement is (or is not) a guarantee here


def _ratio(m: float, b: float, allowance: float) -> float:
    # a measured value within the rounding allowance says nothing about tightness: nan
    if m <= allowance:
        return math.nan
    return m / b if b > 0 else math.inf


def _worst_key(ev: _Eval) -> tuple:
    r = _ratio(ev.measured, ev.bound, ev.allowance)
    return (r == r, r if r == r else 0.0, ev.measured)


def check(q: Any, K: Any, V: Any, state, scale: float | None = None) -> BoundsReport:
    """Evaluate every statement of spec/bounds.md (B1-B8) on an unbatched ``state`` built from the
    exact history K (H, T, d), V (H, T, d_v), for queries q (H_q, d) (spec B0).

    Logits use the state's own gamma per KV head (``layout.gamma``) and ``scale`` (default
    1/sqrt(d)); query head hq reads KV head hq // (H_q / H) (grouped-query attention). The
    approximate output is the one :func:`subspace_ref.attend` returns; the approximate logits are
    gamma * scale * K_hat q with K_hat = ``state.reconstruct()``, which is what attend computes in
    coefficient space (spec A2, A3; ``predictors["attend_consistency"]`` is the difference).
    Each row reports the worst head; it held when every head held.
    """
    from subspace_ref import attend

    if state.batched:
        raise ValueError("check takes an unbatched state (built without batch=...); check each sequence's own state")
    q, K, V = (np.asarray(x) for x in (q, K, V))
    H, d, d_v, T = state.heads, state.d, state.d_v, state.num_tokens
    if K.shape != (H, T, d):
        raise ValueError(f"K has shape {K.shape}; expected (H, T, d) = {(H, T, d)}, the history the state was built from")
    if V.shape != (H, T, d_v):
        raise ValueError(f"V has shape {V.shape}; expected (H, T, d_v) = {(H, T, d_v)}")
    if q.ndim != 2 or q.shape[1] != d or q.shape[0] == 0 or q.shape[0] % H:
        raise ValueError(f"q has shape {q.shape}; expected (H_q, {d}) with H_q a positive multiple of {H}")
    if T == 0:
        raise ValueError("the state holds no tokens")
    for name, x in (("q", q), ("K", K), ("V", V)):
        if not np.all(np.isfinite(x)):
            raise ValueError(f"{name} contains NaN or Inf")
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)
    # the least precise of the inputs sets the unit roundoff u of every allowance (spec B0)
    u = max(float(np.finfo(dt).eps) for dt in (q.dtype, K.dtype, V.dtype, state.dtype) if np.dtype(dt).kind == "f") / 2
    q64, K64, V64 = (x.astype(np.float64) for x in (q, K, V))
    K_hat, V_hat = (x.astype(np.float64) for x in state.reconstruct())
    o_hat_attend = np.asarray(attend(q, state, scale=scale), dtype=np.float64)
    heads = [_head(state, h, K64[h], V64[h], K_hat[h], V_hat[h]) for h in range(H)]
    Hq = q.shape[0]
    group = Hq // H
    premise_k = [_premise(state, hd.key_orth_error, d, u, hd.key_growth_gap, hd.key_row_max) for hd in heads]
    premise_v = [_premise(state, hd.value_orth_error, d_v, u, hd.value_growth_gap, hd.value_row_max) for hd in heads]
    n = T + d + d_v + state.layout.key_coef.shape[-1]  # the longest sum any quantity accumulates

    per_claim: dict[str, list[tuple[_Eval, str]]] = {cid: [] for cid in st.CLAIMS}
    logit_errors, output_errors, rel_output_errors, consistency = [], [], [], 0.0

    for hq in range(Hq):
        h = hq // group
        hd = heads[h]
        qv = q64[hq]
        qn = float(np.linalg.norm(qv))
        g = hd.gamma
        logits = s * (hd.K @ qv)
        approx = g * s * (hd.K_hat @ qv)
        delta = float(np.abs(logits - approx).max())
        alpha, alpha_hat = _softmax(logits), _softmax(approx)
        w_err = float(np.abs(alpha - alpha_hat).sum())
        o = alpha @ hd.V
        o_hat = o_hat_attend[hq]
        consistency = max(consistency, float(np.abs(o_hat - alpha_hat @ hd.V_hat).max()))
        out_err = float(np.linalg.norm(o - o_hat))
        key_term = float(np.linalg.norm((alpha - alpha_hat) @ hd.V))
        value_term = float(np.linalg.norm(alpha_hat @ (hd.V - hd.V_hat)))
        logit_errors.append(delta)
        output_errors.append(out_err)
        rel_output_errors.append(out_err / max(float(np.linalg.norm(o)), np.finfo(float).tiny))

        # spec B0 allowances: n*u times the magnitude each side was accumulated from
        a_logit = ROUNDING_FACTOR * n * (u * abs(s) * qn * (hd.key_row_max + abs(g) * hd.key_hat_row_max) + UNDERFLOW)
        a_soft = ROUNDING_FACTOR * n * u + a_logit
        v_scale = hd.value_row_max + hd.value_hat_row_max
        a_key = ROUNDING_FACTOR * n * (u * hd.value_row_max + UNDERFLOW)
        a_val = ROUNDING_FACTOR * n * (u * v_scale + UNDERFLOW)
        a_out = a_key + a_val + a_soft * hd.value_row_max
        where = f"query head {hq}"
        single = len(hd.chunks) == 1

        pk, pv = premise_k[h], premise_v[h]  # "" when k_hat_i = P_{B_j} k_i holds, else why not
        b1c = st.logit_corrected(g, d, qn, hd.key_recon_row_max, hd.key_hat_row_max) * abs(s) * math.sqrt(d)
        b1 = st.logit_single(g, d, hd.key_residual_ops[0] if hd.key_residual_ops else 0.0, qn) * abs(s) * math.sqrt(d)
        b2 = st.logit_multichunk(g, d, qn, hd.key_residual_ops) * abs(s) * math.sqrt(d)
        gamma_one = g == 1.0
        add = lambda cid, ev: per_claim[cid].append((ev, where))  # noqa: E731

        add("B1", _logit_paper(delta, b1, b1c, a_logit, pk, gamma_one, single, "B1.c ≤ B1"))
        add("B1.c", _Eval(delta, b1c, a_logit, True, single))
        add("B2", _logit_paper(delta, b2, b1c, a_logit, pk, gamma_one, True, "B2.c ≤ B2"))
        add("B2.c", _Eval(delta, b1c, a_logit, True))
        add("B3.1", _Eval(w_err, st.softmax_tanh(delta), a_soft, True))
        add("B3.2", _Eval(w_err, st.softmax_linear(delta), a_soft, True))
        add("B4.1", _Eval(key_term, st.output_key_term(w_err, hd.value_row_max), a_key, True))
        add("B4.2", _Eval(value_term, st.output_value_term(hd.value_residual_ops), a_val, not pv, basis=pv))
        add("B4.2.c", _Eval(value_term, st.output_value_term(hd.value_recon_ops), a_val, True))
        add("B4.3", _Eval(out_err, st.output_combined(delta, hd.value_row_max, hd.value_residual_ops), a_out, not pv, basis=pv))
        add("B4.3.c", _Eval(out_err, st.output_combined(delta, hd.value_row_max, hd.value_recon_ops), a_out, True))
        b2_row = _logit_paper(delta, b2, b1c, a_logit, pk, gamma_one, True, "B2.c ≤ B2")
        why44 = pv or ("" if b2_row.guarantee else b2_row.basis)
        add("B4.4", _Eval(out_err, st.output_combined(b2, hd.value_row_max, hd.value_residual_ops), a_out, not why44, basis=why44))
        add("B4.4.c", _Eval(out_err, st.output_combined(b1c, hd.value_row_max, hd.value_recon_ops), a_out, True))
        b7c = st.seed003_logit_gamma(qn, hd.key_gamma_recon_op, d) * abs(s) * math.sqrt(d)
        b7 = st.seed003_logit(qn, hd.key_recon_op, d) * abs(s) * math.sqrt(d)
        add("B7", _logit_paper(delta, b7, b7c, a_logit, "", gamma_one, True, "B7.c ≤ B7"))
        add("B7.c", _Eval(delta, b7c, a_logit, True))
        # e carries an absolute rounding error ~ n u, and sqrt(1 - e) amplifies it as e -> 1
        a8p, a8c = (a_val + _energy_allowance(e, hd.value_frob, n * u) for e in (hd.energy_proj, hd.energy_kept))
        add("B8", _Eval(value_term, st.seed003_value(hd.energy_proj, hd.value_frob), a8p, not pv, basis=pv))
        add("B8.c", _Eval(value_term, st.seed003_value(hd.energy_kept, hd.value_frob), a8c, True))

    fd_pred = {"fd_eps_k": None, "fd_eps_v": None, "fd_eps_k_measured": None, "fd_eps_v_measured": None}
    if state.sketches is not None and state.sketches.rows_seen == T and state.sketches.filled_k > 0:
        _fd_rows(state, K64, V64, u, per_claim, fd_pred)
    else:
        why = "static state: no sketch" if state.sketches is None else "the sketch has not seen this history"
        for cid in ("B5.1", "B5.2", "B6.1", "B6.2", "B6.3"):
            per_claim[cid].append((_Eval(0.0, 0.0, 0.0, False, applicable=False), why))

    rows = [_row(cid, per_claim[cid], state.kind) for cid in st.CLAIMS]
    predictors = dict(
        logit_error=max(logit_errors),
        output_error=max(output_errors),
        relative_output_error=max(rel_output_errors),
        max_chunk_residual_k=max(_maxl(hd.key_residual_ops) for hd in heads),
        max_chunk_residual_v=max(_maxl(hd.value_residual_ops) for hd in heads),
        reconstruction_residual_k=max(hd.key_recon_op for hd in heads),
        reconstruction_residual_v=max(_maxl(hd.value_recon_ops) for hd in heads),
        chunk_residuals_k=[hd.key_residual_ops for hd in heads],
        chunk_residuals_v=[hd.value_residual_ops for hd in heads],
        energy_captured_v=min(hd.energy_proj for hd in heads),
        basis_orthonormality_error=max(max(hd.key_orth_error, hd.value_orth_error) for hd in heads),
        attend_consistency=consistency,
        **fd_pred,
    )
    info = dict(
        kind=state.kind, heads=H, query_heads=Hq, d=d, d_v=d_v, tokens=T,
        chunks=[len(hd.chunks) for hd in heads], gamma=[hd.gamma for hd in heads],
        scale=s, unit_roundoff=u,
    )
    return BoundsReport(rows=rows, predictors=predictors, info=info)


def _premise(state, orth_error: float, dim: int, u: float, growth_gap: float = 0.0, row_max: float = 0.0) -> str:
    """Why k_hat_i = P_{B_j} k_i with P_{B_j} an orthogonal projector fails for this state, or ""
    when it holds (the hypothesis of the paper forms B1, B2, B4.2-B4.4, B8)."""
    if state.kind not in PROJECTION_KINDS:
        return f"{state.kind} state"
    if getattr(state.layout, "quantized", False):
        return "int8 coefficients"
    # bases from an SVD are orthonormal to a few dim*u; beyond that P = B^T B is no projector
    if orth_error > ROUNDING_FACTOR * dim * u:
        return "bases not orthonormal"
    if growth_gap > ROUNDING_FACTOR * dim * u * max(row_max, UNDERFLOW):
        return "bases grown after earlier tokens were stored (spec A7.4)"
    return ""


def _logit_paper(delta, bound, corrected, allowance, premise, gamma_one, applicable, relation) -> _Eval:
    """A paper-form logit statement (B1, B2, B7): a guarantee when its premise holds and either
    gamma = 1 or the proven corrected bound lies below it (spec B1)."""
    if not premise and gamma_one:
        return _Eval(delta, bound, allowance, True, applicable, "γ = 1")
    if not premise and corrected <= bound:
        return _Eval(delta, bound, allowance, True, applicable, relation)
    why = "; ".join(x for x in (premise, "" if gamma_one else "γ ≠ 1") if x)
    return _Eval(delta, bound, allowance, False, applicable, why)


def _orth_error(bases: np.ndarray, chunks) -> float:
    worst = 0.0
    for _, _, j in chunks:
        B = bases[j][np.linalg.norm(bases[j], axis=-1) > 0]  # zero rows are padding (spec A9)
        if B.size:
            worst = max(worst, float(np.abs(B @ B.T - np.eye(B.shape[0])).max()))
    return worst


def _maxl(x) -> float:
    return max(x, default=0.0)


def _fd_rows(state, K, V, u, per_claim, pred) -> None:
    """Spec B5, B6 per KV head, for keys and values, on the state's current sketches: A is every
    row the sketch has seen and P the sketch's top-r space (the basis a new chunk would take now)."""
    sk, pol = state.sketches, state.policy
    worst = {"k": (0.0, 0.0), "v": (0.0, 0.0)}
    for side, X, buf, filled, ell, ranks in (
        ("k", K, to_numpy(sk.keys), sk.filled_k, pol.ell_k, pol.rank_k),
        ("v", V, to_numpy(sk.values), sk.filled_v, pol.ell_v, pol.rank_v),
    ):
        for h in range(state.heads):
            A = X[h, _sketched_from(state, h):]
            T, dim = A.shape
            r = ranks[h]
            buffer = buf[0, h].astype(np.float64)
            S = fd.sketch(buffer, filled, ell)
            P_rows = fd.complete_orthonormal(fd.top_directions(buffer[:filled], r)) if r <= dim else np.eye(dim)
            # thin SVD: the full one builds a T x T factor and costs seconds at T ~ 200
            _, sigma, wt = svd(A, full_matrices=False)
            if wt.shape[0] < r:  # fewer rows than r: complete the top-r space (gap = 0 then)
                wt = fd.complete_orthonormal(np.vstack([wt, np.zeros((r - wt.shape[0], dim))]))
            sig = np.zeros(max(dim, r + 1))
            sig[: sigma.size] = sigma
            tail = float(np.sum(sig[r:] ** 2))
            eps = st.fd_covariance(tail, ell, min(r, ell - 1))
            gap = float(sig[r - 1] ** 2 - sig[r] ** 2)
            diff = A.T @ A - S.T @ S
            lam = np.linalg.eigvalsh((diff + diff.T) / 2)
            eps_measured = float(np.abs(lam).max())
            fro2 = float(np.sum(A * A))
            a5 = ROUNDING_FACTOR * (2 * T + dim) * (u * fro2 + UNDERFLOW**2)
            where = f"KV head {h}, {'keys' if side == 'k' else 'values'}"
            per_claim["B5.1"].append((_Eval(max(0.0, -float(lam.min())), st.fd_lower(), a5, True), where))
            per_claim["B5.2"].append((_Eval(eps_measured, eps, a5, True), where))
            resid = _op(A - (A @ P_rows.T) @ P_rows)
            a_sq = 2 * a5 + ROUNDING_FACTOR * (T + dim) * u * fro2
            b61 = st.fd_projection_paper(eps, gap)
            b62 = st.fd_projection_corrected(float(sig[r]), eps)
            cond = st.paper_fd_condition(float(sig[r]), eps, gap)
            why = "σ_{r+1}² ≤ η²+2η√ε" if cond else "σ_{r+1}² > η²+2η√ε"
            per_claim["B6.1"].append((_Eval(resid, b61, _lin(b61, a_sq), cond, basis=why), where))
            per_claim["B6.2"].append((_Eval(resid, b62, _lin(b62, a_sq), True), where))
            PA = wt[:r]
            angle = _op(PA - (PA @ P_rows.T) @ P_rows)
            a63 = ROUNDING_FACTOR * (T + dim) * u + (4 * (a5 + ROUNDING_FACTOR * (T + dim) * u * fro2) / gap if gap > 0 else 0.0)
            per_claim["B6.3"].append((_Eval(angle, st.davis_kahan_angle(eps, gap), a63, True), where))
            if eps >= worst[side][0]:
                worst[side] = (eps, eps_measured)
    pred["fd_eps_k"], pred["fd_eps_k_measured"] = worst["k"]
    pred["fd_eps_v"], pred["fd_eps_v_measured"] = worst["v"]


def _energy_allowance(e: float, frob: float, nu: float) -> float:
    # the exact change of sqrt(1 - e) ||V||_F when e moves by the rounding allowance
    rest = max(1.0 - e, 0.0)
    return frob * (math.sqrt(rest + ROUNDING_FACTOR * nu) - math.sqrt(rest)) + ROUNDING_FACTOR * nu * frob


def _sketched_from(state, h: int) -> int:
    """First token the current sketches of head h summarise: with ``track`` (spec A7.4) the open
    chunk's first; else 0, or with ``sketch_reset`` (spec A7
    step 3b) the token that closed the last chunk of length >= max(ell_k, ell_v), since the
    reset comes after that chunk's snapshot and before the FD update with its last token; with
    the reproject trigger (spec A7.2) the firing token opens the next chunk and the sketch keeps it."""
    pol = state.policy
    if getattr(pol, "track", False):  # spec A7.4 step 3: the sketches restart at every opening, keeping its token
        return state.chunk_bounds(h)[-1][0]
    if not getattr(pol, "sketch_reset", False):
        return 0
    reproject = getattr(pol, "trigger", "paper") == "reproject"
    start = 0
    for a, b in state.chunk_bounds(h)[:-1]:
        if b - a >= max(pol.ell_k, pol.ell_v):
            start = b if reproject else b - 1
    return start


def _lin(b: float, a_sq: float) -> float:
    # m^2 <= b^2 + a_sq, written as m <= b + allowance
    if b == math.inf:
        return 0.0
    return math.sqrt(b * b + a_sq) - b


def _row(cid: str, evals: list[tuple[_Eval, str]], kind: str) -> BoundRow:
    claim = st.CLAIMS[cid]
    live = [(e, w) for e, w in evals if e.applicable]
    if not live:
        why = "n/a: " + (evals[0][1] if evals and not evals[0][1].startswith("query head") else "more than one chunk")
        return BoundRow(cid, claim.title, math.nan, math.nan, math.nan, True, False, why, 0.0, "", applicable=False)
    held_all = all(e.measured <= e.bound + e.allowance for e, _ in live)
    guaranteed_all = all(e.guarantee for e, _ in live)
    e, w = max(live, key=lambda ew: _worst_key(ew[0]))
    if claim.kind == "guarantee":
        reason, status = "", "guarantee"
    elif guaranteed_all:
        reason = "; ".join(sorted({x.basis for x, _ in live if x.basis})) or f"{kind} state"
        status = f"paper form, condition met ({reason})"
    else:
        reason = "; ".join(sorted({p for x, _ in live if not x.guarantee for p in x.basis.split("; ") if p}))
        status = "paper form, NOT a guarantee" + (f" ({reason})" if reason else "")
    return BoundRow(
        id=cid, title=claim.title, measured=e.measured, bound=e.bound,
        ratio=_ratio(e.measured, e.bound, e.allowance), held=held_all, guarantee=guaranteed_all,
        status=status, allowance=e.allowance, where=w, reason=reason,
    )
