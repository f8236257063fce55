"""The menu of baselines: every method configured for a byte budget (a fraction of the full fp16
cache), its bytes counted by the one convention of :mod:`subspace_ref.byte_convention`
(spec/quantization.md Q3)."""

from __future__ import annotations

from subspace_ref.lab.baselines.combined import Subspace, SubspaceWindow
from subspace_ref.lab.baselines.h2o import H2O
from subspace_ref.lab.baselines.quantized import QuantizedKV
from subspace_ref.lab.baselines.sliding_window import SlidingWindow
from subspace_ref.lab.baselines.streaming_llm import StreamingLLM
from subspace_ref.byte_convention import Geometry, capacity_for

#: The budgets of the comparison, as fractions of the full (fp16) cache.
BUDGETS = (0.5, 0.25, 0.125)


def subspace_ranks_for(geom: Geometry, fraction: float, coefficients: str = "fp16", kept_fraction: float = 1.0) -> tuple[int, int]:
    """The largest r + r_v (split r >= r_v, r - r_v <= 1) whose subspace bytes fit the budget,
    when a fraction ``kept_fraction`` of the tokens' coefficients is kept (1: all)."""
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


__all__ = ["BUDGETS", "methods_at", "subspace_ranks_for"]
