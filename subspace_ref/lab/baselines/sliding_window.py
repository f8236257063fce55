"""Sliding-window KV cache (own code): keep the last ``window`` tokens (the new one included)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from subspace_ref.lab.baselines._attention import masked_attention
from subspace_ref.byte_convention import Bytes, Geometry, make_bytes


def window_keep(n: int, T: int, window: int, sinks: int = 0, device=None) -> torch.Tensor:
    """(n, T) bool: at query position p = T-n+i the cache holds tokens t <= p with t < sinks or
    t > p - (window): the first ``sinks`` tokens and the ``window`` most recent (p included)."""
    pos = torch.arange(T - n, T, device=device)[:, None]
    t = torch.arange(T, device=device)[None, :]
    return (t <= pos) & ((t < sinks) | (t > pos - window))


@dataclass(frozen=True)
class SlidingWindow:
    window: int
    family: str = "sliding window"
    source: str = "own code (eviction mask over a DynamicCache)"

    @property
    def name(self) -> str:
        return f"window {self.window}"

    def bytes(self, geom: Geometry) -> Bytes:
        kept = min(self.window, geom.context) / geom.context
        return make_bytes(geom, keys=geom.head_dim * geom.float_bytes * kept, values=geom.value_dim * geom.float_bytes * kept)

    def runtime(self, layer_idx: int):
        return _WindowRuntime(self.window, 0)


class _WindowRuntime:
    def __init__(self, window: int, sinks: int):
        self.window, self.sinks = window, sinks

    def attend(self, q, k, v, scaling):
        keep = window_keep(q.shape[2], k.shape[2], self.window, self.sinks, q.device)
        return masked_attention(q, k, v, scaling, keep)
