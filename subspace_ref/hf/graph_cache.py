"""``GraphSubspaceCache``: a fixed-capacity cache of coefficients that ``torch.compile`` traces
whole, so transformers' ``generate`` decodes through a captured CUDA graph (issue 38 item 5;
spec/models.md M11).

A :class:`~subspace_ref.hf.SubspaceCache` appends and attends in Python between graph breaks.
This cache holds what a static state with float, int8 or int4/int2 coefficients holds, post-RoPE
or pre-RoPE (spec/rope.md P2-P3), and nothing that needs Python at run time:

* per layer and head group (one for a uniform state, one per head group of a
  :class:`~subspace_ref.LayerState`: :mod:`~subspace_ref.hf.graph_group`), the coefficients
  ``C = K Bᵀ`` and ``D = V Eᵀ`` in preallocated (batch, h, capacity, ·) tensors at fixed
  addresses (quantised sides: the state's packed layout at that capacity,
  :mod:`~subspace_ref.hf.graph_storage`), written in place at the token count (a
  device tensor), as transformers' ``StaticLayer`` writes keys and values;
* attention is spec A2 as exact attention over ``(γ B q, C, D)`` with head size r and scale
  1/√d: one ``scaled_dot_product_attention`` call over the written slots, then ``E`` maps the
  r_v-vector back to d_v (the vendor path of ``subspace_ref_triton.vendor``, on every device).
  A layer with a quantised side decodes one token through the Triton decode kernel instead, as
  a torch operator (``subspace_ref_triton.graph_op``; M11.6) where the kernel runs, so that the
  step reads the codes and not a dequantised copy of the capacity;
* a pre-RoPE layer un-rotates the keys it writes by their slots and decodes through the
  pre-RoPE kernel, which rotates each rebuilt key by its slot (M11.10); elsewhere it rebuilds
  and rotates the keys of the capacity for SDPA;
* a layer with exact sinks and a recent window holds them at fixed addresses and compresses the
  token its window gives up in the same step (:mod:`~subspace_ref.hf.graph_window`, M11.14).

transformers compiles ``generate``'s decode step for caches whose ``is_compileable`` is True,
on CUDA by default with ``mode="reduce-overhead"``, which captures CUDA graphs. Other state
kinds (online bases, per-query-head bases, compression thresholds beyond the window) are
refused with the reasons (:func:`graph_refusals`): they keep the SubspaceCache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import STATIC_LAYER_TYPE_MAPPING, Cache, StaticLayer, get_layer_types_and_kwargs
from transformers.utils import is_torchdynamo_compiling

from subspace_ref.byte_convention import Geometry
from subspace_ref.capabilities import NotSupportedError, require
from subspace_ref.hf import attention as _attn
from subspace_ref.hf.graph_group import GraphHeadGroup, kernel_backend, kernel_needs
from subspace_ref.hf.graph_window import ExactParts, compressed_count, exact_attention, merge
from subspace_ref.hf.state_factories import StateFactory, StateSpec
from subspace_ref.hf_requirements import require_cache_api
from subspace_ref.layer_state import LayerState
from subspace_ref.state import SubspaceState


def graph_refusals(state, device=None, dtype=None) -> list[str]:
    """Why ``state`` (a :class:`~subspace_ref.SubspaceState` or :class:`~subspace_ref.LayerState`)
    cannot be held by a :class:`GraphSubspaceCache` ([] when it can; spec/models.md M11.4); with
    ``device``, also what that device lacks for a model in ``dtype`` (default: the state's):
    quantised coefficients and pre-RoPE keys on CUDA need the Triton kernel (M11.6, M11.10)."""
    if isinstance(state, LayerState):  # M11.12: each head group as a uniform state
        reasons = [f"heads {list(g.heads)}: {r}" for g in state.groups for r in graph_refusals(g.state, device, dtype)]
        return list(dict.fromkeys(reasons))
    if not isinstance(state, SubspaceState):
        return [f"{type(state).__name__}: not a SubspaceState or LayerState"]
    reasons = []
    if state.kind != "static":
        reasons.append(f"{state.kind} states change their bases while decoding")
    if getattr(state.policy, "query_group", None) is not None:
        reasons.append("bases per query head (spec/sharing.md A3)")
    needs = kernel_needs(state)
    dtype = state.dtype if dtype is None else dtype
    if needs and device is not None and torch.device(device).type == "cuda" and kernel_backend(device, dtype) is None:
        reasons.append(f"{needs} on CUDA without the triton decode kernel for {dtype}")
    win = state.window
    if win is not None and max(win.min_tokens - win.sinks, 0) > win.size + 1:  # M11.14: one token moves per step
        reasons.append(f"a compression threshold (min_tokens = {win.min_tokens}) beyond the sinks and the window (spec/window.md W1): "
                       "a decode step would compress a block")
    return reasons


def layer_spec(config, layer_idx: int, batch: int = 1, dtype=torch.float32, device=None) -> StateSpec:
    """The :class:`StateSpec` a cache gives layer ``layer_idx``'s factory for a model of
    ``config`` (KV heads and head size from its text config, as transformers computes them)."""
    geom = Geometry.of_config(config, 0)
    return StateSpec(layer_idx, batch, geom.kv_heads, geom.head_dim, geom.value_dim, dtype, torch.device(device or "cpu"))


def model_graph_refusals(config, states: StateFactory | Sequence[Any], device=None, dtype=None) -> list[str]:
    """:func:`graph_refusals` (on ``device`` for a model in ``dtype``, when given) of the state
    each full-attention layer of a model of ``config`` gets from ``states`` (a factory, called
    with :func:`layer_spec`, or one state per layer), each prefixed with its layer, and the
    model's own (soft-capped attention, M11.4)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    reasons = []
    if getattr(text, "attn_logit_softcapping", None):  # Gemma2: its attention call passes softcap, which SDPA does not apply
        reasons.append(f"the model's attention soft-capping (attn_logit_softcapping = {text.attn_logit_softcapping})")
    types, _ = get_layer_types_and_kwargs(text)
    for i, kind in enumerate(types):
        if kind == "full_attention":
            state = states(layer_spec(config, i)) if callable(states) else states[i]
            reasons += [f"layer {i}: {r}" for r in graph_refusals(state, device, dtype)]
    return reasons


class GraphSubspaceLayer(StaticLayer):
    """One layer of a :class:`GraphSubspaceCache`: transformers' ``StaticLayer`` whose KV heads
    are held by head groups (:class:`~subspace_ref.hf.graph_group.GraphHeadGroup`, ``groups``):
    one over every head for a uniform static state, one per head group of a
    :class:`~subspace_ref.LayerState` (M11.12). ``keys`` and ``values`` are the first group's C
    and D (batch, h, capacity, r), or its code arrays; ``keys`` carries the attribute by which
    the attention call finds the layer. Built by the cache from its states on the first ``update``."""

    is_compileable = True

    def __init__(self, max_cache_len: int, layer_idx: int, cache: "GraphSubspaceCache"):
        super().__init__(max_cache_len=max_cache_len)
        self.layer_idx = layer_idx
        self.cache = cache
        self.groups: list[GraphHeadGroup] = []
        self.exact: ExactParts | None = None  # a windowed layer's sinks and recent ring (M11.14)
        self.all_visible = True  # no mask has hidden a written slot (M11.6: the kernel reads slots 0..T-1)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        N, H, _, d = key_states.shape
        spec = StateSpec(self.layer_idx, N, H, d, value_states.shape[-1], key_states.dtype, key_states.device)
        state = self.cache.state(spec)
        self.device, self.batch_size, self.num_heads, self.dtype = key_states.device, N, H, key_states.dtype
        # the state dtype (StateSpec.state_dtype): float64 for a float64 model, else float32 sums over 16-bit operands
        self.compute_dtype = torch.float64 if key_states.dtype == torch.float64 else torch.float32
        self.slots = torch.arange(self.max_cache_len, device=self.device)
        parts = [(g.heads, g.state, g.key_identity, g.value_identity) for g in state.groups] if isinstance(state, LayerState) else [(range(H), state, False, False)]
        # query heads per KV head, from the config (the permutations below are made here, outside any trace)
        text = self.cache.config.get_text_config(decoder=True) if hasattr(self.cache.config, "get_text_config") else self.cache.config
        self.query_group = text.num_attention_heads // H
        win = state.window  # the layer's sinks and recent window (M11.14), one setting for every group
        self.exact = None if win is None else ExactParts(win.sinks, win.size, N, H, d, value_states.shape[-1], self.dtype, self.device)
        first = 0 if win is None else win.sinks
        self.groups = [GraphHeadGroup(self, tuple(heads), part, d, self.query_group, identity, first) for heads, part, *identity in parts]
        self.keys, self.values = self.groups[0].keys, self.groups[0].values
        self.k_head_dim, self.v_head_dim = d, value_states.shape[-1]
        # the groups' query heads, concatenated, back in head order (spec/layer_state.md L5.1)
        order = [h * self.query_group + i for grp in self.groups for h in grp.heads for i in range(self.query_group)]
        self.query_order = None if len(self.groups) == 1 else torch.tensor(sorted(range(len(order)), key=order.__getitem__), device=self.device)
        self.cumulative_length = self.cumulative_length.to(self.device)
        self._fix_addresses()
        self.is_initialized = True

    def held(self) -> tuple[torch.Tensor, ...]:
        """The per-sequence tensors of the layer: every group's C and D, or fixed layout's arrays
        of tokens, and the exact sinks and recent ring of a windowed layer."""
        return tuple(t for g in self.groups for t in g.held()) + (() if self.exact is None else self.exact.held())

    @property
    def compressed(self) -> torch.Tensor:
        """The device count of compressed tokens, which the head groups store and read: T, or
        T_c of a windowed layer (M11.14)."""
        return self.cumulative_length if self.exact is None else self.exact.compressed

    def _fix_addresses(self) -> None:
        """Tag C with this layer (how the attention call finds it, traced by dynamo as a
        constant) and, outside a trace, mark the tensors a captured graph replays (as StaticLayer)."""
        setattr(self.keys, _attn.GRAPH_TAG, self)
        if not is_torchdynamo_compiling():
            order = () if self.query_order is None else (self.query_order,)
            exact = () if self.exact is None else (self.exact.compressed, self.exact.slots)
            for t in (*self.held(), self.cumulative_length, self.slots, *order, *exact, *(c for g in self.groups for c in g.constants())):
                torch._dynamo.mark_static_address(t)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Spec M11.1: write the coefficients of the new post-RoPE keys/values (batch, H, n, d) at
        the token count, each group its heads' (quantised sides: M11.8 step 1; pre-RoPE keys:
        M11.10 step 1), and return the first group's C and D, or code arrays (the attention
        reads the written slots only)."""
        if not self.is_initialized:
            try:
                self.lazy_initialization(key_states, value_states)
            except NotSupportedError as refused:
                self._take_back_and_raise(self.layer_idx - 1, key_states.shape[-2], refused)
        n = key_states.shape[-2]
        if key_states.shape[:2] != (self.batch_size, self.num_heads) or key_states.shape[-1] != self.k_head_dim:
            self._take_back_and_raise(self.layer_idx - 1, n, ValueError(
                f"layer {self.layer_idx}: keys of shape {tuple(key_states.shape)} do not fit the cache's {(self.batch_size, self.num_heads)} heads of size {self.k_head_dim}"))
        eager = not is_torchdynamo_compiling()
        if eager and int(self.cumulative_length) + n > self.max_cache_len:  # a compiled step has no host read: M11.5
            self._take_back_and_raise(self.layer_idx - 1, n, ValueError(
                f"layer {self.layer_idx}: {int(self.cumulative_length)} + {n} tokens exceed max_cache_len = {self.max_cache_len}"))
        if n > 1 and (self.low_bit_keys or self.exact is not None) and not eager:  # M11.8 steps 1 and 3, M11.14 step 2: host counts
            what = "low-bit keys" if self.low_bit_keys else "an exact window or sinks"
            self._take_back_and_raise(self.layer_idx - 1, n, NotSupportedError(
                f"layer {self.layer_idx}: the graph cache does not support", [f"a compiled forward of {n} tokens over {what} (compile the one-token decode step, as generate does)"]))
        count = self.cumulative_length  # advanced after the writes, which read it
        store = None
        if self.exact is None:
            moving, index = (key_states, value_states), count
        elif n == 1:  # M11.14 step 1: the token the ring gives up moves to the compressed part
            *moving, index, store = self.exact.token(key_states, value_states, count)
        else:  # M11.14 step 2 (eager)
            *moving, c0, c1, store = self.exact.block(key_states, value_states, int(count))
            index = torch.tensor(c0, device=self.device)
            if c1 == c0:
                moving = None
        new = [] if moving is None else [g.coefficients(*moving, index, self.compute_dtype) for g in self.groups]
        if eager:  # a coefficient beyond float16's range (Q1): refused before any group writes; earlier layers give theirs back
            try:
                for g, (c, dv) in zip(self.groups, new):
                    g.check_range(c, dv)
            except ValueError as refused:
                self._take_back_and_raise(self.layer_idx - 1, n, refused)
        try:  # the check above refuses what a write would (a backstop: earlier layers give their tokens back)
            for g, (c, dv) in zip(self.groups, new):
                g.write(c, dv, index, eager)
        except ValueError as refused:
            self._take_back_and_raise(self.layer_idx - 1, n, refused)
        if moving is None:  # a block that compressed nothing: its queries read the compressed part as stored
            for g in self.groups:
                g.fresh_keys = None
        if store is not None:
            store()
        self.cumulative_length.add_(n)
        if self.exact is not None:
            self.exact.advance(self.cumulative_length)
        return self.keys, self.values

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: the sequences' coefficients reordered in place (a new tensor would lose
        the tag and the address a captured graph replays)."""
        if self.is_initialized:
            idx = beam_idx.to(self.device)
            for g in self.groups:
                g.reorder(idx)
            if self.exact is not None:
                self.exact.reorder(idx)

    def crop(self, tokens_to_remove: int) -> None:
        """StaticLayer's crop (``tokens_to_remove`` < 0 takes that many back). Low-bit keys also
        need the float rows of the unfinished group the cut falls in (M11.8 step 4): still in the
        tail when every write since was one token into the same group, else put back from the
        last block's rows; RuntimeError, the layer unchanged, when neither holds them."""
        if self.exact is not None and tokens_to_remove < 0:  # M11.14 step 2: only tokens that compressed nothing come back
            T = int(self.cumulative_length)
            S, W = self.exact.sinks, self.exact.window
            if compressed_count(T + tokens_to_remove, S, W) != compressed_count(T, S, W):
                raise RuntimeError(f"layer {self.layer_idx}: cropping {T} tokens to {T + tokens_to_remove} needs exact tokens the window has compressed; "
                                   "call cache.reset()")
        elif tokens_to_remove < -1 and self.low_bit_keys:
            T = int(self.cumulative_length)
            put_back = [g.crop_rows(T, max(T + tokens_to_remove, 0), self.layer_idx) for g in self.groups]  # all checked before any changes
            for step in put_back:
                if step is not None:
                    step()
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        """Empty the layer, keeping its tensors (and so a captured graph's addresses)."""
        super().reset()
        for g in self.groups:
            g.reset()
        if self.exact is not None:
            self.exact.reset()
        self.all_visible = True

    @property
    def low_bit_keys(self) -> bool:
        """Whether a group's keys are int4/int2 codes in groups (M11.8 steps 1, 3, 4 treat them apart)."""
        return any(g.low_bit_keys for g in self.groups)

    def attention_call(self, module, query: torch.Tensor, mask: torch.Tensor | None, scaling: float | None, dropout: float, kwargs: dict) -> torch.Tensor:
        """``subspace_attention`` for this layer: refuse what M11.2 does not compute, naming it,
        after taking this forward's tokens back from every layer it wrote (M11.4); else :meth:`attend`."""
        n = query.shape[2]
        eager = not is_torchdynamo_compiling()
        refused = ["attention dropout in training mode (call model.eval())"] if dropout and module.training else []
        refused += [f"{name} (soft-capping and attention sinks are not in SDPA)" for name in ("softcap", "s_aux") if kwargs.get(name) is not None]
        if query.shape[1] != self.num_heads * self.query_group:
            refused.append(f"{query.shape[1]} query heads for {self.num_heads} KV heads (the config has {self.num_heads * self.query_group})")
        if mask is None and n > 1 and eager and int(self.cumulative_length) != n:  # attend's causal slice needs q_offset = 0
            refused.append(f"no attention mask for {n} queries after {int(self.cumulative_length) - n} earlier tokens")
        if any(g.rope is not None for g in self.groups) and eager and self._hides_written(mask):  # M11.10 step 2
            refused.append("a mask that hides written slots (left padding) over pre-RoPE keys, which are rotated by their slot, not the padded position")
        if refused:
            self._take_back_and_raise(self.layer_idx, n, NotSupportedError(f"layer {self.layer_idx}: the graph cache does not support", refused))
        scaling = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
        if any(g.kernel for g in self.groups):
            self._prepare_kernel(query, mask, scaling)
        return self.attend(query, mask, scaling)

    def _prepare_kernel(self, query: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> None:
        """M11.6 bookkeeping, on the host and so in eager mode only: note a mask that hides a
        written slot from the last query (left padding; a compiled forward of several tokens
        counts as one, unchecked), and build each kernel group's decode workspace for these queries."""
        if is_torchdynamo_compiling():
            if query.shape[2] > 1:
                self.all_visible = False
            return
        if self.all_visible and self._hides_written(mask):
            self.all_visible = False
        for group in self.groups:
            if group.kernel:
                group.prepare_kernel(len(group.heads) * self.query_group, query.dtype, scaling, self.compressed)

    def _hides_written(self, mask: torch.Tensor | None) -> bool:
        """Whether ``mask``'s row for the last query hides a written slot (left padding; a host read)."""
        if mask is None:
            return False
        last = mask[..., -1, : int(self.cumulative_length)]
        return not bool(last.all() if last.dtype == torch.bool else (last == 0).all())

    def _take_back_and_raise(self, upto: int, tokens: int, error: Exception):
        """Raise ``error`` after :meth:`GraphSubspaceCache.rewind` of layers ``0..upto`` (M11.4)."""
        try:
            self.cache.rewind(upto, tokens)
        except RuntimeError as lost:
            raise error from lost
        raise error

    def attend(self, query: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Spec M11.2 for the n queries (batch, H_q, n, d) of the last n tokens written, under
        transformers' mask over the capacity (True / 0 = attend; None: the written slots,
        causally): (batch, n, H_q, d_v) in the query's dtype. Each group attends its query heads
        (:meth:`GraphHeadGroup.attend`) and the outputs go back in head order (M11.12)."""
        queries = [group.own(query, queries=True) for group in self.groups]
        if self.exact is not None and query.shape[2] == 1 and all(g.kernel_step(q, scaling, self.all_visible) for g, q in zip(self.groups, queries)):
            # M11.14 step 4: each group's launches merge the exact part in too
            exact = (self.exact.keys, self.exact.values, self.cumulative_length)
            return self._in_head_order([group.decode(q, self.compressed, exact) for group, q in zip(self.groups, queries)])
        if self.exact is not None:
            return self._attend_windowed(query, queries, mask, scaling)
        return self._in_head_order([group.attend(q, mask, scaling, self, self.all_visible)[0] for group, q in zip(self.groups, queries)])

    def _in_head_order(self, outs: list[torch.Tensor]) -> torch.Tensor:
        """The groups' outputs (batch, n, h g, d_v) as one (batch, n, H_q, d_v) in query-head order (M11.12)."""
        if len(outs) == 1:
            return outs[0].contiguous()
        return torch.cat(outs, dim=2).index_select(2, self.query_order).contiguous()

    def _attend_windowed(self, query: torch.Tensor, queries: list[torch.Tensor], mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """M11.14 steps 3 and 5 outside the kernel (``queries``: each group's rows of ``query``): the groups' compressed parts, each query seeing the compressed tokens
        of its own T_c, merged with the exact sinks and recent tokens it sees by their log-sum-exps;
        transformers' mask (padding) read at each slot's position."""
        n = query.shape[2]
        T = None if n == 1 else int(self.cumulative_length)  # a block's queries: eager, host counts
        counts = self.exact.compressed.view(1) if n == 1 else self.exact.query_counts(T, n, self.device)
        keys, values, visible, positions = self.exact.visible(self.cumulative_length, n, T)
        allowed = None
        if mask is not None:  # (N or 1, 1, n, L) over positions: compressed token i is position S + i
            allowed = mask if mask.dtype == torch.bool else mask == 0
            visible = visible & allowed[..., positions.clamp(max=self.max_cache_len - 1)]
            allowed = allowed[..., (self.slots + self.exact.sinks).clamp(max=self.max_cache_len - 1)]
        parts = [group.attend(q, allowed, scaling, self, self.all_visible, counts) for group, q in zip(self.groups, queries)]
        out_c, lse_c = torch.cat([p[0] for p in parts], dim=2), torch.cat([p[1] for p in parts], dim=1)
        if self.query_order is not None:
            out_c, lse_c = out_c.index_select(2, self.query_order), lse_c.index_select(1, self.query_order)
        exact = exact_attention(query, keys, values, visible, scaling, self.compute_dtype)
        return merge([(out_c, lse_c), exact]).to(query.dtype).contiguous()


class GraphSubspaceCache(Cache):
    """A transformers ``Cache`` of fixed capacity whose full-attention layers hold the
    coefficients of static states, float or quantised, post-RoPE or pre-RoPE, or layer states of
    such head groups (:class:`GraphSubspaceLayer`), so that
    ``torch.compile`` traces a decode step without graph breaks and transformers' ``generate``
    compiles it (CUDA graphs on CUDA, its default ``CompileConfig``). Other layers (sliding
    windows) are transformers' static layers, attended by the model's own SDPA.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config.
    states : StateFactory or sequence of SubspaceState or LayerState
        A factory (e.g. :class:`~subspace_ref.hf.static_states`, :class:`~subspace_ref.hf.allocated_states`)
        or one empty state per layer;
        each full-attention layer's state must pass :func:`graph_refusals` (checked here).
    max_cache_len : int
        Tokens the cache holds (prompt and generated), allocated on the first update.

    Raises
    ------
    ImportError
        On a transformers older than :data:`~subspace_ref.hf_requirements.MIN_TRANSFORMERS`
        (both versions named).
    ValueError
        On a bad ``max_cache_len``, a state count other than the layer count, or a state that
        already holds tokens.
    subspace_ref.capabilities.NotSupportedError
        If a layer's state or the model is refused (:func:`model_graph_refusals`, the reasons named).

    Examples
    --------
    ::

        import torch
        from subspace_ref.hf import GraphSubspaceCache, capture, compress, static_states
        from subspace_ref.models.default_model import load_model

        model, config = load_model("default")
        ids = torch.tensor([list(b"def read_config(path):\\n    return json.load(open(path))\\n")])
        bases = capture(model, ids).calibrate(rank_k=16, rank_v=16)
        with compress(model, bases):
            cache = GraphSubspaceCache(model.config, static_states(bases), max_cache_len=ids.shape[1] + 8)
            out = model.generate(ids, cache=cache, max_new_tokens=8, do_sample=False)
    """

    def __init__(self, config, states: StateFactory | Sequence[SubspaceState | LayerState], *, max_cache_len: int):
        require_cache_api(type(self).__name__)
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"max_cache_len must be an int >= 1, got {max_cache_len!r}")
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        if callable(states):
            self.factory, self.given = states, None
        else:
            self.factory, self.given = None, list(states)
            if len(self.given) != text.num_hidden_layers:
                raise ValueError(f"{len(self.given)} states given for a model of {text.num_hidden_layers} layers")
            if any(isinstance(s, (SubspaceState, LayerState)) and s.num_tokens for s in self.given):
                raise ValueError("states: a GraphSubspaceCache takes empty states (its coefficients start at slot 0)")
        require(model_graph_refusals(config, states), "a GraphSubspaceCache does not hold")  # before any forward writes
        self.config = config
        self.max_cache_len = max_cache_len
        types, kwargs = get_layer_types_and_kwargs(text)
        layers = [
            GraphSubspaceLayer(max_cache_len, i, self) if kind == "full_attention" else STATIC_LAYER_TYPE_MAPPING[kind](max_cache_len=max_cache_len, **kw)
            for i, (kind, kw) in enumerate(zip(types, kwargs))
        ]
        super().__init__(layers=layers)

    @classmethod
    def for_model(cls, model, states: StateFactory | Sequence[SubspaceState | LayerState], *, max_cache_len: int) -> "GraphSubspaceCache":
        """Select the subspace attention for ``model`` (as :meth:`SubspaceCache.for_model`) and return a cache for it."""
        cache = cls(model.config, states, max_cache_len=max_cache_len)  # a refused cache leaves the model as it was
        _attn.use_subspace_attention(model)
        return cache

    def state(self, spec: StateSpec) -> SubspaceState | LayerState:
        """The empty state of layer ``spec.layer_idx``, checked against the model's shapes (the
        constructor refused what the cache cannot hold)."""
        state = self.factory(spec) if self.factory is not None else self.given[spec.layer_idx]
        if (state.heads, state.d, state.d_v) != (spec.heads, spec.head_dim, spec.value_dim):
            raise ValueError(f"layer {spec.layer_idx}: the state has {state.heads} heads of size {state.d}/{state.d_v}, "
                             f"the model {spec.heads} of size {spec.head_dim}/{spec.value_dim}")
        return state

    def rewind(self, layer_idx: int, tokens: int) -> None:
        """Take the last ``tokens`` back from layers ``0..layer_idx``: what a forward failing at
        layer ``layer_idx`` had written (every earlier layer's update ran). RuntimeError, after
        rewinding the rest, if a sliding layer has already dropped tokens it cannot give back."""
        lost = []
        for i, layer in enumerate(self.layers[: layer_idx + 1]):
            if not layer.is_initialized:
                continue
            try:
                if not layer.is_croppable:
                    raise RuntimeError("a sliding window")
                layer.crop(-tokens)
            except RuntimeError:
                lost.append(i)
        if lost:
            raise RuntimeError(f"layers {lost}: their sliding windows dropped tokens, their low-bit key tails were rewritten, or their exact windows "
                               "compressed tokens, which cannot be restored; "
                               "call cache.reset() before reusing the cache")

    @property
    def nbytes(self) -> int:
        """Bytes held: the allocated coefficients (the capacity, not the tokens written) and the
        bases, as :attr:`SubspaceCache.nbytes` counts bases."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                held = layer.held() + tuple(t for g in layer.groups for t in g.counted_bases()) if isinstance(layer, GraphSubspaceLayer) else (layer.keys, layer.values)
                total += sum(t.numel() * t.element_size() for t in held)
        return total


__all__ = ["GraphSubspaceCache", "GraphSubspaceLayer", "graph_refusals", "layer_spec", "model_graph_refusals"]
