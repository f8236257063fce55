"""The cache layer of a :class:`~subspace_ref.LayerState` (heads of different configurations,
spec/layer_state.md): one :class:`~subspace_ref.hf.SubspaceLayer` per head group, each
given its KV heads' keys and values and its query heads, the outputs put back in head order.

Every feature of a uniform layer (prefill, masks, beams, crop, restore points, the model's
dtype) is the groups' own: this layer only splits and joins along the head axis.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

import subspace_ref
from subspace_ref.hf import attention as _attn
from subspace_ref.hf.cache_layer import SubspaceLayer, _to_numpy
from subspace_ref.layer_state import HeadGroup, LayerState, query_rows


class GroupedLayer(CacheLayerMixin):
    """One layer of a :class:`~subspace_ref.hf.SubspaceCache` holding a :class:`LayerState`:
    ``children[i]`` is the :class:`SubspaceLayer` of head group i (its KV heads ``heads[i]``).

    A :class:`SubspaceLayer` whose factory returns a :class:`LayerState` replaces itself with
    one (:meth:`SubspaceCache.grouped_layer`); the methods are transformers' ``CacheLayerMixin``.

    Parameters
    ----------
    cache : SubspaceCache
        The cache holding the layer.
    layer_idx : int
        The layer's index.
    layer : LayerState
        The adopted (empty) layer state.
    dtype : torch.dtype
        The model's dtype.
    device : torch.device
        The keys' device.

    Examples
    --------
    ::

        import torch
        from subspace_ref import LayerState
        from subspace_ref.hf import GroupedLayer, compress, full_rank_states
        from subspace_ref.layer_state import HeadGroup
        from subspace_ref.models.default_model import load_model

        model, config = load_model("default")
        full = full_rank_states()
        one_group = lambda spec: LayerState(spec.heads, [HeadGroup(tuple(range(spec.heads)), full(spec))])
        with compress(model, one_group) as kv:
            cache = kv.cache()
            model(input_ids=torch.tensor([list(b"import os")]), cache=cache)
        isinstance(cache.layers[0], GroupedLayer), cache.layers[0].heads   # (True, [(0, 1)])
    """

    is_sliding = False
    is_compileable = False
    #: a decode step (one new token per sequence, no mask nor soft-capping) attends by one
    #: ``subspace_ref.attend`` over the layer state (spec/layer_state.md L5.2: on the torch
    #: backend, one call of the C kernels for every group) rather than one per child
    one_attend = True
    #: a decode step appends every child's token by one call of the backend's layer append
    #: (spec/layer_state.md L3; torch/CPU: ``subspace_ref_torch.layer_append``) where it serves the step
    one_append = True

    def __init__(self, cache, layer_idx: int, layer: LayerState, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.kv_heads = layer.kv_heads
        self.heads = [g.heads for g in layer.groups]
        self.flags = [g.flags for g in layer.groups]
        self.children = []
        for g in layer.groups:
            child = SubspaceLayer(cache, layer_idx)
            child.state, child.dtype, child.device, child.is_initialized = g.state, dtype, device, True
            child.keep_restore_point()  # built during a forward: its restore point is the empty state
            self.children.append(child)
        self._index = [torch.as_tensor(h, dtype=torch.long, device=device) for h in self.heads]
        self._query_rows: dict[int, tuple] = {}  # per query heads per KV head g: (rows per group, inverse), as index tensors
        self.dtype, self.device, self.is_initialized = dtype, device, True
        self.pending_keys: torch.Tensor | None = None
        self._new_tokens: tuple | None = None  # the layer's keys and values of the pending update, (B, H, n, d)
        self._forward_tokens: tuple | None = None  # those of the current forward, where a one-call step took them (see crop)
        self._appender: tuple | None = None  # (admission, the backend's one-call append of a decode step or None)
        self._decoder: tuple | None = None  # (admission, the backend's one-call append and attention of a decode step or None)
        self._layer_state: LayerState | None = None  # :attr:`state` while the children hold the same state objects

    def __repr__(self) -> str:
        return f"GroupedLayer({self.layer_idx}, {self.state!r})"

    @property
    def state(self) -> LayerState:
        held = self._layer_state
        if held is None or any(g.state is not c.state for g, c in zip(held.groups, self.children)):
            held = self._layer_state = LayerState(self.kv_heads, [HeadGroup(h, c.state, **f) for h, c, f in zip(self.heads, self.children, self.flags)])
        return held

    # -- CacheLayerMixin
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError(f"layer {self.layer_idx}: a grouped layer is built initialised")

    @torch.compiler.disable(reason="a SubspaceCache appends and attends in Python outside any graph")
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Hand each group its heads' new keys and values as pending and return the keys tagged
        with this layer (see :meth:`SubspaceLayer.update`)."""
        if self.pending_keys is not None:
            self._clear_pending()
            raise RuntimeError(f"layer {self.layer_idx}: the previous update was never consumed by the attention function")
        first = self.children[0].state
        if key_states.ndim != 4 or key_states.shape[0] != first.batch or key_states.shape[1] != self.kv_heads or key_states.shape[3] != first.d:
            raise ValueError(f"layer {self.layer_idx}: keys of shape {tuple(key_states.shape)} do not fit the layer {self.state!r} (batch {first.batch})")
        self.cache.begin_forward(self.layer_idx)
        self.pending_keys = key_states
        self._new_tokens = (key_states, value_states)  # the children get their heads' share when they need it (_hand_down)
        self._forward_tokens = None
        _attn.tag(key_states, self)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.children[0].get_seq_length() + (0 if self.pending_keys is None else self.pending_keys.shape[2])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Back to an uninitialised layer of the cache's factory (built again on the next update)."""
        self._clear_pending()
        self.cache.set_layer(self.layer_idx, SubspaceLayer(self.cache, self.layer_idx))

    def offload(self):
        pass

    def prefetch(self):
        pass

    # restore points and rollback act on the children directly (SubspaceCache.state_layers)
    @property
    def is_croppable(self) -> bool:
        return True

    def crop(self, tokens_to_remove: int) -> None:
        for child, index in zip(self.children, self._index):
            if self._forward_tokens is not None and child._restore_point is not None and child._forward_tokens is None:
                child._forward_tokens = tuple(x.index_select(1, index) for x in self._forward_tokens)  # what take_pending keeps
            child.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for child in self.children:
            child.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        for child in self.children:
            child.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for child in self.children:
            child.batch_select_indices(indices)

    # -- attention
    def _clear_pending(self) -> None:
        _attn.untag(self.pending_keys)
        self.pending_keys = self._new_tokens = None
        for child in self.children:
            child._clear_pending()

    def abandon(self) -> None:
        """The forward failed: drop what is pending and give back every layer's tokens of this forward."""
        self._clear_pending()
        self.cache.rollback_forward()

    def attend_pending(self, query: torch.Tensor, scale: float, *, mask: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
        """Each group appends its pending tokens and attends its query heads (those of its KV
        heads: query head i reads KV head i // g) by :meth:`SubspaceLayer.attend_pending`; the
        outputs (B, H_q, n, d_v) come back in query-head order."""
        _attn.untag(self.pending_keys)
        tokens, self.pending_keys, self._new_tokens = self._new_tokens, None, None
        if self.one_attend and query.shape[2] == 1 and mask is None and softcap is None:
            return self._decode_step(query, scale, tokens)
        g = query.shape[1] // self.kv_heads
        if g not in self._query_rows:
            rows, inverse = query_rows(self.state.groups, g)
            as_index = lambda r: torch.as_tensor(r, dtype=torch.long, device=query.device)  # noqa: E731
            self._query_rows[g] = ([as_index(r) for r in rows], as_index(inverse))
        rows, inverse = self._query_rows[g]
        self._hand_down(tokens)
        outs = [child.attend_pending(query.index_select(1, r), scale, mask=mask, softcap=softcap) for child, r in zip(self.children, rows)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1).index_select(1, inverse)

    def _hand_down(self, tokens: tuple) -> None:
        """Give each child its heads' share of the layer's pending keys and values (B, H, n, d), as
        its own ``update`` would have."""
        keys, values = tokens
        for child, index in zip(self.children, self._index):
            child.pending_keys, child.pending_values = keys.index_select(1, index), values.index_select(1, index)

    def _decode_step(self, query: torch.Tensor, scale: float, tokens: tuple) -> torch.Tensor:
        """One new token per sequence: every child appends its pending token and one
        ``subspace_ref.attend`` over the layer state (spec/layer_state.md L5) serves all the query
        heads, (B, H_q, 1, d) -> (B, H_q, 1, d_v). Where the backend serves the whole step in one
        call (:meth:`_one_call_step`), that is taken (the forward's tokens are kept for a crop, as
        :meth:`SubspaceLayer.take_pending` keeps them); else the appends go by one call of the
        backend's layer append where it serves them (:meth:`_append_step`), or as each child's own
        :meth:`SubspaceLayer.attend_pending` would (on a failure the attention function's
        :meth:`abandon` gives back every layer's tokens of the forward)."""
        n = query.shape[2]
        if tokens[0].shape[2] != n:
            raise ValueError(f"layer {self.layer_idx}: {n} queries for {tokens[0].shape[2]} new tokens")
        out = self._one_call_step(query, scale, *tokens)
        if out is not None:
            if n <= self.cache.max_crop_block:
                self._forward_tokens = tokens
            for child in self.children:
                child.carry_restore_point()
            return out
        q = query[:, :, 0]
        self._hand_down(tokens)
        taken = [child.take_pending(n) for child in self.children]
        if not self._append_step(*tokens):
            for child, (k, v) in zip(self.children, taken):
                child._append(k, v)
        layer = self.state
        numpy = isinstance(layer.groups[0].state.layout.key_coef, np.ndarray)
        out = subspace_ref.attend(_to_numpy(q, layer.dtype) if numpy else q, layer, backend=self.cache.backend, scale=scale)
        if not isinstance(out, torch.Tensor):
            out = torch.from_numpy(np.asarray(out)).to(device=query.device, dtype=query.dtype)
        return out[:, :, None]

    def _one_call_step(self, query: torch.Tensor, scale: float, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor | None:
        """The step's appends and attention (``query`` (B, H_q, 1, d) -> (B, H_q, 1, d_v), in the
        query's dtype) by one call of the backend's layer decode (spec/layer_state.md L5.3;
        torch/CPU: ``subspace_ref_torch.layer_decode``), asked once per admission (tokens' and
        queries' shapes, dtypes and device, the scale) once every group holds compressed tokens;
        None, with nothing changed, where it does not serve the step."""
        if not (self.one_append and self.one_attend):
            return None
        states = [child.state for child in self.children]
        admission = (keys.shape, values.shape, query.shape, keys.dtype, values.dtype, query.dtype, keys.device, scale)
        held = self._decoder
        if held is None or held[0] != admission:
            if any(st is None for st in states) or not all(st.engine == "torch" for st in states):
                return None
            if not all(st.num_tokens for st in states):  # a decision over arrays not yet allocated would not be the decode loop's
                return None
            try:
                from subspace_ref_torch.layer_decode import layer_decoder
            except ImportError:  # the torch backend's package is not installed
                layer_decoder = None
            decoder = None if layer_decoder is None else layer_decoder(self.state, self.heads, keys, values, query, scale)
            held = self._decoder = (admission, decoder)
        return None if held[1] is None else held[1](states, keys, values, query)

    def _append_step(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Every child's one new token (the layer's ``keys`` (B, H, 1, d)) appended by the
        backend's one-call layer append (spec/layer_state.md L3; on torch/CPU,
        ``subspace_ref_torch.layer_append``: one call of the C kernels for every group), asked
        once per admission (the tokens' dtype, device and shape); False, with nothing changed,
        where it does not serve the step (then each child appends as before)."""
        if not self.one_append:
            return False
        states = [child.state for child in self.children]
        if any(st is None for st in states) or not all(st.engine == "torch" for st in states):
            return False
        admission = (tuple(keys.shape), tuple(values.shape), keys.dtype, values.dtype, keys.device)
        held = self._appender
        if held is None or held[0] != admission:
            try:
                from subspace_ref_torch.layer_append import layer_appender
            except ImportError:  # the torch backend's package is not installed
                layer_appender = None
            appender = None if layer_appender is None else layer_appender(states, self.heads, keys, values)
            held = self._appender = (admission, appender)
        return held[1] is not None and held[1](states, keys, values)


__all__ = ["GroupedLayer"]
