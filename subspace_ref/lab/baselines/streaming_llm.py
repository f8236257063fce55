"""StreamingLLM (Xiao et al. 2023; own code): ``sinks`` first tokens plus a window of the
``window`` most recent. Keys are cached after RoPE at their original positions (as transformers
caches them), i.e. without StreamingLLM's in-cache re-positioning, which matters only beyond the
trained context; every evaluation here stays within it."""

from __future__ import annotations

from dataclasses import dataclass

from subspace_ref.byte_convention import Bytes, Geometry, make_bytes
from subspace_ref.lab.baselines.sliding_window import _WindowRuntime


@dataclass(frozen=True)
class StreamingLLM:
    sinks: int
    window: int
    family: str = "StreamingLLM"
    source: str = "own code (eviction mask over a DynamicCache)"

    @property
    def name(self) -> str:
        return f"sinks {self.sinks} + window {self.window}"

    def bytes(self, geom: Geometry) -> Bytes:
        kept = min(self.sinks + self.window, geom.context) / geom.context
        return make_bytes(geom, keys=geom.head_dim * geom.float_bytes * kept, values=geom.value_dim * geom.float_bytes * kept)

    def runtime(self, layer_idx: int):
        return _WindowRuntime(self.window, self.sinks)
