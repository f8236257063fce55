"""One head group of a graph cache layer: the KV heads of one configuration, their stored
coefficients and their attention (spec/models.md M11.1-M11.2, M11.6, M11.8, M11.10, M11.12).

A :class:`~subspace_ref.hf.GraphSubspaceLayer` over a uniform :class:`~subspace_ref.SubspaceState`
has one group of all its KV heads; over a :class:`~subspace_ref.LayerState` it has one group per
head group of the layer state (spec/layer_state.md L1), each attended by its own kernel launch or
SDPA call, as the layer state attends group by group (L5).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from subspace_ref.basis_storage import decoded_state
from subspace_ref.capabilities import NotSupportedError
from subspace_ref.formats import FLOAT
from subspace_ref.hf import graph_storage
from subspace_ref.hf.graph_window import softmax_sum
from subspace_ref.rope import inverse_angles, rotate_by, rotating_dims


def kernel_backend(device, dtype):
    """The Triton backend when its decode kernel runs on ``device`` for a model in ``dtype``
    (CUDA; the CPU under ``TRITON_INTERPRET=1``), else None (spec/models.md M11.6)."""
    from subspace_ref.registry import backend_availability, get_backend

    if not backend_availability("triton"):
        return None
    backend = get_backend("triton")
    return backend if torch.device(device).type in backend.devices and str(dtype).removeprefix("torch.") in backend.dtypes else None


def kernel_needs(state) -> str | None:
    """What makes a graph group of the uniform ``state`` decode through the Triton kernel where it
    runs (M11.6, M11.10, M11.14), and why SDPA will not do on CUDA; None for float post-RoPE
    coefficients without sinks or a window."""
    needs = []
    if (state.layout.key_format, state.layout.value_format) != (FLOAT, FLOAT):
        needs.append(f"{state.layout.coefficients} coefficients (the whole capacity would be dequantised every step)")
    if getattr(state.policy, "rope", None) is not None:
        needs.append("pre-RoPE keys (the whole capacity would be rebuilt and rotated every step)")
    if state.window is not None:
        needs.append("sinks or an exact window (their merge needs the log-sum-exp, which SDPA does not return: explicit logits over the whole capacity every step)")
    return " and ".join(needs) or None


class GraphHeadGroup:
    """KV heads ``heads`` of a graph layer held as one static ``state``'s configuration: the bases
    B (h, r, d), E (h, r_v, d_v) and γ (h,) in the compute dtype, and either the coefficients C, D
    (``keys``, ``values``: N, h, capacity, r / r_v) in the model's dtype, or, with an int8 or
    int4/int2 side or pre-RoPE keys, the state's packed layout at the capacity (``layout``; M11.8).
    ``layer``: the :class:`~subspace_ref.hf.GraphSubspaceLayer` (its device, dtypes, capacity, count);
    ``g``: query heads per KV head; ``identity``: whether the key and the value basis are the
    identity (held as arrays for the kernels, not counted as bases, spec/layer_state.md L1);
    ``first_position``: the position of compressed token 0 (the layer's sinks, M11.14)."""

    def __init__(self, layer, heads: tuple[int, ...], state, d: int, g: int, identity: tuple[bool, bool] = (False, False), first_position: int = 0):
        self.heads = tuple(heads)
        self.first_position = int(first_position)  # of compressed token 0: the sinks before it (spec/window.md W10)
        self.identity = tuple(identity)
        all_heads = self.heads == tuple(range(layer.num_heads))
        dev, N, L = layer.device, layer.batch_size, layer.max_cache_len
        # the KV heads' rows and their query heads' rows (h g + i), constants of the graph, where the group is not the whole layer
        self.head_index = None if all_heads else torch.tensor(self.heads, device=dev)
        self.query_index = None if all_heads else torch.tensor([h * g + i for h in self.heads for i in range(g)], device=dev)
        lay = decoded_state(state).layout
        exact = dict(dtype=layer.compute_dtype, device=dev)
        to_tensor = lambda x: torch.as_tensor(np.asarray(x.detach().cpu() if isinstance(x, torch.Tensor) else x), **exact)  # noqa: E731
        self.key_basis, self.value_basis = to_tensor(lay.key_bases[0, :, 0]), to_tensor(lay.value_bases[0, :, 0])
        self.gamma = to_tensor(lay.gamma)
        self.rope = getattr(state.policy, "rope", None)
        if self.rope is not None:  # float64 frequencies: the angles of M11.10 are taken in float64, as the state's
            self.inv_freq = torch.tensor(np.array(self.rope.inv_freq), dtype=torch.float64, device=dev)
            self.rope_dims = rotating_dims(self.rope, d)
        self.layout = None  # the fixed packed layout of a quantised or pre-RoPE group (graph_storage, M11.8)
        self.kernel = False  # whether the Triton decode kernel reads that layout here (M11.6)
        self.workspace = self.workspace_handle = self.workspace_key = None
        self.fresh_keys = None  # the float keys of the last eager block into low-bit keys (M11.8 step 3)
        needs = kernel_needs(state)
        if needs is None:
            h = len(self.heads)
            self.keys = torch.zeros((N, h, L, self.key_basis.shape[1]), dtype=layer.dtype, device=dev)
            self.values = torch.zeros((N, h, L, self.value_basis.shape[1]), dtype=layer.dtype, device=dev)
        else:
            self.kernel = kernel_backend(dev, layer.dtype) is not None
            if not self.kernel and dev.type == "cuda":
                raise NotSupportedError(f"layer {layer.layer_idx}: the graph cache does not hold",
                                        [f"{needs} on CUDA without the triton decode kernel for {layer.dtype} (M11.6)"])
            # states of half models in their dtype, as the SubspaceCache converts them
            layout_dtype = layer.dtype if layer.dtype in (torch.float16, torch.bfloat16) else layer.compute_dtype
            self.layout = graph_storage.fixed_layout(state, dev, layout_dtype, L)
            self.keys, self.values = self.layout.key_coef, self.layout.value_coef

    # ------------------------------------------------------------------ what it holds
    def held(self) -> tuple[torch.Tensor, ...]:
        """The per-sequence tensors: C and D, or the fixed layout's arrays of tokens."""
        return (self.keys, self.values) if self.layout is None else tuple(graph_storage.sequence_arrays(self.layout).values())

    def constants(self) -> tuple[torch.Tensor, ...]:
        """The tensors a captured graph reads besides :meth:`held` (static addresses)."""
        rope = () if self.rope is None else (self.inv_freq,)
        heads = () if self.head_index is None else (self.head_index, self.query_index)
        return (self.key_basis, self.value_basis, self.gamma, *rope, *heads)

    def counted_bases(self) -> tuple[torch.Tensor, ...]:
        """The bases and γ that count as held bytes: not identity bases (as ``LayerState.nbytes``)."""
        return tuple(t for t, identity in ((self.key_basis, self.identity[0]), (self.value_basis, self.identity[1]), (self.gamma, False)) if not identity)

    @property
    def low_bit_keys(self) -> bool:
        """Whether the keys are int4/int2 codes in groups (M11.8 steps 1, 3, 4 treat them apart)."""
        return self.layout is not None and bool(self.layout.side_format("key").low_bits)

    def own(self, x: torch.Tensor, queries: bool = False) -> torch.Tensor:
        """The rows of ``x`` (batch, heads, ...) that belong to this group's KV heads, or with
        ``queries`` those of their query heads (query head h g + i reads KV head h, GQA)."""
        index = self.query_index if queries else self.head_index
        return x if index is None else x.index_select(1, index)

    # ------------------------------------------------------------------ writes
    def angles(self, positions: torch.Tensor, dtype: torch.dtype, inverse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's (a cos, a sin) at ``positions`` (device slots), taken in float64 as the state
        takes them (spec/rope.md P2), or those of the inverse rotation; in ``dtype``."""
        angles = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        cos, sin = self.rope.attention_scaling * torch.cos(angles), self.rope.attention_scaling * torch.sin(angles)
        if inverse:
            cos, sin = inverse_angles(cos, sin, self.rope)
        return cos.to(dtype), sin.to(dtype)

    def coefficients(self, key_states: torch.Tensor, value_states: torch.Tensor, index, compute_dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """M11.1 step 2 (M11.10 step 1): the coefficients of this group's new keys and values,
        compressed tokens ``index`` .. (a device scalar or an int)."""
        keys = self.own(key_states).to(compute_dtype)
        n = keys.shape[2]
        if self.rope is not None:  # the keys back to pre-RoPE, each by its position
            positions = torch.arange(n, device=keys.device) + index + self.first_position
            keys = rotate_by(keys, *self.angles(positions, compute_dtype, inverse=True), self.rope_dims)
        c = torch.einsum("bhnd,hrd->bhnr", keys, self.key_basis)
        dv = torch.einsum("bhnd,hrd->bhnr", self.own(value_states).to(compute_dtype), self.value_basis)
        return c, dv

    def check_range(self, c: torch.Tensor, dv: torch.Tensor) -> None:
        """ValueError (Q1's float16 range) before any group of the layer writes, in eager mode."""
        if self.layout is not None:
            for which, new in (("key", c), ("value", dv)):
                graph_storage.check_range(self.layout, which, new)

    def write(self, c: torch.Tensor, dv: torch.Tensor, count: torch.Tensor, eager: bool) -> None:
        """M11.1 step 3: store the coefficients at slots count .. count + n - 1 (M11.8 step 1)."""
        if self.layout is None:
            positions = torch.arange(c.shape[2], device=c.device) + count
            self.keys.index_copy_(2, positions, c.to(self.keys.dtype))
            self.values.index_copy_(2, positions, dv.to(self.values.dtype))
        else:
            self.fresh_keys = graph_storage.write(self.layout, "key", count, c, eager)
            graph_storage.write(self.layout, "value", count, dv, eager)

    def reorder(self, idx: torch.Tensor) -> None:
        """Beam search: every stored array reordered in place, and a block's kept float keys."""
        for t in self.held():
            t.copy_(t.index_select(0, idx))
        if self.fresh_keys is not None:  # a crop may still put them back (M11.8 step 4)
            first, rows = self.fresh_keys
            self.fresh_keys = first, rows.index_select(0, idx)

    def crop_rows(self, T: int, k: int, layer_idx: int):
        """M11.8 step 4 for a crop from T to k tokens: a function that puts the float rows of the
        unfinished group back (None when nothing is to be put back); RuntimeError, nothing
        changed, when neither the tail nor the last block still holds them."""
        if not self.low_bit_keys or T - k < 2:  # one token back never leaves its group's earlier rows
            return None
        G = self.layout.group
        start = k // G * G
        if self.fresh_keys is not None and self.fresh_keys[0] <= start:
            first, rows = self.fresh_keys

            def put_back():
                self.layout.key_tail[:, :, : k - start] = rows[:, :, start - first : k - first]

            return put_back
        if k > start and (T - 1) // G != k // G:
            raise RuntimeError(f"layer {layer_idx}: cropping {T} tokens to {k} needs the float keys of tokens {start}..{k - 1}, "
                               f"which later writes replaced; call cache.reset()")
        return None

    def reset(self) -> None:
        """Empty the group, keeping its tensors (and so a captured graph's addresses)."""
        for t in self.held():
            t.zero_()
        self.fresh_keys = None

    # ------------------------------------------------------------------ attention
    def prepare_kernel(self, query_heads: int, dtype, scaling: float, count: torch.Tensor) -> None:
        """M11.6 step 1 (eager): the decode workspace for ``query_heads`` of this group's heads."""
        key = (self.layout.key_coef.shape[0], query_heads, dtype, scaling)
        if self.workspace is None or self.workspace_key != key:
            from subspace_ref_triton import graph_op
            from subspace_ref_triton.workspace import DecodeWorkspace

            self.workspace = DecodeWorkspace(self.layout, query_heads, dtype, scale=scaling, num_tokens=count, fixed_tail=True, rope=self.rope,
                                             first_position=self.first_position)
            self.workspace_handle, self.workspace_key = graph_op.register(self.workspace, list(graph_storage.sequence_arrays(self.layout))), key
            torch._dynamo.mark_static_address(self.workspace_handle)
            self.decode_op = torch.ops.subspace_ref_triton.workspace_decode

    def kernel_step(self, query: torch.Tensor, scaling: float, all_visible: bool) -> bool:
        """Whether this group's queries (batch, h g, n, d) decode through its prepared kernel
        (M11.6): one query, every written slot visible, the workspace built for these shapes."""
        N, Hq, n, _ = query.shape
        return n == 1 and self.workspace is not None and all_visible and self.workspace_key == (N, Hq, query.dtype, scaling)

    def decode(self, query: torch.Tensor, count: torch.Tensor, exact: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        """M11.6 step 2 for a :meth:`kernel_step` query (batch, h g, 1, d) over ``count``
        compressed tokens: (batch, 1, h g, d_v) in its dtype. ``exact``: a windowed layer's sinks
        and ring, and its token count (M11.14 step 4), merged in the same launch."""
        if exact and self.head_index is not None:
            exact = (*exact, self.head_index)
        return self.decode_op(query[:, :, 0].contiguous(), list(self.held()), count, self.workspace_handle, list(exact))[:, None]

    def attend(self, query: torch.Tensor, mask: torch.Tensor | None, scaling: float, layer, all_visible: bool, counts: torch.Tensor | None = None):
        """Spec M11.2 (A2 through SDPA, M11.3) for this group's n queries (batch, h g, n, d) of
        the last n tokens written, under transformers' mask over the capacity (True / 0 =
        attend; None: the written slots, causally): (batch, n, h g, d_v) in the query's dtype,
        and None. One query through the kernel when its workspace is prepared and every written
        slot is visible: M11.6 instead (:meth:`decode`); several over low-bit keys: M11.8 step 3;
        pre-RoPE keys: M11.10 step 3. With ``counts`` (a windowed layer's step that does not go
        through the kernel, M11.14 step 5: the compressed tokens each query sees; ``mask`` then a
        boolean (N or 1, 1, n, L) over compressed slots, or None) the output in the compute dtype
        and its log-sum-exp (batch, h g, n) in the compute dtype."""
        N, Hq, n, d = query.shape
        count = layer.compressed
        if counts is None and self.kernel_step(query, scaling, all_visible):
            return self.decode(query, count), None
        H = len(self.heads)
        g = Hq // H
        q = query.to(layer.compute_dtype).view(N, H, g, n, d)
        if self.layout is None:
            C, D = self.keys, self.values
        else:  # the read-back coefficients (M11.8 step 2)
            C, D = (graph_storage.read(self.layout, which, count, layer.dtype, layer.max_cache_len) for which in ("key", "value"))
        slots = layer.slots
        visible = mask if counts is None else layer.slots[None, :] < counts[:, None]
        if counts is not None and mask is not None:
            visible = visible & mask
        if n > 1 and self.low_bit_keys and self.fresh_keys is not None:
            T = int(count)  # eager: a block's queries
            seen = torch.arange(T - n + 1, T + 1, device=C.device) if counts is None else counts
            C, D, visible = self._block_keys(C, D, visible, seen, T)
            slots = torch.cat([slots, slots])
        if self.rope is None:
            qt = torch.einsum("bhgnd,hrd->bhgnr", q, self.key_basis) * self.gamma[None, :, None, None, None]  # step 1, γ folded in
        else:  # M11.10 step 3: the keys rebuilt and rotated by their positions, the query as it is
            qt = q * self.gamma[None, :, None, None, None]
            C = rotate_by(torch.einsum("bhlr,hrd->bhld", C.to(layer.compute_dtype), self.key_basis),
                          *self.angles(slots + self.first_position, layer.compute_dtype), self.rope_dims).to(layer.dtype)
        qt = qt.to(layer.dtype)
        if counts is not None:  # M11.14 step 5: with the log-sum-exp, which SDPA does not return
            logits = torch.einsum("bhgnr,bhlr->bhgnl", qt.to(layer.compute_dtype), C.to(layer.compute_dtype)) * scaling
            y, lse = softmax_sum(logits, visible, D.to(layer.compute_dtype))
            out = torch.einsum("bnhgr,hre->bnhge", y.view(N, n, H, g, -1), self.value_basis)
            return out.reshape(N, n, Hq, -1), lse
        if n == 1:  # decode: the g query heads of a KV head as g query rows of it, so no GQA kernel is needed
            visible = (layer.slots < count).view(1, 1, 1, -1) if mask is None else mask  # (1 or N, 1, 1, L)
            y = F.scaled_dot_product_attention(qt.view(N, H, g, -1), C, D, attn_mask=visible, scale=scaling)  # steps 2-3
        elif visible is None:  # transformers drops the mask only for a first forward (q_offset = 0): causal over its n slots
            y = F.scaled_dot_product_attention(qt.reshape(N, Hq, n, -1), C[:, :, :n], D[:, :, :n], is_causal=True, scale=scaling, enable_gqa=True)
        else:
            y = F.scaled_dot_product_attention(qt.reshape(N, Hq, n, -1), C, D, attn_mask=visible, scale=scaling, enable_gqa=True)
        out = torch.einsum("bhgnr,hre->bhgne", y.to(layer.compute_dtype).reshape(N, H, g, n, -1), self.value_basis)  # step 4: (α̂ᵀD) E
        return out.reshape(N, Hq, n, -1).transpose(1, 2).to(query.dtype), None

    def _block_keys(self, C: torch.Tensor, D: torch.Tensor, visible: torch.Tensor | None, seen: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """M11.8 step 3, eager: for n > 1 queries over low-bit keys, query ``i`` seeing the first
        ``seen[i]`` of the T stored slots, the slots twice, read back (C) and with the float rows
        the block's write kept (its groups), and a mask over both letting the query see key ``t``
        in the first copy iff ``t``'s group is complete within ``seen[i]`` (Q2.2), else in the
        second: one SDPA over the 2L slots. ``visible``: the mask over the L slots (None: ``t <
        seen[i]``)."""
        G = self.layout.group
        first, rows = self.fresh_keys
        plain = C.clone()
        plain[:, :, first:T] = rows.to(plain.dtype)
        slots = torch.arange(C.shape[2], device=C.device)
        coded = (slots // G * G + G)[None, :] <= seen[:, None]  # (n, L)
        if visible is None:
            visible = slots[None, :] < seen[:, None]
        if visible.dtype == torch.bool:
            both = torch.cat([visible & coded, visible & ~coded], dim=-1)
        else:  # an additive mask
            both = torch.cat([visible.masked_fill(~coded, float("-inf")), visible.masked_fill(coded, float("-inf"))], dim=-1)
        return torch.cat([C, plain], dim=2), torch.cat([D, D], dim=2), both


__all__ = ["GraphHeadGroup", "kernel_backend", "kernel_needs"]
