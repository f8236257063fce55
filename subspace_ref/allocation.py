"""A byte-budget allocator (issue 16 item 3): ``compression_ratio`` (or bytes per token) -> per
layer and KV head the key rank, value rank, their coefficient bits and the key basis kind,
chosen on calibration data to minimise a measured output-error proxy (spec/quantization.md Q6).

The method is Palu's rank search made exact for a separable loss: each (layer, head, side) has
a table of candidates (bytes per token, measured loss); only the lower convex hull of each table
can be optimal, and taking hull steps greedily by loss reduction per byte until the budget is
spent solves the Lagrangian relaxation exactly: the walk up to its first skipped step (a step
that does not fit) is optimal for the bytes it spent, so the result is at least as good as the
optimum of the budget less one step (tests compare with brute force). Bytes are counted by
:mod:`subspace_ref.byte_convention` (fp16 floats, KIVI scales, the unfinished key group in fp16,
bases amortised over the window; spec/quantization.md Q3).

The measured loss of a side at (kind, rank, bits), per (layer, KV head), on calibration tokens.
By default (``loss="fisher"``, :func:`subspace_ref.hf.calibration_losses.output_gradients`) it is
the second-order estimate of what the reconstruction error does to the model's output:

* ``E_t [(g_t · (k_t − k̂_t))²]`` for keys and ``E_t [(h_t · (v_t − v̂_t))²]`` for values, with
  ``g_t``, ``h_t`` the gradients of the calibration text's next-token loss (summed NLL) with
  respect to the post-RoPE key and the value of token t at that head (an empirical-Fisher,
  first-order Taylor term: the change of the loss a reconstruction error causes, squared).
  Keys and values, and heads of every layer, are then in the same unit (the final loss), so
  errors in heads the output is sensitive to cost more than equal errors elsewhere
  (spec/layer_state.md L6.2).

Without gradients (``loss="proxy"``), the per-head output-error proxy:

* keys: ``s² E_{q,t} [(q · (k_t − k̂_t))²] · Var(v)`` — the logit error's second moment (queries
  of the head's query group, keys post-RoPE: a pre-RoPE reconstruction is rotated back to each
  token's position) times the value spread it moves weight across (spec/bounds.md B4.1's remark:
  centred values); for each key basis kind: post-RoPE SVD, pre-RoPE SVD, and RoPE planes
  (:func:`plane_rows`, spec/rope.md P4: even ranks only, rank = 2 x planes kept);
* values: ``E_t ‖v_t − v̂_t‖²``.

Both are output errors squared, so one budget trades them. In either loss ``k̂``, ``v̂`` are the stored
reconstructions: projection on the calibrated basis, then what the coefficient format reads
back (:meth:`subspace_ref.formats.CoefficientFormat.reconstruct`: spec A10's int8, the int4/int2
quantiser of spec/quantization.md Q1, keys per channel over groups of ``group`` tokens, values
per token).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from subspace_ref.byte_convention import head_parts, make_bytes, side_parts
from subspace_ref.formats import BY_BITS, of_bits

#: Coefficient widths the allocator chooses from (16: fp16 coefficients).
BITS = tuple(BY_BITS)
#: Key basis kinds: calibrated on post-RoPE keys (A6), on un-rotated keys (spec/rope.md P2),
#: whole RoPE planes chosen by the measured key loss (spec/rope.md P4; a plain post-RoPE basis),
#: or the identity (plain quantised keys, KIVI: rank d, no basis stored; spec/layer_state.md L2).
KEY_BASES = ("post_rope", "pre_rope", "plane", "identity")
#: Value basis kinds: calibrated (A6), or the identity (plain quantised values, rank d_v).
VALUE_BASES = ("subspace", "identity")


@dataclass(frozen=True)
class HeadAllocation:
    """One KV head's choice: ranks, coefficient bits per side, and the basis kind of each side
    (an identity side has the head size as its rank)."""

    rank_k: int
    rank_v: int
    bits_k: int = 16
    bits_v: int = 16
    key_basis: str = "post_rope"
    value_basis: str = "subspace"

    def __post_init__(self):
        for name in ("rank_k", "rank_v"):
            if not isinstance(getattr(self, name), (int, np.integer)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a non-negative int, got {getattr(self, name)!r}")
        for name in ("bits_k", "bits_v"):
            if getattr(self, name) not in BITS:
                raise ValueError(f"{name} must be one of {BITS}, got {getattr(self, name)!r}")
        if self.key_basis not in KEY_BASES:
            raise ValueError(f"key_basis must be one of {KEY_BASES}, got {self.key_basis!r}")
        if self.value_basis not in VALUE_BASES:
            raise ValueError(f"value_basis must be one of {VALUE_BASES}, got {self.value_basis!r}")
        if self.key_basis == "plane" and self.rank_k % 2:
            raise ValueError(f"rank_k must be even with key_basis 'plane' (two dims per RoPE plane), got {self.rank_k}")


@dataclass(frozen=True)
class Allocation:
    """Per layer, per KV head :class:`HeadAllocation` s, the key group size, and what was asked
    and measured. A plain dataclass: :meth:`to_dict` / :meth:`from_dict` are JSON-ready, so a
    saved set of bases can carry its allocation."""

    heads: tuple  # (layers,) of (kv_heads,) of HeadAllocation
    group: int = 32
    budget_bytes_per_token: float = 0.0
    window: int = 0
    sinks: int = 0
    calibration_loss: float = float("nan")
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def layers(self) -> int:
        return len(self.heads)

    def to_dict(self) -> dict:
        return dict(version=1, heads=[[asdict(h) for h in layer] for layer in self.heads], group=self.group,
                    budget_bytes_per_token=self.budget_bytes_per_token, window=self.window, sinks=self.sinks,
                    calibration_loss=self.calibration_loss, meta=dict(self.meta))

    @classmethod
    def from_dict(cls, d: dict) -> "Allocation":
        if d.get("version") != 1:
            raise ValueError(f"allocation version must be 1, got {d.get('version')!r}")
        heads = tuple(tuple(HeadAllocation(**h) for h in layer) for layer in d["heads"])
        return cls(heads, int(d["group"]), float(d["budget_bytes_per_token"]), int(d["window"]), int(d["sinks"]),
                   float(d["calibration_loss"]), dict(d.get("meta", {})))

    def bytes(self, geom):
        """Bytes per token (:class:`~subspace_ref.byte_convention.Bytes`) under the byte convention
        (spec/quantization.md Q3)."""
        parts: dict[str, float] = {}
        for layer in self.heads:
            for h in layer:
                for k, v in head_parts(geom, h, self.group, self.window, self.sinks).items():
                    parts[k] = parts.get(k, 0.0) + v / geom.units
        return make_bytes(geom, **parts)


# ------------------------------------------------------------------------------ states
def allocation_bases(alloc: Allocation, svd: list, *, svd_pre: list | None = None, planes: list | None = None, gamma: float = 1.0) -> list:
    """One :class:`~subspace_ref.StaticBasis` per layer holding ``alloc``'s ranks: per head the
    first ``rank_k`` rows of its kind's key basis (``svd[l]["Wk"][h]`` post-RoPE,
    ``svd_pre[l]["Wk"][h]`` pre-RoPE, ``planes[l][h]`` planes: :func:`plane_rows`) and the first
    ``rank_v`` rows of ``svd[l]["Wv"][h]``, zero-padded to the layer's largest rank; an identity
    side holds no rows (rank 0 here: :class:`~subspace_ref.LayerState` stores it as it is).
    ``LayerState.from_heads(basis, alloc.heads[l], rope=...)`` builds the layer's state
    (spec/layer_state.md L2): plane and post-RoPE heads are plain static heads (R1), pre-RoPE heads
    un-rotate their keys. Saved with the allocation by
    :class:`~subspace_ref.hf.artifact.CalibratedBases` (``allocation=alloc``)."""
    from subspace_ref.calibration import StaticBasis

    if not isinstance(alloc, Allocation):
        raise TypeError(f"alloc must be an Allocation, got {type(alloc).__name__}")
    for name, src, need in (("svd", svd, True), ("svd_pre", svd_pre, "pre_rope"), ("planes", planes, "plane")):
        used = need is True or any(h.key_basis == need for layer in alloc.heads for h in layer)
        if used and (src is None or len(src) != alloc.layers):
            raise ValueError(f"{name} must hold one entry per layer ({alloc.layers}) for this allocation, got {None if src is None else len(src)}")
    out = []
    for li, layer in enumerate(alloc.heads):
        rank_k = tuple(0 if h.key_basis == "identity" else h.rank_k for h in layer)
        rank_v = tuple(0 if h.value_basis == "identity" else h.rank_v for h in layer)
        d, dv = svd[li]["Wk"].shape[-1], svd[li]["Wv"].shape[-1]
        B, E = np.zeros((len(layer), max(max(rank_k), 1), d)), np.zeros((len(layer), max(max(rank_v), 1), dv))
        for h, c in enumerate(layer):
            src = {"post_rope": svd[li]["Wk"], "pre_rope": None if svd_pre is None else svd_pre[li]["Wk"], "plane": None if planes is None else planes[li]}.get(c.key_basis)
            if rank_k[h]:
                B[h, : rank_k[h]] = np.asarray(src[h])[: rank_k[h]]
            if rank_v[h]:
                E[h, : rank_v[h]] = np.asarray(svd[li]["Wv"][h])[: rank_v[h]]
        out.append(StaticBasis(B=B, E=E, gamma=np.full(len(layer), float(gamma)), rank_k=rank_k, rank_v=rank_v))
    return out


# ------------------------------------------------------------------------------ the greedy
@dataclass(frozen=True)
class Candidate:
    """One configuration of one (layer, head, side): its bytes per token and measured loss."""

    bytes: float
    loss: float
    config: tuple  # (kind, rank, bits); kind None for values


def lower_hull(cands: list[Candidate]) -> list[Candidate]:
    """The candidates on the lower convex hull of (bytes, loss), by increasing bytes and strictly
    decreasing loss: the only ones a Lagrangian (loss + λ bytes) optimum can pick."""
    pts = sorted(cands, key=lambda c: (c.bytes, c.loss))
    hull: list[Candidate] = []
    for c in pts:
        if hull and c.loss >= hull[-1].loss:
            continue  # dominated: more bytes, no less loss
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b is above the segment a-c (or on it): not on the lower hull
            if (b.loss - a.loss) * (c.bytes - a.bytes) >= (c.loss - a.loss) * (b.bytes - a.bytes):
                hull.pop()
            else:
                break
        hull.append(c)
    return hull


def greedy(tables: dict, budget: float) -> tuple[dict, float, float]:
    """Spend ``budget`` bytes over the hulls of ``tables`` ({key: [Candidate]}): start every key
    at its cheapest hull point, then repeatedly take the hull step with the largest loss
    reduction per byte that still fits. Returns ({key: Candidate}, bytes, loss)."""
    hulls = {k: lower_hull(v) for k, v in tables.items()}
    pos = {k: 0 for k in hulls}
    spent = sum(h[0].bytes for h in hulls.values())
    if spent > budget + 1e-9:
        raise ValueError(f"the budget of {budget:.1f} bytes per token is below the cheapest allocation ({spent:.1f})")
    while True:
        best, best_rate = None, 0.0
        for k, h in hulls.items():
            i = pos[k]
            if i + 1 < len(h):
                step = h[i + 1].bytes - h[i].bytes
                if spent + step <= budget + 1e-9:
                    rate = (h[i].loss - h[i + 1].loss) / max(step, 1e-12)
                    if rate > best_rate:
                        best, best_rate = k, rate
        if best is None:
            break
        spent += hulls[best][pos[best] + 1].bytes - hulls[best][pos[best]].bytes
        pos[best] += 1
    chosen = {k: hulls[k][pos[k]] for k in hulls}
    return chosen, spent, sum(c.loss for c in chosen.values())


# ------------------------------------------------------------------------------ measured losses
def plane_rows(keys: np.ndarray, pairs: np.ndarray, queries: np.ndarray | None = None) -> np.ndarray:
    """Spec/rope.md P4: an orthonormal (d, d) basis of whole RoPE planes, rows ``e_i, e_j`` plane
    by plane in the order of selection, so that its first ``2 p`` rows are the basis of ``p``
    planes (nested, as SVD rows are). ``keys`` (N, d) of one head, pre- or post-RoPE (R3: plane
    energies agree); ``pairs`` (d/2, 2): :meth:`~subspace_ref.rope.RopeParams.planes`.

    With ``queries`` (M, d), the planes are added greedily by the fp16 key loss of the allocator,
    ``E_{q,t}[(q · (I − P) k_t)²] = Σ_{a,b ∉ S} (E[q qᵀ] ∘ E[k kᵀ])_{ab}`` (dims of the dropped
    planes S^c): each step keeps the plane whose addition lowers it most (ties: lower plane
    index). Without queries, by plane energy (spec/rope.md P1)."""
    K = np.asarray(keys, dtype=np.float64)
    P = np.asarray(pairs)
    if K.ndim != 2:
        raise ValueError(f"keys must be (N, d), got shape {K.shape}")
    d = K.shape[1]
    if P.ndim != 2 or P.shape != (d // 2, 2) or d % 2 or sorted(P.reshape(-1).tolist()) != list(range(d)):
        raise ValueError(f"pairs must pair the {d} key dims into {d // 2} planes, got shape {P.shape}")
    Sk = K.T @ K / max(len(K), 1)
    if queries is None:
        A = np.diag(np.diag(Sk))  # energy: cross terms ignored, E_p = sum of its dims' second moments
    else:
        Qm = np.asarray(queries, dtype=np.float64)
        if Qm.ndim != 2 or Qm.shape[1] != d:
            raise ValueError(f"queries must be (M, {d}), got shape {Qm.shape}")
        A = (Qm.T @ Qm / max(len(Qm), 1)) * Sk
    # the loss of dropping the plane set D is sum_{p,p' in D} Ap[p, p']: per-plane blocks summed
    Ap = A[P[:, :, None, None], P[None, None, :, :]].sum(axis=(1, 3))
    left = list(range(len(P)))
    order = []
    while left:
        # adding p to the kept set removes its row and column from the dropped block
        gain = [2 * Ap[p, left].sum() - Ap[p, p] for p in left]
        best = left[int(np.argmax(gain))]  # argmax: first (lowest index) among ties
        order.append(best)
        left.remove(best)
    W = np.zeros((d, d))
    W[np.arange(d), P[order].reshape(-1)] = 1.0
    return W


def side_losses(layer: dict, h: int, group_queries: np.ndarray, ranks, bits=BITS, group: int = 32, rope=None, identity: bool = True,
                key_grads: np.ndarray | None = None, value_grads: np.ndarray | None = None) -> dict:
    """Measured losses of one KV head (module docstring). ``layer``: ``keys`` (N, d) post-RoPE,
    ``keys_pre`` (N, d) or None, ``values`` (N, d_v), ``positions`` (N,), SVD rows ``Wk``,
    ``Wk_pre``, ``Wv`` ((dim, dim), rows by decreasing singular value), and ``Wk_plane`` or None
    (:func:`plane_rows`; its kind is measured at the even ranks only). ``identity``: also the
    identity bases of each side (rank d / d_v, plain quantised keys and values: KIVI,
    spec/layer_state.md L1). Returns {("key", kind): {(rank, bits): loss}, ("value", kind):
    {(rank, bits): loss}} with value kinds "subspace" and "identity".

    ``key_grads`` (N, d) and ``value_grads`` (N, d_v): gradients of the output loss with respect
    to each token's post-RoPE key and value (module docstring); when given, each side's loss is
    ``mean_t (g_t · error_t)²`` instead of the proxy (both or neither). Stacked (S, N, d) and
    (S, N, d_v), S gradient sets (one per exact window: spec/layer_state.md L6.2): a list of S
    such results, the reconstructions computed once."""
    if (key_grads is None) != (value_grads is None):
        raise ValueError("give both key_grads and value_grads, or neither")
    from subspace_ref.rope import rotate

    K, V = layer["keys"], layer["values"]
    d, d_v = K.shape[1], V.shape[1]
    if key_grads is not None:
        key_grads, value_grads = np.asarray(key_grads, dtype=np.float64), np.asarray(value_grads, dtype=np.float64)
        if key_grads.ndim == 3 and value_grads.ndim == 3 and len(key_grads) == len(value_grads):
            stacked = True
        else:
            stacked, key_grads, value_grads = False, key_grads[None], value_grads[None]
        if key_grads.shape[1:] != K.shape or value_grads.shape[1:] != V.shape:
            raise ValueError(f"key_grads, value_grads must have the keys' {K.shape} and values' {V.shape} shapes, got {key_grads.shape}, {value_grads.shape}")
    s2 = 1.0 / d
    Sq = group_queries.T @ group_queries / len(group_queries)  # E[q q^T]
    spread = float(np.sum(V.var(axis=0)))
    out = {}
    kinds = [("post_rope", K, layer["Wk"], ranks)] + ([("pre_rope", layer["keys_pre"], layer["Wk_pre"], ranks)] if layer.get("keys_pre") is not None else [])
    if layer.get("Wk_plane") is not None:  # R1: a plane basis projects post-RoPE keys like any static basis
        kinds.append(("plane", K, layer["Wk_plane"], [r for r in ranks if r % 2 == 0]))  # whole planes only
    if identity:
        kinds.append(("identity", K, np.eye(d), [d]))
    for kind, X, W, kind_ranks in kinds:
        table = {}
        for r in kind_ranks:
            C = X @ W[:r].T
            for b in bits:
                dk = X - of_bits(b).reconstruct(C, "key", group) @ W[:r]
                if kind == "pre_rope":
                    dk = rotate(dk, layer["positions"], rope)
                if key_grads is not None:
                    table[(r, b)] = np.mean(np.einsum("nd,snd->sn", dk, key_grads) ** 2, axis=1)
                else:
                    table[(r, b)] = s2 * float(np.sum((dk @ Sq) * dk)) / len(dk) * spread
        out[("key", kind)] = table
    for kind, W, kind_ranks in [("subspace", layer["Wv"], ranks)] + ([("identity", np.eye(d_v), [d_v])] if identity else []):
        table = {}
        for r in kind_ranks:
            D = V @ W[:r].T
            for b in bits:
                dv = V - of_bits(b).reconstruct(D, "value", group) @ W[:r]
                if value_grads is not None:
                    table[(r, b)] = np.mean(np.einsum("nd,snd->sn", dv, value_grads) ** 2, axis=1)
                else:
                    table[(r, b)] = float(np.sum(dv * dv)) / len(dv)
        out[("value", kind)] = table
    if key_grads is None:
        return out
    split = [{side: {c: float(loss[i]) for c, loss in table.items()} for side, table in out.items()} for i in range(len(key_grads))]
    return split if stacked else split[0]


def allocate(losses: list, geom, *, compression_ratio: float | None = None, bytes_per_token: float | None = None,
             group: int = 32, window: int = 0, sinks: int = 0, min_rank_k: int = 1, key_bases: tuple[str, ...] = KEY_BASES,
             max_pre_rope_rank: int | None = None) -> Allocation:
    """The allocation of ``compression_ratio`` x the full fp16 cache (or ``bytes_per_token``)
    minimising the summed measured loss. ``losses[layer][head]``: :func:`side_losses` output.
    Keys keep at least ``min_rank_k`` dimensions (rank 0 would make attention uniform).
    ``key_bases``: the key kinds the allocator may choose (default all of :data:`KEY_BASES`;
    spec/layer_state.md L6.3: without "pre_rope" no key is rebuilt and rotated per token).
    ``max_pre_rope_rank``: pre-RoPE key candidates of higher rank are left out (None: none is;
    spec/layer_state.md L6.4: a pre-RoPE key then costs at most that rank times d multiply-adds
    per token to decode).

    The greedy hull walk, or the best uniform allocation (every head the same key and the same
    value configuration) within the budget where that has less loss: spec/layer_state.md L6.1,
    so the result is at least as good on the calibration loss as every quantisation row its
    identity candidates stand for. ``meta["rule"]`` says which. ValueError when the budget is
    below what sinks and window alone cost."""
    if (compression_ratio is None) == (bytes_per_token is None):
        raise ValueError("give exactly one of compression_ratio= and bytes_per_token=")
    key_bases = check_key_bases(key_bases)
    check_max_pre_rope_rank(max_pre_rope_rank)
    budget = compression_ratio * geom.full_bytes_per_token if bytes_per_token is None else float(bytes_per_token)
    if not budget > 0:
        raise ValueError(f"the budget must be positive, got {budget}")
    exact = min(window + sinks, geom.context)
    kept = (geom.context - exact) / geom.context
    fixed = geom.units * (4 / geom.context + exact * geom.full_head_bytes / geom.context)
    if budget < fixed:
        raise ValueError(f"the budget of {budget:.1f} bytes per token is below what sinks={sinks} and window={window} alone cost ({fixed:.1f})")
    tables = {}
    for li, layer in enumerate(losses):
        for h, table in enumerate(layer):
            for (side, kind), entries in table.items():
                if side == "key" and kind not in key_bases:
                    continue
                cands = [Candidate(sum(side_parts(geom, side, r, b, group, kept, kind != "identity").values()), loss, (kind, r, b))
                         for (r, b), loss in entries.items()
                         if side == "value" or (r >= min_rank_k and not (kind == "pre_rope" and max_pre_rope_rank is not None and r > max_pre_rope_rank))]
                key = (li, h, side)
                tables[key] = tables.get(key, []) + cands
    missing = sorted({(li, h) for li, layer in enumerate(losses) for h in range(len(layer))} - {(li, h) for li, h, side in tables if side == "key"})
    if missing:
        raise ValueError(f"key_bases={key_bases}: no measured key candidate of these kinds for (layer, head) {missing[:4]}")
    chosen, spent, loss = greedy(tables, budget - fixed)
    rule = "greedy"
    uniform = best_uniform(tables, budget - fixed)
    if uniform is not None and uniform[2] < loss:
        chosen, spent, loss = uniform
        rule = "uniform"
    heads = []
    for li, layer in enumerate(losses):
        row = []
        for h in range(len(layer)):
            kind, rk, bk = chosen[(li, h, "key")].config
            vkind, rv, bv = chosen[(li, h, "value")].config
            row.append(HeadAllocation(int(rk), int(rv), int(bk), int(bv), kind, vkind))
        heads.append(tuple(row))
    meta = dict(bytes_per_token=spent + fixed, rule=rule) | ({} if key_bases == KEY_BASES else dict(key_bases=list(key_bases)))
    meta |= {} if max_pre_rope_rank is None else dict(max_pre_rope_rank=int(max_pre_rope_rank))
    return Allocation(tuple(heads), group, budget, window, sinks, loss, meta)


def check_max_pre_rope_rank(max_pre_rope_rank) -> None:
    """ValueError naming ``max_pre_rope_rank`` unless it is None or an int >= 1."""
    if max_pre_rope_rank is not None and (isinstance(max_pre_rope_rank, bool) or not isinstance(max_pre_rope_rank, int) or max_pre_rope_rank < 1):
        raise ValueError(f"max_pre_rope_rank must be None or an int >= 1, got {max_pre_rope_rank!r}")


def check_key_bases(key_bases) -> tuple[str, ...]:
    """``key_bases`` as a tuple of :data:`KEY_BASES` kinds in their order; ValueError naming it otherwise."""
    if isinstance(key_bases, str):
        key_bases = tuple(k.strip() for k in key_bases.split(",") if k.strip())
    kinds = tuple(key_bases)
    unknown = [k for k in kinds if k not in KEY_BASES]
    if unknown or not kinds:
        raise ValueError(f"key_bases must be a non-empty subset of {KEY_BASES}, got {key_bases!r}")
    return tuple(k for k in KEY_BASES if k in kinds)


def best_uniform(tables: dict, budget: float) -> tuple[dict, float, float] | None:
    """The uniform allocation of least loss within ``budget`` (spec/layer_state.md L6.1): every
    (layer, head) the same key configuration and the same value configuration, among those every
    head has; (chosen, bytes, loss) as :func:`greedy` returns, or None when none fits."""
    def shared(side: str) -> list:
        keys = [k for k in tables if k[2] == side]
        if not keys:
            return []
        configs = set.intersection(*({c.config for c in tables[k]} for k in keys))
        by_config = {k: {c.config: c for c in tables[k]} for k in keys}
        return [(cfg, sum(by_config[k][cfg].bytes for k in keys), sum(by_config[k][cfg].loss for k in keys)) for cfg in sorted(configs, key=repr)]

    keys, values = shared("key"), shared("value")
    if not keys or not values:
        return None
    kb, kl = np.array([b for _, b, _ in keys]), np.array([loss for *_, loss in keys])
    vb, vl = np.array([b for _, b, _ in values]), np.array([loss for *_, loss in values])
    total = np.where(kb[:, None] + vb[None, :] <= budget + 1e-9, kl[:, None] + vl[None, :], np.inf)
    i, j = np.unravel_index(int(np.argmin(total)), total.shape)
    if not np.isfinite(total[i, j]):
        return None
    pick = {"key": keys[i][0], "value": values[j][0]}
    chosen = {k: next(c for c in cands if c.config == pick[k[2]]) for k, cands in tables.items()}
    return chosen, float(kb[i] + vb[j]), float(total[i, j])


__all__ = ["BITS", "KEY_BASES", "VALUE_BASES", "Allocation", "Candidate", "HeadAllocation", "allocate", "allocation_bases", "best_uniform", "check_key_bases", "check_max_pre_rope_rank", "greedy",
           "lower_hull", "plane_rows", "side_losses"]
