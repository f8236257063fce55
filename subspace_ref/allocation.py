"""A byte-budget allocator (issue 16 item 3): ``compression_ratio`` (or bytes per token) -> per
layer and KV head the key rank, value rank, their coefficient bits and the key basis kind,
chosen on calibration data to minimise a measured output-error proxy (spec/quantization.md Q6).

The method is Palu's rank search made exact for a separable loss: each (layer, head, side) has
a table of candidates (bytes per token, measured loss); only the lower convex hull of each table
can be optimal, and taking hull steps greedily by loss reduction per byte until the budget is
spent solves the Lagrangian relaxation exactly: the walk up to its first skipped step (a step
that does not fit) is optimal for the bytes it spent, so the result is at least as good as the
optimum of the budget less one step (tests compare with brute force). Bytes are counted as
:mod:`subspace_ref.baselines.budget` counts them (fp16 floats, KIVI scales, the unfinished key
group in fp16, bases amortised over the window).

The measured loss of a side at (kind, rank, bits), per (layer, KV head), on calibration tokens:

* keys: ``s² E_{q,t} [(q · (k_t − k̂_t))²] · Var(v)`` — the logit error's second moment (queries
  of the head's query group, keys post-RoPE: a pre-RoPE reconstruction is rotated back to each
  token's position) times the value spread it moves weight across (spec/bounds.md B4.1's remark:
  centred values); for each key basis kind: post-RoPE SVD, pre-RoPE SVD, and RoPE planes
  (:func:`plane_rows`, spec/rope.md P4: even ranks only, rank = 2 x planes kept);
* values: ``E_t ‖v_t − v̂_t‖²``.

Both are output errors squared, so one budget trades them. ``k̂``, ``v̂`` are the stored
reconstructions: projection on the calibrated basis, then the int8/int4/int2 quantiser of
spec/quantization.md Q1 (keys per channel over groups of ``group`` tokens, values per token).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

#: Coefficient widths the allocator chooses from (16: fp16 coefficients).
BITS = (16, 8, 4, 2)
#: Key basis kinds: calibrated on post-RoPE keys (A6), on un-rotated keys (spec/rope.md P2), or
#: whole RoPE planes chosen by the measured key loss (spec/rope.md P4; a plain post-RoPE basis).
KEY_BASES = ("post_rope", "pre_rope", "plane")


@dataclass(frozen=True)
class HeadAllocation:
    """One KV head's choice: ranks, coefficient bits per side, and the key basis kind."""

    rank_k: int
    rank_v: int
    bits_k: int = 16
    bits_v: int = 16
    key_basis: str = "post_rope"

    def __post_init__(self):
        for name in ("rank_k", "rank_v"):
            if not isinstance(getattr(self, name), (int, np.integer)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a non-negative int, got {getattr(self, name)!r}")
        for name in ("bits_k", "bits_v"):
            if getattr(self, name) not in BITS:
                raise ValueError(f"{name} must be one of {BITS}, got {getattr(self, name)!r}")
        if self.key_basis not in KEY_BASES:
            raise ValueError(f"key_basis must be one of {KEY_BASES}, got {self.key_basis!r}")
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
        """Bytes per token (:class:`~subspace_ref.baselines.budget.Bytes`) as budget.py counts them."""
        from subspace_ref.baselines.budget import make_bytes

        parts: dict[str, float] = {}
        for layer in self.heads:
            for h in layer:
                for k, v in head_parts(geom, h, self.group, self.window, self.sinks).items():
                    parts[k] = parts.get(k, 0.0) + v / geom.units
        return make_bytes(geom, **parts)


# ------------------------------------------------------------------------------ states
def layer_pre_rope(alloc: Allocation, layer: int) -> bool:
    """Whether ``layer``'s state must un-rotate keys (``SubspaceState.static(basis, rope=...)``,
    spec/rope.md P2): all its heads are pre-RoPE. One state un-rotates all its heads or none, so
    a layer mixing pre-RoPE heads with other kinds has no single state: ValueError."""
    kinds = {h.key_basis == "pre_rope" for h in alloc.heads[layer]}
    if len(kinds) > 1:
        raise ValueError(f"alloc: layer {layer} mixes pre-RoPE key bases with others; one state un-rotates all its heads or none")
    return kinds == {True}


def allocation_bases(alloc: Allocation, svd: list, *, svd_pre: list | None = None, planes: list | None = None, gamma: float = 1.0) -> list:
    """One :class:`~subspace_ref.StaticBasis` per layer holding ``alloc``'s ranks: per head the
    first ``rank_k`` rows of its kind's key basis (``svd[l]["Wk"][h]`` post-RoPE,
    ``svd_pre[l]["Wk"][h]`` pre-RoPE, ``planes[l][h]`` planes: :func:`plane_rows`) and the first
    ``rank_v`` rows of ``svd[l]["Wv"][h]``, zero-padded to the layer's largest rank. Plane and
    post-RoPE heads make plain static states (R1: no rotation anywhere, every backend); pre-RoPE
    layers need ``rope=`` (:func:`layer_pre_rope`). Coefficient bits are the state's
    ``coefficients=``, not part of the basis. Saved with the allocation by
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
        layer_pre_rope(alloc, li)  # refuses a mixed layer here, before a state is built from it
        rk, rv = max(h.rank_k for h in layer), max(h.rank_v for h in layer)
        d, dv = svd[li]["Wk"].shape[-1], svd[li]["Wv"].shape[-1]
        B, E = np.zeros((len(layer), rk, d)), np.zeros((len(layer), rv, dv))
        for h, c in enumerate(layer):
            src = {"post_rope": svd[li]["Wk"], "pre_rope": None if svd_pre is None else svd_pre[li]["Wk"], "plane": None if planes is None else planes[li]}[c.key_basis]
            B[h, : c.rank_k] = np.asarray(src[h])[: c.rank_k]
            E[h, : c.rank_v] = np.asarray(svd[li]["Wv"][h])[: c.rank_v]
        out.append(StaticBasis(B=B, E=E, gamma=np.full(len(layer), float(gamma)), rank_k=tuple(h.rank_k for h in layer),
                               rank_v=tuple(h.rank_v for h in layer)))
    return out


# ------------------------------------------------------------------------------ byte counting
def side_parts(geom, side: str, rank: int, bits: int, group: int, kept: float = 1.0) -> dict:
    """Bytes per token of one head's ``side`` ("key"/"value") at ``rank`` and ``bits`` for the
    compressed fraction ``kept`` of the tokens, budget.py's convention: codes packed per token
    (ceil(r b / 8) bytes), fp16 scale + zero point per value token or per key group and channel,
    the unfinished key group in fp16; int8 (spec A10) r bytes + a float32 scale per token; fp16
    coefficients at 16 bits; and the fp16 basis amortised over the window (for every key basis
    kind: a plane basis is stored as dense rows like the others, so it is counted as such)."""
    fb, C = geom.float_bytes, geom.context
    dim = geom.head_dim if side == "key" else geom.value_dim
    out = {f"{side}_basis": rank * dim * fb / C}
    if rank == 0:
        return out
    if bits == 16:
        out[f"{side}_coefficients"] = rank * fb * kept
    elif bits == 8:  # spec A10: r bytes and one float32 scale per token
        out[f"{side}_codes"] = rank * kept
        out[f"{side}_scales"] = 4 * kept
    elif side == "value":
        out["value_codes"] = math.ceil(rank * bits / 8) * kept
        out["value_scales"] = 2 * fb * kept
    else:
        n = C * kept  # compressed tokens at the end of the window
        tail = n % group
        out["key_codes"] = math.ceil(rank * bits / 8) * (n - tail) / C
        out["key_scales"] = 2 * fb * rank * (n // group) / C
        out["key_tail"] = rank * fb * tail / C
    return out


def head_parts(geom, h: HeadAllocation, group: int, window: int = 0, sinks: int = 0) -> dict:
    """Bytes per token of one KV head under ``h``, with ``window`` + ``sinks`` tokens exact (fp16 K
    and V) and the others compressed; gamma (4 bytes) amortised."""
    exact = min(window + sinks, geom.context)
    kept = (geom.context - exact) / geom.context
    parts = {"gamma": 4 / geom.context}
    if exact:
        parts["exact_tokens"] = exact * geom.full_head_bytes / geom.context
    parts.update(side_parts(geom, "key", h.rank_k, h.bits_k, group, kept))
    parts.update(side_parts(geom, "value", h.rank_v, h.bits_v, group, kept))
    return parts


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
def _quantized(x: np.ndarray, bits: int, axis_kind: str, group: int) -> np.ndarray:
    """x (N, r) after spec/quantization.md Q1: keys per channel over complete groups of ``group``
    consecutive tokens (the rest stay exact, KIVI's tail), values per token."""
    from subspace_ref.quantization import dequantize_groups, quantize_groups

    if bits == 16 or x.shape[1] == 0:
        return x
    if bits == 8:  # spec A10's int8 (symmetric, per token, both sides)
        from subspace_ref.quantization import dequantize_rows, quantize_rows

        q, s = quantize_rows(x)
        return dequantize_rows(q, s, np.float64)
    if axis_kind == "value":
        q, s, z = quantize_groups(x, bits, -1)
        return dequantize_groups(q, s, z, -1, np.float64)
    done = (x.shape[0] // group) * group
    out = x.copy()
    g = x[:done].reshape(done // group, group, -1)
    q, s, z = quantize_groups(g, bits, -2)
    out[:done] = dequantize_groups(q, s, z, -2, np.float64).reshape(done, -1)
    return out


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


def side_losses(layer: dict, h: int, group_queries: np.ndarray, ranks, bits=BITS, group: int = 32, rope=None) -> dict:
    """Measured losses of one KV head (module docstring). ``layer``: ``keys`` (N, d) post-RoPE,
    ``keys_pre`` (N, d) or None, ``values`` (N, d_v), ``positions`` (N,), SVD rows ``Wk``,
    ``Wk_pre``, ``Wv`` ((dim, dim), rows by decreasing singular value), and ``Wk_plane`` or None
    (:func:`plane_rows`; its kind is measured at the even ranks only). Returns {("key", kind):
    {(rank, bits): loss}, ("value", None): {(rank, bits): loss}}."""
    from subspace_ref.rope import rotate

    K, V = layer["keys"], layer["values"]
    d = K.shape[1]
    s2 = 1.0 / d
    Sq = group_queries.T @ group_queries / len(group_queries)  # E[q q^T]
    spread = float(np.sum(V.var(axis=0)))
    out = {}
    kinds = [("post_rope", K, layer["Wk"])] + ([("pre_rope", layer["keys_pre"], layer["Wk_pre"])] if layer.get("keys_pre") is not None else [])
    if layer.get("Wk_plane") is not None:  # R1: a plane basis projects post-RoPE keys like any static basis
        kinds.append(("plane", K, layer["Wk_plane"]))
    for kind, X, W in kinds:
        table = {}
        for r in ranks:
            if kind == "plane" and r % 2:
                continue  # whole planes only
            C = X @ W[:r].T
            for b in bits:
                dk = X - _quantized(C, b, "key", group) @ W[:r]
                if kind == "pre_rope":
                    dk = rotate(dk, layer["positions"], rope)
                table[(r, b)] = s2 * float(np.einsum("ij,ni,nj->", Sq, dk, dk)) / len(dk) * spread
        out[("key", kind)] = table
    table = {}
    W = layer["Wv"]
    for r in ranks:
        D = V @ W[:r].T
        for b in bits:
            dv = V - _quantized(D, b, "value", group) @ W[:r]
            table[(r, b)] = float(np.sum(dv * dv)) / len(dv)
    out[("value", None)] = table
    return out


def allocate(losses: list, geom, *, compression_ratio: float | None = None, bytes_per_token: float | None = None,
             group: int = 32, window: int = 0, sinks: int = 0, min_rank_k: int = 1) -> Allocation:
    """The allocation of ``compression_ratio`` x the full fp16 cache (or ``bytes_per_token``)
    minimising the summed measured loss. ``losses[layer][head]``: :func:`side_losses` output.
    Keys keep at least ``min_rank_k`` dimensions (rank 0 would make attention uniform)."""
    if (compression_ratio is None) == (bytes_per_token is None):
        raise ValueError("give exactly one of compression_ratio= and bytes_per_token=")
    budget = compression_ratio * geom.full_bytes_per_token if bytes_per_token is None else float(bytes_per_token)
    if not budget > 0:
        raise ValueError(f"the budget must be positive, got {budget}")
    exact = min(window + sinks, geom.context)
    kept = (geom.context - exact) / geom.context
    fixed = geom.units * (4 / geom.context + exact * geom.full_head_bytes / geom.context)
    tables = {}
    for li, layer in enumerate(losses):
        for h, table in enumerate(layer):
            for (side, kind), entries in table.items():
                cands = [Candidate(sum(side_parts(geom, side, r, b, group, kept).values()), loss, (kind, r, b))
                         for (r, b), loss in entries.items() if side == "value" or r >= min_rank_k]
                key = (li, h, side)
                tables[key] = tables.get(key, []) + cands
    chosen, spent, loss = greedy(tables, budget - fixed)
    heads = []
    for li, layer in enumerate(losses):
        row = []
        for h in range(len(layer)):
            kind, rk, bk = chosen[(li, h, "key")].config
            _, rv, bv = chosen[(li, h, "value")].config
            row.append(HeadAllocation(int(rk), int(rv), int(bk), int(bv), kind))
        heads.append(tuple(row))
    return Allocation(tuple(heads), group, budget, window, sinks, loss, dict(bytes_per_token=spent + fixed))


__all__ = ["BITS", "KEY_BASES", "Allocation", "Candidate", "HeadAllocation", "allocate", "allocation_bases", "greedy", "head_parts",
           "layer_pre_rope", "lower_hull", "plane_rows", "side_losses", "side_parts"]
