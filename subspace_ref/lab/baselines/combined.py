"""Subspace projection as a baseline entry, and its combinations.

* :class:`Subspace`: static per-head bases (spec A6) at ranks ``r``/``r_v``, scored by
  :func:`subspace_ref.hf.teacher_forced` with :func:`subspace_ref.hf.static_states` (the
  project's own cache; ``coefficients="int8"``: spec A10 INT8 coefficients, one float32 scale per
  token and side, on the numpy backend — the torch backend refuses int8 states).
* :class:`SubspaceWindow`: static projection plus a sliding window of ``window`` tokens: the
  cache keeps only the last ``window`` tokens' coefficients. Evaluated as exact attention over the
  projected keys ``K B^T B`` and values ``V E^T E`` (equal to coefficient-space attention, spec A2)
  under the window mask, through the baselines' attention function.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from subspace_ref.lab.baselines._attention import masked_attention
from subspace_ref.byte_convention import Bytes, Geometry, make_bytes
from subspace_ref.lab.baselines.sliding_window import window_keep


def _subspace_parts(geom: Geometry, r: int, rv: int, coefficients: str, kept_fraction: float) -> dict:
    if coefficients not in ("fp16", "int8"):
        raise ValueError(f'coefficients must be "fp16" or "int8", got {coefficients!r}')
    cb = 1 if coefficients == "int8" else geom.float_bytes
    parts = dict(coefficients=(r + rv) * cb * kept_fraction)
    if coefficients == "int8":
        parts["coefficient_scales"] = 2 * 4 * kept_fraction
    parts["bases"] = ((r * geom.head_dim + rv * geom.value_dim) * geom.float_bytes + 4) / geom.context
    return parts


@dataclass(frozen=True)
class Subspace:
    rank_k: int
    rank_v: int
    coefficients: str = "fp16"
    source: str = "this project (subspace_ref.hf.SubspaceCache, static states, teacher_forced)"

    @property
    def family(self) -> str:
        return "subspace INT8" if self.coefficients == "int8" else "subspace"

    @property
    def name(self) -> str:
        return f"subspace r={self.rank_k}/{self.rank_v}" + (" int8" if self.coefficients == "int8" else "")

    def bytes(self, geom: Geometry, kept_fraction: float = 1.0) -> Bytes:
        return make_bytes(geom, **_subspace_parts(geom, self.rank_k, self.rank_v, self.coefficients, kept_fraction))

    def factory(self, bases: list):
        """The state factory for ``bases`` (one StaticBasis per layer, at these ranks)."""
        from subspace_ref.hf import static_states

        return static_states(bases, coefficients="int8" if self.coefficients == "int8" else "float")

    @property
    def backend(self) -> str:
        return "numpy" if self.coefficients == "int8" else "torch"


@dataclass(frozen=True)
class SubspaceWindow:
    rank_k: int
    rank_v: int
    window: int
    family: str = "subspace + window"
    source: str = "own code (projection + window mask over a DynamicCache; bases from this project's calibration)"

    @property
    def name(self) -> str:
        return f"subspace r={self.rank_k}/{self.rank_v} + window {self.window}"

    def bytes(self, geom: Geometry) -> Bytes:
        return make_bytes(geom, **_subspace_parts(geom, self.rank_k, self.rank_v, "fp16", min(self.window, geom.context) / geom.context))

    def with_bases(self, bases: list) -> "_BoundSubspaceWindow":
        return _BoundSubspaceWindow(self, bases)


class _BoundSubspaceWindow:
    """A :class:`SubspaceWindow` with its per-layer StaticBasis objects (runtime for the attention function)."""

    def __init__(self, m: SubspaceWindow, bases: list):
        self.m = m
        self.proj = []
        for b in bases:
            PK = torch.from_numpy(np.einsum("hrd,hre->hde", b.B, b.B)).float()
            PE = torch.from_numpy(np.einsum("hrd,hre->hde", b.E, b.E)).float()
            g = torch.from_numpy(np.asarray(b.gamma, dtype=np.float64)).float()
            self.proj.append((PK, PE, g))

    def runtime(self, layer_idx: int):
        return _SubspaceWindowRuntime(self.m.window, *self.proj[layer_idx])


class _SubspaceWindowRuntime:
    def __init__(self, window, PK, PE, gamma):
        self.window, self.PK, self.PE, self.gamma = window, PK, PE, gamma

    def attend(self, q, k, v, scaling):
        k = torch.einsum("bhnd,hde->bhne", k, self.PK.to(k.dtype)) * self.gamma.to(k.dtype)[None, :, None, None]
        v = torch.einsum("bhnd,hde->bhne", v, self.PE.to(v.dtype))
        keep = window_keep(q.shape[2], k.shape[2], self.window, 0, q.device)
        return masked_attention(q, k, v, scaling, keep)
