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

    Parameters
    ----------
    bases : sequence of StaticBasis
        One per layer, holding each head's allocated ranks.
    allocation : Allocation
        What each head stores.
    rope : RopeParams, optional
        Required when a head has pre-RoPE keys.
    dtype : numpy dtype, optional
        Of the states; default :attr:`StateSpec.state_dtype`.
    basis_format : str, optional
        Storage of the bases.

    Returns
    -------
    allocated_states
        Called with a :class:`StateSpec`, returns an empty :class:`LayerState`.

    Raises
    ------
    TypeError
        If ``allocation`` is not an :class:`Allocation`.
    ValueError
        If the bases do not match the allocation's layers and heads, or pre-RoPE heads come
        without ``rope``.

    Examples
    --------
    ::

        import torch
        from subspace_ref.hf import allocated_states, calibration_losses, compress
        from subspace_ref.models.default_model import load_model

        model, config = load_model("default")
        ids = torch.tensor([list(b"def read_config(path):\\n    with open(path) as f:\\n        return json.load(f)\\n" * 4)])
        cal = calibration_losses(model, ids)                     # slow: every candidate of every head
        allocation = cal.allocate(model, compression_ratio=0.25, window=32, sinks=4)
        factory = allocated_states(cal.bases(allocation), allocation, rope=cal.rope)
        with compress(model, factory) as kv:
            out = kv.generate(ids, max_new_tokens=4, do_sample=False)
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
