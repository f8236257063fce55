"""The byte convention: what a cache costs per token, one rule for the allocator, the states'
budgets and every baseline (spec/quantization.md Q3).

The reference is the full cache stored in **fp16** (``float_bytes = 2``), i.e.
``layers * kv_heads * (d + d_v) * 2`` bytes per token. A method's bytes per token are what its
cache holds **at the end of a window of ``context`` tokens** (the peak for eviction methods),
divided by ``context``, summed over layers and KV heads, counting everything it must keep:

* quantised KV: packed codes, a scale and a zero point (fp16) per channel per group of ``group``
  tokens for keys and per token for values, plus the residual keys of an unfinished group kept in
  fp16 (``context mod group`` tokens);
* sliding window / StreamingLLM: the kept tokens only (post-RoPE keys carry their position, so a
  ring buffer needs no index);
* H2O: the kept tokens, plus per kept token and KV head a float32 accumulated score and an int16
  position (to know which tokens are in the recent window);
* subspace: the coefficients as their format stores them (:meth:`subspace_ref.formats.
  CoefficientFormat.stored_bytes`: fp16; int8 plus one float32 scale per token, spec A10; int4/int2
  with fp16 scales and zero points, spec/quantization.md Q2-Q3), plus the bases ``(r d + r_v d_v)``
  fp16 and gamma (float32) per head, amortised over the window (conservatively counted per
  sequence, although they are shared by all sequences).

Computation itself runs in the model's float32; fp16 rounding of stored floats is not simulated
(relative 5e-4, far below every effect measured).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from subspace_ref.formats import of_bits


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
        return cls.of_config(model.config, context, float_bytes)

    @classmethod
    def of_config(cls, config, context: int, float_bytes: int = 2) -> "Geometry":
        """The geometry of a transformers config (its text config): KV heads and head size as
        transformers computes them."""
        c = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
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
    """The full fp16 cache: the reference every fraction is of."""
    return make_bytes(geom, keys=geom.head_dim * geom.float_bytes, values=geom.value_dim * geom.float_bytes)


def capacity_for(geom: Geometry, fraction: float, extra_per_token: float = 0.0) -> int:
    """The most tokens an eviction cache may hold (per KV head) at ``fraction`` of the full cache
    of ``geom.context`` tokens, each kept token costing the full K/V plus ``extra_per_token``."""
    budget = fraction * geom.context * geom.full_head_bytes
    return int(math.floor(budget / (geom.full_head_bytes + extra_per_token) + 1e-9))


def side_parts(geom: Geometry, side: str, rank: int, bits: int, group: int, kept: float = 1.0, basis: bool = True) -> dict:
    """Bytes per token of one head's ``side`` ("key"/"value") at ``rank`` and ``bits`` (16, 8, 4
    or 2) when the fraction ``kept`` of the window's tokens is compressed (spec/quantization.md
    Q3; the whole number of tokens nearest ``kept`` x context): what the format stores for those
    tokens (:meth:`~subspace_ref.formats.CoefficientFormat.stored_bytes`) over the window, and
    the fp16 basis amortised over it (for every key basis kind: a plane basis, spec/rope.md P4,
    is stored as dense rows like the others; ``basis=False``: an identity side, which stores
    none, spec/layer_state.md L4)."""
    fb, C = geom.float_bytes, geom.context
    dim = geom.head_dim if side == "key" else geom.value_dim
    out = {f"{side}_basis": rank * dim * fb / C if basis else 0.0}
    for name, total in of_bits(bits).stored_bytes(side, rank, round(C * kept), group, fb).items():
        out[name] = total / C
    return out


def head_parts(geom: Geometry, h: Any, group: int, window: int = 0, sinks: int = 0) -> dict:
    """Bytes per token of one KV head under ``h`` (a :class:`~subspace_ref.allocation.
    HeadAllocation`: ``rank_k``, ``rank_v``, ``bits_k``, ``bits_v``), with ``window`` + ``sinks``
    tokens exact (fp16 K and V, spec/window.md W5, W9) and the others compressed; gamma (4 bytes)
    amortised."""
    exact = min(window + sinks, geom.context)
    kept = (geom.context - exact) / geom.context
    parts = {"gamma": 4 / geom.context}
    if exact:
        parts["exact_tokens"] = exact * geom.full_head_bytes / geom.context
    parts.update(side_parts(geom, "key", h.rank_k, h.bits_k, group, kept, getattr(h, "key_basis", "") != "identity"))
    parts.update(side_parts(geom, "value", h.rank_v, h.bits_v, group, kept, getattr(h, "value_basis", "") != "identity"))
    return parts


__all__ = ["Bytes", "Geometry", "capacity_for", "full_bytes", "head_parts", "make_bytes", "side_parts"]
