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
  centred values);
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
#: Key basis kinds: calibrated on post-RoPE keys (A6) or on un-rotated keys (spec/rope.md P2).
KEY_BASES = ("post_rope", "pre_rope")


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


# ------------------------------------------------------------------------------ byte counting
def side_parts(geom, side: str, rank: int, bits: int, group: int, kept: float = 1.0) -> dict:
    """Bytes per token of one head's ``side`` ("key"/"value") at ``rank`` and ``bits`` for the
    compressed fraction ``kept`` of the tokens, budget.py's convention: codes packed per token
    (ceil(r b / 8) bytes), fp16 scale + zero point per value token or per key group and channel,
    the unfinished key group in fp16; int8 (spec A10) r bytes + a float32 scale per token; fp16
    coefficients at 16 bits; and the fp16 basis amortised over the window."""
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


def side_losses(layer: dict, h: int, group_queries: np.ndarray, ranks, bits=BITS, group: int = 32, rope=None) -> dict:
    """Measured losses of one KV head (module docstring). ``layer``: ``keys`` (N, d) post-RoPE,
    ``keys_pre`` (N, d) or None, ``values`` (N, d_v), ``positions`` (N,), SVD rows ``Wk``,
    ``Wk_pre``, ``Wv`` ((dim, dim), rows by decreasing singular value). Returns {("key", kind):
    {(rank, bits): loss}, ("value", None): {(rank, bits): loss}}."""
    from subspace_ref.rope import rotate

    K, V = layer["keys"], layer["values"]
    d = K.shape[1]
    s2 = 1.0 / d
    Sq = group_queries.T @ group_queries / len(group_queries)  # E[q q^T]
    spread = float(np.sum(V.var(axis=0)))
    out = {}
    kinds = [("post_rope", K, layer["Wk"])] + ([("pre_rope", layer["keys_pre"], layer["Wk_pre"])] if layer.get("keys_pre") is not None else [])
    for kind, X, W in kinds:
        table = {}
        for r in ranks:
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


__all__ = ["BITS", "KEY_BASES", "Allocation", "Candidate", "HeadAllocation", "allocate", "greedy", "head_parts", "lower_hull", "side_losses", "side_parts"]
