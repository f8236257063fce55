"""``GraphSubspaceCache``: a fixed-capacity cache of coefficients that ``torch.compile`` traces
whole, so transformers' ``generate`` decodes through a captured CUDA graph (issue 38 item 5;
spec/models.md M11).

A :class:`~subspace_ref.hf.SubspaceCache` appends and attends in Python between graph breaks.
This cache holds what a static state with float, int8 or int4/int2 coefficients holds, post-RoPE
or pre-RoPE (spec/rope.md P2-P3), and nothing that needs Python at run time:

* per layer, the coefficients ``C = K Bᵀ`` and ``D = V Eᵀ`` in preallocated (batch, H,
  capacity, ·) tensors at fixed addresses (quantised sides: the state's packed layout at that
  capacity, :mod:`~subspace_ref.hf.graph_storage`), written in place at the token count (a
  device tensor), as transformers' ``StaticLayer`` writes keys and values;
* attention is spec A2 as exact attention over ``(γ B q, C, D)`` with head size r and scale
  1/√d: one ``scaled_dot_product_attention`` call over the written slots, then ``E`` maps the
  r_v-vector back to d_v (the vendor path of ``subspace_ref_triton.vendor``, on every device).
  A layer with a quantised side decodes one token through the Triton decode kernel instead, as
  a torch operator (``subspace_ref_triton.graph_op``; M11.6) where the kernel runs, so that the
  step reads the codes and not a dequantised copy of the capacity;
* a pre-RoPE layer un-rotates the keys it writes by their slots and decodes through the
  pre-RoPE kernel, which rotates each rebuilt key by its slot (M11.10); elsewhere it rebuilds
  and rotates the keys of the capacity for SDPA.

transformers compiles ``generate``'s decode step for caches whose ``is_compileable`` is True,
on CUDA by default with ``mode="reduce-overhead"``, which captures CUDA graphs. Other state
kinds (online bases, exact windows, per-query-head bases) are refused with the reasons
(:func:`graph_refusals`): they keep the SubspaceCache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers.cache_utils import STATIC_LAYER_TYPE_MAPPING, Cache, StaticLayer, get_layer_types_and_kwargs
from transformers.utils import is_torchdynamo_compiling

from subspace_ref.basis_storage import decoded_state
from subspace_ref.byte_convention import Geometry
from subspace_ref.capabilities import NotSupportedError, require
from subspace_ref.formats import FLOAT
from subspace_ref.hf import attention as _attn
from subspace_ref.hf import graph_storage
from subspace_ref.hf.state_factories import StateFactory, StateSpec
from subspace_ref.rope import inverse_angles, rotate_by, rotating_dims
from subspace_ref.state import SubspaceState


def kernel_backend(device, dtype):
    """The Triton backend when its decode kernel runs on ``device`` for a model in ``dtype``
    (CUDA; the CPU under ``TRITON_INTERPRET=1``), else None (spec/models.md M11.6)."""
    from subspace_ref.registry import backend_availability, get_backend

    if not backend_availability("triton"):
        return None
    backend = get_backend("triton")
    return backend if torch.device(device).type in backend.devices and str(dtype).removeprefix("torch.") in backend.dtypes else None


def graph_refusals(state, device=None) -> list[str]:
    """Why ``state`` cannot be held by a :class:`GraphSubspaceCache` ([] when it can; spec/models.md
    M11.4); with ``device``, also what that device lacks (quantised coefficients on CUDA need the
    Triton kernel, M11.6)."""
    if not isinstance(state, SubspaceState):
        return [f"{type(state).__name__}: heads of different configurations are decoded by the SubspaceCache"]
    reasons = []
    if state.kind != "static":
        reasons.append(f"{state.kind} states change their bases while decoding")
    if getattr(state.policy, "query_group", None) is not None:
        reasons.append("bases per query head (spec/sharing.md A3)")
    needs = kernel_needs(state)
    if needs and device is not None and torch.device(device).type == "cuda" and kernel_backend(device, state.dtype) is None:
        reasons.append(f"{needs} on CUDA without the triton decode kernel for {state.dtype}")
    if state.window is not None:
        reasons.append("exact windows, sinks or a compression threshold (spec/window.md) move tokens between parts while decoding")
    return reasons


def kernel_needs(state) -> str | None:
    """What makes a graph layer of ``state`` decode through the Triton kernel where it runs
    (M11.6, M11.10), and why SDPA will not do on CUDA; None for float post-RoPE coefficients."""
    needs = []
    if (state.layout.key_format, state.layout.value_format) != (FLOAT, FLOAT):
        needs.append(f"{state.layout.coefficients} coefficients (the whole capacity would be dequantised every step)")
    if getattr(state.policy, "rope", None) is not None:
        needs.append("pre-RoPE keys (the whole capacity would be rebuilt and rotated every step)")
    return " and ".join(needs) or None


def layer_spec(config, layer_idx: int, batch: int = 1, dtype=torch.float32, device=None) -> StateSpec:
    """The :class:`StateSpec` a cache gives layer ``layer_idx``'s factory for a model of
    ``config`` (KV heads and head size from its text config, as transformers computes them)."""
    geom = Geometry.of_config(config, 0)
    return StateSpec(layer_idx, batch, geom.kv_heads, geom.head_dim, geom.value_dim, dtype, torch.device(device or "cpu"))


def model_graph_refusals(config, states: StateFactory | Sequence[Any], device=None) -> list[str]:
    """:func:`graph_refusals` (on ``device`` when given) of the state each full-attention layer of
    a model of ``config`` gets from ``states`` (a factory, called with :func:`layer_spec`, or one
    state per layer), each prefixed with its layer, and the model's own (soft-capped attention, M11.4)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    reasons = []
    if getattr(text, "attn_logit_softcapping", None):  # Gemma2: its attention call passes softcap, which SDPA does not apply
        reasons.append(f"the model's attention soft-capping (attn_logit_softcapping = {text.attn_logit_softcapping})")
    types, _ = get_layer_types_and_kwargs(text)
    for i, kind in enumerate(types):
        if kind == "full_attention":
            state = states(layer_spec(config, i)) if callable(states) else states[i]
            reasons += [f"layer {i}: {r}" for r in graph_refusals(state, device)]
    return reasons


