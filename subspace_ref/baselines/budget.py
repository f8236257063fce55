"""KV bytes per token of every baseline, and the configuration of each at a byte budget.

Convention (one for all methods): the reference is the full cache stored in **fp16**
(``float_bytes = 2``), i.e. ``layers * kv_heads * (d + d_v) * 2`` bytes per token. A method's
bytes per token are what its cache holds **at the end of a window of ``context`` tokens**
(the peak for eviction methods), divided by ``context``, summed over layers and KV heads,
counting everything it must keep:

* quantised KV: packed codes, a scale and a zero point (fp16) per channel per group of ``group``
  tokens for keys and per token for values, plus the residual keys of an unfinished group kept in
  fp16 (``context mod group`` tokens);
* sliding window / StreamingLLM: the kept tokens only (post-RoPE keys carry their position, so a
  ring buffer needs no index);
* H2O: the kept tokens, plus per kept token and KV head a float32 accumulated score and an int16
  position (to know which tokens are in the recent window);
* subspace: the coefficients (fp16, or int8 plus one float32 scale per token and side, spec A10),
  plus the bases ``(r d + r_v d_v)`` fp16 and gamma (float32) per head, amortised over the
  window (conservatively counted per sequence, although they are shared by all sequences).

Computation itself runs in the model's float32; fp16 rounding of stored floats is not simulated
(relative 5e-4, far below every effect measured).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: The budgets of the comparison, as fractions of the full (fp16) cache.
BUDGETS = (0.5, 0.25, 0.125)


@dataclass(frozen=True)
class Geometry:
    """The cache's shape: per-layer KV heads of key size ``head_dim`` and value size ``value_dim``,
    over a window of ``context`` tokens, floats stored in ``float_bytes``."""

    layers: int
    kv_heads: int
    head_dim: int
    value_dim: int
    context: int
    float_bytes: int = 2

    @classmethod
    def of_model(cls, model, context: int, float_bytes: int = 2) -> "Geometry":
        c = model.config
        heads = c.num_attention_heads
        d = getattr(c, "head_dim", None) or c.hidden_size // heads
        return cls(c.num_hidden_layers, getattr(c, "num_key_value_heads", None) or heads, d, d, int(context), float_bytes)

    @property
    def units(self) -> int:
        """Layer x KV head pairs."""
        return self.layers * self.kv_heads

    @property
    def full_head_bytes(self) -> float:
        """Bytes per token and KV head of the full cache."""
        return (self.head_dim + self.value_dim) * self.float_bytes

    @property
    def full_bytes_per_token(self) -> float:
        return self.units * self.full_head_bytes


@dataclass(frozen=True)
class Bytes:
    """Bytes per token of one method, with a breakdown (per token, all layers and heads)."""

    per_token: float
    full: float
    parts: dict = field(default_factory=dict)

    @property
    def fraction(self) -> float:
        return self.per_token / self.full


def make_bytes(geom: Geometry, **per_head_parts: float) -> Bytes:
    """A :class:`Bytes` from per-(layer, KV head, token) parts."""
    parts = {k: v * geom.units for k, v in per_head_parts.items()}
    return Bytes(sum(parts.values()), geom.full_bytes_per_token, parts)


def full_bytes(geom: Geometry) -> Bytes:
    return make_bytes(geom, keys=geom.head_dim * geom.float_bytes, values=geom.value_dim * geom.float_bytes)


def capacity_for(geom: Geometry, fraction: float, extra_per_token: float = 0.0) -> int:
    """The most tokens an eviction cache may hold (per KV head) at ``fraction`` of the full cache
    of ``geom.context`` tokens, each kept token costing the full K/V plus ``extra_per_token``."""
    budget = fraction * geom.context * geom.full_head_bytes
    return int(math.floor(budget / (geom.full_head_bytes + extra_per_token) + 1e-9))


def subspace_ranks_for(geom: Geometry, fraction: float, coefficients: str = "fp16", kept_fraction: float = 1.0) -> tuple[int, int]:
    """The largest r + r_v (split r >= r_v, r - r_v <= 1) whose subspace bytes fit the budget,
    when a fraction ``kept_fraction`` of the tokens' coefficients is kept (1: all)."""
    from subspace_ref.baselines.combined import Subspace

    best = (1, 1)
    for total in range(2, geom.head_dim + geom.value_dim + 1):
        r, rv = (total + 1) // 2, total // 2
        if r > geom.head_dim or rv > geom.value_dim:
            break
        m = Subspace(rank_k=r, rank_v=rv, coefficients=coefficients)
        b = m.bytes(geom, kept_fraction=kept_fraction)
        if b.fraction <= fraction + 1e-12:
            best = (r, rv)
    return best


def methods_at(geom: Geometry, fraction: float, *, sinks: int = 4, group: int = 64) -> list:
    """Every baseline configured for ``fraction`` of the full cache (quantisation: the bit width
    nearest the budget, 16·fraction bits, whose real bytes are reported even when above it)."""
    from subspace_ref.baselines.combined import Subspace, SubspaceWindow
    from subspace_ref.baselines.h2o import H2O
    from subspace_ref.baselines.quantized import QuantizedKV
    from subspace_ref.baselines.sliding_window import SlidingWindow
    from subspace_ref.baselines.streaming_llm import StreamingLLM

    out = []
    bits = int(round(16 * fraction))
    if bits in (2, 4, 8):
        out.append(QuantizedKV(bits=bits, group=group))
    out.append(SlidingWindow(window=capacity_for(geom, fraction)))
    m = capacity_for(geom, fraction)
    out.append(StreamingLLM(sinks=min(sinks, m - 1), window=m - min(sinks, m - 1)))
    m = capacity_for(geom, fraction, H2O.EXTRA_BYTES)
    out.append(H2O(heavy=m // 2, recent=m - m // 2))
    r, rv = subspace_ranks_for(geom, fraction, "fp16")
    out.append(Subspace(rank_k=r, rank_v=rv, coefficients="fp16"))
    r, rv = subspace_ranks_for(geom, fraction, "int8")
    out.append(Subspace(rank_k=r, rank_v=rv, coefficients="int8"))
    # subspace + window: half the tokens, at twice the per-token budget
    w = geom.context // 2
    r, rv = subspace_ranks_for(geom, fraction, "fp16", kept_fraction=w / geom.context)
    out.append(SubspaceWindow(rank_k=r, rank_v=rv, window=w))
    return out


__all__ = ["BUDGETS", "Bytes", "Geometry", "capacity_for", "full_bytes", "make_bytes", "methods_at", "subspace_ranks_for"]
