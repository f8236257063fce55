"""``allocated_states``: the state factory of an allocation (spec/layer_state.md L2), each layer a
:class:`~subspace_ref.LayerState` whose KV heads store what the allocator chose for them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from subspace_ref.allocation import Allocation
from subspace_ref.calibration import StaticBasis
from subspace_ref.hf.state_factories import StateSpec, default_basis_format
from subspace_ref.layer_state import LayerState
from subspace_ref.rope import RopeParams


class allocated_states:
    """Factory of :class:`LayerState` s from one :class:`StaticBasis` per layer (as
    :func:`~subspace_ref.allocation.allocation_bases` makes them) and the :class:`Allocation` they
    hold: per head its ranks, bits and basis kinds, the layer's exact ``window`` and ``sinks`` and
    the key group size from the allocation. ``rope``: the model's
    :class:`~subspace_ref.rope.RopeParams`, required when a head has pre-RoPE keys. ``dtype`` and
    ``basis_format`` as in :class:`~subspace_ref.hf.static_states`.

    Example::

        factory = allocated_states(bases, allocation, rope=RopeParams.from_config(model.config))
        cache = SubspaceCache(model.config, factory)
    """

    def __init__(self, bases: Sequence[StaticBasis | None], allocation: Allocation, *, rope: RopeParams | None = None, dtype: Any = None,
                 basis_format: str | None = None):
        if not isinstance(allocation, Allocation):
            raise TypeError(f"allocation must be an Allocation, got {type(allocation).__name__}")
        if len(bases) != allocation.layers:
            raise ValueError(f"bases: one per layer of the allocation ({allocation.layers}), got {len(bases)}")
        for i, (basis, heads) in enumerate(zip(bases, allocation.heads)):
            if not isinstance(basis, StaticBasis):
                raise ValueError(f"bases[{i}]: every layer of an allocation needs a StaticBasis, got {type(basis).__name__}")
            if basis.heads != len(heads):
                raise ValueError(f"bases[{i}] has {basis.heads} heads, the allocation's layer {i} has {len(heads)}")
        if rope is None and any(h.key_basis == "pre_rope" for layer in allocation.heads for h in layer):
            raise ValueError("rope: the allocation has pre-RoPE key bases; give the model's RopeParams (RopeParams.from_config(model.config))")
        self.bases, self.allocation, self.rope, self.dtype, self.basis_format = list(bases), allocation, rope, dtype, basis_format

    def __call__(self, spec: StateSpec) -> LayerState:
        a = self.allocation
        dtype = self.dtype or spec.state_dtype
        return LayerState.from_heads(
            self.bases[spec.layer_idx], a.heads[spec.layer_idx], rope=self.rope, window=a.window, sinks=a.sinks, group_size=a.group,
            batch=spec.batch, dtype=dtype, bases=default_basis_format(self.basis_format, dtype),
        )


__all__ = ["allocated_states"]