class GraphSubspaceLayer(StaticLayer):
    """One layer of a :class:`GraphSubspaceCache`: transformers' ``StaticLayer`` whose ``keys``
    and ``values`` hold the coefficients C (batch, H, capacity, r) and D (batch, H, capacity,
    r_v) in the model's dtype, with the bases B (H, r, d), E (H, r_v, d_v) and γ (H,) of a
    static state (spec A2). A layer with an int8 or int4/int2 side, or pre-RoPE keys (``rope``),
    holds its coefficients in a fixed packed layout instead (``layout``; ``keys`` and ``values``
    are its code arrays; M11.8, M11.10). Built by the cache from its states on the first ``update``."""

    is_compileable = True

    def __init__(self, max_cache_len: int, layer_idx: int, cache: "GraphSubspaceCache"):
        super().__init__(max_cache_len=max_cache_len)
        self.layer_idx = layer_idx
        self.cache = cache
        self.layout = None  # the fixed packed layout of a quantised or pre-RoPE layer (graph_storage, M11.8)
        self.rope = None  # a pre-RoPE layer's RopeParams (M11.10)
        self.kernel = False  # whether the Triton decode kernel reads that layout here (M11.6)
        self.workspace = self.workspace_handle = None
        self.all_visible = True  # no mask has hidden a written slot (M11.6: the kernel reads slots 0..T-1)
        self.fresh_keys = None  # the float keys of the last eager block into low-bit keys (M11.8 step 3)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        N, H, _, d = key_states.shape
        spec = StateSpec(self.layer_idx, N, H, d, value_states.shape[-1], key_states.dtype, key_states.device)
        state = self.cache.state(spec)
        lay = decoded_state(state).layout
        self.device, self.batch_size, self.num_heads, self.dtype = key_states.device, N, H, key_states.dtype
        # the state dtype (StateSpec.state_dtype): float64 for a float64 model, else float32 sums over 16-bit operands
        self.compute_dtype = torch.float64 if key_states.dtype == torch.float64 else torch.float32
        exact = dict(dtype=self.compute_dtype, device=self.device)
        to_tensor = lambda x: torch.as_tensor(np.asarray(x.detach().cpu() if isinstance(x, torch.Tensor) else x), **exact)  # noqa: E731
        self.key_basis, self.value_basis = to_tensor(lay.key_bases[0, :, 0]), to_tensor(lay.value_bases[0, :, 0])
        self.gamma = to_tensor(lay.gamma)
        self.k_head_dim, self.v_head_dim = self.key_basis.shape[1], self.value_basis.shape[1]
        self.rope = getattr(state.policy, "rope", None)
        if self.rope is not None:  # float64 frequencies: the angles of M11.10 are taken in float64, as the state's
            self.inv_freq = torch.tensor(np.array(self.rope.inv_freq), dtype=torch.float64, device=self.device)
            self.rope_dims = rotating_dims(self.rope, d)
        needs = kernel_needs(state)
        if needs is None:
            self.keys = torch.zeros((N, H, self.max_cache_len, self.k_head_dim), dtype=self.dtype, device=self.device)
            self.values = torch.zeros((N, H, self.max_cache_len, self.v_head_dim), dtype=self.dtype, device=self.device)
        else:
            self.kernel = kernel_backend(self.device, self.dtype) is not None
            if not self.kernel and self.device.type == "cuda":
                raise NotSupportedError(f"layer {self.layer_idx}: the graph cache does not hold",
                                        [f"{needs} on CUDA without the triton decode kernel for {self.dtype} (M11.6)"])
            # states of half models in their dtype, as the SubspaceCache converts them
            layout_dtype = self.dtype if self.dtype in (torch.float16, torch.bfloat16) else self.compute_dtype
            self.layout = graph_storage.fixed_layout(state, self.device, layout_dtype, self.max_cache_len)
            self.keys, self.values = self.layout.key_coef, self.layout.value_coef
        self.slots = torch.arange(self.max_cache_len, device=self.device)
        self.cumulative_length = self.cumulative_length.to(self.device)
        self._fix_addresses()
        self.is_initialized = True

    def held(self) -> tuple[torch.Tensor, ...]:
        """The per-sequence tensors of the layer: C and D, or the fixed layout's arrays of tokens."""
        return (self.keys, self.values) if self.layout is None else tuple(graph_storage.sequence_arrays(self.layout).values())

    def _fix_addresses(self) -> None:
        """Tag C with this layer (how the attention call finds it, traced by dynamo as a
        constant) and, outside a trace, mark the tensors a captured graph replays (as StaticLayer)."""
        setattr(self.keys, _attn.GRAPH_TAG, self)
        if not is_torchdynamo_compiling():
            for t in (*self.held(), self.cumulative_length, self.key_basis, self.value_basis, self.gamma, self.slots, *self._rope_tensors()):
                torch._dynamo.mark_static_address(t)

    def _rope_tensors(self) -> tuple[torch.Tensor, ...]:
        return () if self.rope is None else (self.inv_freq,)

    def _angles(self, positions: torch.Tensor, dtype: torch.dtype, inverse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's (a cos, a sin) at ``positions`` (device slots), taken in float64 as the state
        takes them (spec/rope.md P2), or those of the inverse rotation; in ``dtype``."""
        angles = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        cos, sin = self.rope.attention_scaling * torch.cos(angles), self.rope.attention_scaling * torch.sin(angles)
        if inverse:
            cos, sin = inverse_angles(cos, sin, self.rope)
        return cos.to(dtype), sin.to(dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Spec M11.1: write the coefficients of the new post-RoPE keys/values (batch, H, n, d) at
        the token count (quantised sides: M11.8 step 1) and return the whole C and D, or code
        arrays (the attention reads the written slots only)."""
        if not self.is_initialized:
            try:
                self.lazy_initialization(key_states, value_states)
            except NotSupportedError as refused:
                self._take_back_and_raise(self.layer_idx - 1, key_states.shape[-2], refused)
        n = key_states.shape[-2]
        if key_states.shape[:2] != self.keys.shape[:2] or key_states.shape[-1] != self.key_basis.shape[2]:
            self._take_back_and_raise(self.layer_idx - 1, n, ValueError(
                f"layer {self.layer_idx}: keys of shape {tuple(key_states.shape)} do not fit the cache's {tuple(self.keys.shape[:2])} heads of size {self.key_basis.shape[2]}"))
        if not is_torchdynamo_compiling() and int(self.cumulative_length) + n > self.max_cache_len:  # a compiled step has no host read: M11.5
            self._take_back_and_raise(self.layer_idx - 1, n, ValueError(
                f"layer {self.layer_idx}: {int(self.cumulative_length)} + {n} tokens exceed max_cache_len = {self.max_cache_len}"))
        if n > 1 and self.low_bit_keys and is_torchdynamo_compiling():  # M11.8 steps 1 and 3 keep a block's float keys on the host
            self._take_back_and_raise(self.layer_idx - 1, n, NotSupportedError(
                f"layer {self.layer_idx}: the graph cache does not support", [f"a compiled forward of {n} tokens over low-bit keys (compile the one-token decode step, as generate does)"]))
        count = self.cumulative_length  # advanced after the writes, which read it
        keys = key_states.to(self.compute_dtype)
        if self.rope is not None:  # M11.10 step 1: the keys back to pre-RoPE, each by its slot
            keys = rotate_by(keys, *self._angles(torch.arange(n, device=self.device) + count, self.compute_dtype, inverse=True), self.rope_dims)
        c = torch.einsum("bhnd,hrd->bhnr", keys, self.key_basis)
        dv = torch.einsum("bhnd,hrd->bhnr", value_states.to(self.compute_dtype), self.value_basis)
        if self.layout is None:
            positions = torch.arange(n, device=self.device) + count
            self.keys.index_copy_(2, positions, c.to(self.keys.dtype))
            self.values.index_copy_(2, positions, dv.to(self.values.dtype))
        else:
            eager = not is_torchdynamo_compiling()
            try:  # a coefficient beyond float16's range (Q1, checked in eager mode): this layer's count is unchanged, earlier layers give theirs back
                self.fresh_keys = graph_storage.write(self.layout, "key", count, c, eager)
                graph_storage.write(self.layout, "value", count, dv, eager)
            except ValueError as refused:
                self._take_back_and_raise(self.layer_idx - 1, n, refused)
        self.cumulative_length.add_(n)
        return self.keys, self.values

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: the sequences' coefficients reordered in place (a new tensor would lose
        the tag and the address a captured graph replays)."""
        if self.is_initialized:
            idx = beam_idx.to(self.device)
            for t in self.held():
                t.copy_(t.index_select(0, idx))
            if self.fresh_keys is not None:  # a crop may still put them back (M11.8 step 4)
                first, rows = self.fresh_keys
                self.fresh_keys = first, rows.index_select(0, idx)

    def crop(self, tokens_to_remove: int) -> None:
        """StaticLayer's crop (``tokens_to_remove`` < 0 takes that many back). Low-bit keys also
        need the float rows of the unfinished group the cut falls in (M11.8 step 4): still in the
        tail when every write since was one token into the same group, else put back from the
        last block's rows; RuntimeError, the layer unchanged, when neither holds them."""
        if self.low_bit_keys and tokens_to_remove < -1:  # one token back never leaves its group's earlier rows
            T = int(self.cumulative_length)
            k, G = max(T + tokens_to_remove, 0), self.layout.group
            start = k // G * G
            if self.fresh_keys is not None and self.fresh_keys[0] <= start:
                first, rows = self.fresh_keys
                self.layout.key_tail[:, :, : k - start] = rows[:, :, start - first : k - first]
            elif k > start and (T - 1) // G != k // G:
                raise RuntimeError(f"layer {self.layer_idx}: cropping {T} tokens to {k} needs the float keys of tokens {start}..{k - 1}, "
                                   f"which later writes replaced; call cache.reset()")
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        """Empty the layer, keeping its tensors (and so a captured graph's addresses)."""
        super().reset()
        if self.is_initialized:
            for t in self.held():
                t.zero_()
        self.all_visible = True
        self.fresh_keys = None

    def attention_call(self, module, query: torch.Tensor, mask: torch.Tensor | None, scaling: float | None, dropout: float, kwargs: dict) -> torch.Tensor:
        """``subspace_attention`` for this layer: refuse what M11.2 does not compute, naming it,
        after taking this forward's tokens back from every layer it wrote (M11.4); else :meth:`attend`."""
        n = query.shape[2]
        refused = ["attention dropout in training mode (call model.eval())"] if dropout and module.training else []
        refused += [f"{name} (soft-capping and attention sinks are not in SDPA)" for name in ("softcap", "s_aux") if kwargs.get(name) is not None]
        if query.shape[1] % self.num_heads:
            refused.append(f"{query.shape[1]} query heads for {self.num_heads} KV heads")
        if mask is None and n > 1 and not is_torchdynamo_compiling() and int(self.cumulative_length) != n:  # attend's causal slice needs q_offset = 0
            refused.append(f"no attention mask for {n} queries after {int(self.cumulative_length) - n} earlier tokens")
        if self.rope is not None and not is_torchdynamo_compiling() and self._hides_written(mask):  # M11.10 step 2
            refused.append("a mask that hides written slots (left padding) over pre-RoPE keys, which are rotated by their slot, not the padded position")
        if refused:
            self._take_back_and_raise(self.layer_idx, n, NotSupportedError(f"layer {self.layer_idx}: the graph cache does not support", refused))
        scaling = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
        if self.kernel:
            self._prepare_kernel(query, mask, scaling)
        return self.attend(query, mask, scaling)

    def _prepare_kernel(self, query: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> None:
        """M11.6 bookkeeping, on the host and so in eager mode only: note a mask that hides a
        written slot from the last query (left padding; a compiled forward of several tokens
        counts as one, unchecked), and build the decode workspace for these queries."""
        if is_torchdynamo_compiling():
            if query.shape[2] > 1:
                self.all_visible = False
            return
        if self.all_visible and self._hides_written(mask):
            self.all_visible = False
        key = (query.shape[0], query.shape[1], query.dtype, scaling)
        if self.workspace is None or self.workspace_key != key:
            from subspace_ref_triton import graph_op
            from subspace_ref_triton.workspace import DecodeWorkspace

            self.workspace = DecodeWorkspace(self.layout, query.shape[1], query.dtype, scale=scaling, num_tokens=self.cumulative_length, fixed_tail=True,
                                             rope=self.rope)
            self.workspace_handle, self.workspace_key = graph_op.register(self.workspace, list(graph_storage.sequence_arrays(self.layout))), key
            torch._dynamo.mark_static_address(self.workspace_handle)
            self.decode_op = torch.ops.subspace_ref_triton.workspace_decode

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
        """Spec M11.2 (A2 through SDPA, M11.3) for the n queries (batch, H_q, n, d) of the last n
        tokens written, under transformers' mask over the capacity (True / 0 = attend; None:
        the written slots, causally): (batch, n, H_q, d_v) in the query's dtype. One query over
        a quantised side whose kernel is prepared and sees every written slot: M11.6 instead;
        several over low-bit keys: M11.8 step 3; pre-RoPE keys: M11.10 step 3."""
        N, Hq, n, d = query.shape
        if n == 1 and self.workspace is not None and self.all_visible and self.workspace_key == (N, Hq, query.dtype, scaling):
            out = self.decode_op(query[:, :, 0].contiguous(), list(self.held()), self.cumulative_length, self.workspace_handle)
            return out[:, None]
        H = self.num_heads
        g = Hq // H
        q = query.to(self.compute_dtype).view(N, H, g, n, d)
        if self.layout is None:
            C, D = self.keys, self.values
        else:  # the read-back coefficients (M11.8 step 2)
            C, D = (graph_storage.read(self.layout, which, self.cumulative_length, self.dtype, self.max_cache_len) for which in ("key", "value"))
        slots = self.slots
        if n > 1 and self.low_bit_keys:
            C, D, mask = self._block_keys(C, D, mask, n)
            slots = torch.cat([slots, slots])
        if self.rope is None:
            qt = torch.einsum("bhgnd,hrd->bhgnr", q, self.key_basis) * self.gamma[None, :, None, None, None]  # step 1, γ folded in
        else:  # M11.10 step 3: the keys rebuilt and rotated by their slots, the query as it is
            qt = q * self.gamma[None, :, None, None, None]
            C = rotate_by(torch.einsum("bhlr,hrd->bhld", C.to(self.compute_dtype), self.key_basis), *self._angles(slots, self.compute_dtype), self.rope_dims).to(self.dtype)
        qt = qt.to(self.dtype)
        if n == 1:  # decode: the g query heads of a KV head as g query rows of it, so no GQA kernel is needed
            visible = (self.slots < self.cumulative_length).view(1, 1, 1, -1) if mask is None else mask  # (1 or N, 1, 1, L)
            y = F.scaled_dot_product_attention(qt.view(N, H, g, -1), C, D, attn_mask=visible, scale=scaling)  # steps 2-3
        elif mask is None:  # transformers drops the mask only for a first forward (q_offset = 0): causal over its n slots
            y = F.scaled_dot_product_attention(qt.reshape(N, Hq, n, -1), C[:, :, :n], D[:, :, :n], is_causal=True, scale=scaling, enable_gqa=True)
        else:
            y = F.scaled_dot_product_attention(qt.reshape(N, Hq, n, -1), C, D, attn_mask=mask, scale=scaling, enable_gqa=True)
        out = torch.einsum("bhgnr,hre->bhgne", y.to(self.compute_dtype).reshape(N, H, g, n, -1), self.value_basis)  # step 4: (α̂ᵀD) E
        return out.reshape(N, Hq, n, -1).transpose(1, 2).to(query.dtype).contiguous()

    @property
    def low_bit_keys(self) -> bool:
        """Whether the keys are int4/int2 codes in groups (M11.8 steps 1, 3, 4 treat them apart)."""
        return self.layout is not None and bool(self.layout.side_format("key").low_bits)

    def _block_keys(self, C: torch.Tensor, D: torch.Tensor, mask: torch.Tensor | None, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """M11.8 step 3, eager: for n > 1 queries at positions T-n..T-1 over low-bit keys, the
        slots twice, read back (C) and with the float rows the block's write kept (its groups),
        and a mask over both letting query ``p`` see key ``t`` in the first copy iff ``t``'s
        group is complete by ``p`` (Q2.2), else in the second: one SDPA over the 2L slots."""
        G, T = self.layout.group, int(self.cumulative_length)
        first, rows = self.fresh_keys
        plain = C.clone()
        plain[:, :, first:T] = rows.to(plain.dtype)
        positions = torch.arange(T - n, T, device=self.device)[:, None]
        coded = (self.slots // G * G + G)[None, :] <= positions + 1  # (n, L)
        if mask is None:
            mask = self.slots[None, :] <= positions
        if mask.dtype == torch.bool:
            both = torch.cat([mask & coded, mask & ~coded], dim=-1)
        else:  # an additive mask
            both = torch.cat([mask.masked_fill(~coded, float("-inf")), mask.masked_fill(coded, float("-inf"))], dim=-1)
        return torch.cat([C, plain], dim=2), torch.cat([D, D], dim=2), both


class GraphSubspaceCache(Cache):
    """A transformers ``Cache`` of fixed capacity whose full-attention layers hold the
    coefficients of static post-RoPE float or quantised states (:class:`GraphSubspaceLayer`), so that
    ``torch.compile`` traces a decode step without graph breaks and transformers' ``generate``
    compiles it (CUDA graphs on CUDA, its default ``CompileConfig``). Other layers (sliding
    windows) are transformers' static layers, attended by the model's own SDPA.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config.
    states : StateFactory or sequence of SubspaceState
        A factory (e.g. :class:`~subspace_ref.hf.static_states`) or one empty state per layer;
        each full-attention layer's state must pass :func:`graph_refusals` (checked here).
    max_cache_len : int
        Tokens the cache holds (prompt and generated), allocated on the first update.

    Raises
    ------
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

    def __init__(self, config, states: StateFactory | Sequence[SubspaceState], *, max_cache_len: int):
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"max_cache_len must be an int >= 1, got {max_cache_len!r}")
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        if callable(states):
            self.factory, self.given = states, None
        else:
            self.factory, self.given = None, list(states)
            if len(self.given) != text.num_hidden_layers:
                raise ValueError(f"{len(self.given)} states given for a model of {text.num_hidden_layers} layers")
            if any(isinstance(s, SubspaceState) and s.num_tokens for s in self.given):
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
    def for_model(cls, model, states: StateFactory | Sequence[SubspaceState], *, max_cache_len: int) -> "GraphSubspaceCache":
        """Select the subspace attention for ``model`` (as :meth:`SubspaceCache.for_model`) and return a cache for it."""
        _attn.use_subspace_attention(model)
        return cls(model.config, states, max_cache_len=max_cache_len)

    def state(self, spec: StateSpec) -> SubspaceState:
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
            raise RuntimeError(f"layers {lost}: their sliding windows dropped tokens, or their low-bit key tails were rewritten, which cannot be restored; "
                               "call cache.reset() before reusing the cache")

    @property
    def nbytes(self) -> int:
        """Bytes held: the allocated coefficients (the capacity, not the tokens written) and the
        bases, as :attr:`SubspaceCache.nbytes` counts bases."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                held = layer.held() + (layer.key_basis, layer.value_basis, layer.gamma) if isinstance(layer, GraphSubspaceLayer) else (layer.keys, layer.values)
                total += sum(t.numel() * t.element_size() for t in held)
        return total


__all__ = ["GraphSubspaceCache", "GraphSubspaceLayer", "graph_refusals", "layer_spec", "model_graph_refusals"]
