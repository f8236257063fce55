"""The kernel route of the torch ``attend`` (spec R14): spec A2/A3 of a one-chunk state in one call
of ``coefficient_attention`` (``kernels/coefficient_products.c``), each side read in its own
format (float32 rows, int8, int4 or int2) and dequantised in registers; and the kernels' reader of
int4 / int2 rows for the general route. :func:`subspace_ref_torch.plan.plan_attend` decides when
they serve; :mod:`subspace_ref_torch.kernel_library` builds and binds them.
"""

from __future__ import annotations

import ctypes
import math
from typing import NamedTuple

import torch

from subspace_ref.window import first_compressed_position
from subspace_ref_torch import kernel_library as lib
from subspace_ref_torch.maps import map_sources, one_chunk_maps, rope_order, token_tiles

#: the most outputs a KernelCall allocates at once (KernelCall._output), and the most bytes that
#: block may take beyond one output: a caller that keeps an output keeps its block alive
OUTPUTS_PER_BLOCK = 16
OUTPUT_BLOCK_BYTES = 64 * 1024


class RopeKeys(NamedTuple):
    """The rotation of a pre-RoPE state's keys as a :class:`KernelCall` takes it
    (spec/rope.md P3), made by :func:`rope_keys`: ``order`` (d,) int32, the permutation of the
    dims that puts the m rotating planes' first dims first, their second dims next and the fixed
    dims last (the query map's columns are in this order); the planes' frequencies ``inv_freq``
    (m,) float64; ``scaling``, transformers' attention_scaling; ``first``, the position of
    compressed token 0 (spec/window.md W10); the kernels' tables of the rotation, ``offsets`` and
    ``turns`` (spec R14 step 2')."""

    order: torch.Tensor
    inv_freq: torch.Tensor
    scaling: float
    first: int
    offsets: torch.Tensor
    turns: torch.Tensor


class ExactTokens(NamedTuple):
    """A windowed state's exact tokens as a :class:`KernelCall` takes them (spec/window.md W3,
    W8), made by :meth:`of_window`: ``sinks`` and ``recent``, each (keys (N, H, count, d), values (N, H,
    count, d_v)) float32 contiguous (``sinks`` None without sinks), and their logit ``scale`` (no
    gamma: they are not projected)."""

    sinks: tuple[torch.Tensor, torch.Tensor] | None
    recent: tuple[torch.Tensor, torch.Tensor]
    scale: float

    @classmethod
    def of_window(cls, window, scale: float) -> "ExactTokens | None":
        """The exact part ``window`` (``state.window``, spec/window.md W1, W7) at logit ``scale``.

        Returns
        -------
        ExactTokens or None
            float32 arrays as the kernel reads them; None without a window.
        """
        if window is None:
            return None
        float32 = lambda x: x.to(torch.float32).contiguous()  # noqa: E731  (no copy for a float32 state's arrays)
        sinks = (float32(window.sink_keys), float32(window.sink_values)) if window.sink_keys is not None else None
        return cls(sinks, (float32(window.keys), float32(window.values)), float(scale))


def rope_keys(order: torch.Tensor, inv_freq, scaling: float, first: int) -> RopeKeys:
    """The :class:`RopeKeys` of a rotation, its tables made once here rather than in every call.

    Parameters
    ----------
    order : torch.Tensor
        (d,) the permutation of :func:`~subspace_ref_torch.maps.rope_order`.
    inv_freq : array_like
        (m,) the planes' frequencies.
    scaling : float
        transformers' attention_scaling.
    first : int
        Position of compressed token 0.

    Returns
    -------
    RopeKeys
    """
    inv_freq = torch.tensor(inv_freq, dtype=torch.float64)  # a copy: a RopeParams' array is read-only
    m = inv_freq.numel()
    offsets = torch.empty(2 * lib.ROPE_BLOCK * m, dtype=torch.float32)
    turns = torch.empty(2 * m, dtype=torch.float64)
    lib.library().rope_offset_tables(m, inv_freq.data_ptr(), offsets.data_ptr(), turns.data_ptr())
    return RopeKeys(order.to(torch.int32).contiguous(), inv_freq, float(scaling), int(first), offsets, turns)


class KernelCall:
    """Spec A2/A3 over a one-chunk layout in one call of the kernels' ``coefficient_attention``,
    each side in its own format (``key_bits``, ``value_bits``: :func:`kernel_library.side_bits`),
    with the arguments that stay fixed over a decode loop prepared once: the queries' map
    ``query_map`` (N H, d, r) = gamma scale B^T -- or, with ``rope`` (a pre-RoPE state,
    spec/rope.md P3), each key rebuilt by ``query_map`` (N H, r, d) = gamma scale B, its dims in
    ``rope.order``, and turned to its position --, the value basis ``value_map`` (N H, r_v, d_v),
    and the coefficient arrays as stored (:func:`kernel_library.kernel_sides`). Made by
    :meth:`of`, which gives None where those arrays do not lie as the kernels read them.

    Each call passes what changes from step to step: the queries, the token count, the token
    tile, the unfinished key group's float tail (int4 / int2 keys) and a windowed state's exact
    tokens (their logits join the one softmax: A3.1, spec/window.md W3). A call does nothing but
    read those and take its output from a block allocated ahead, since every Python-level
    operation costs a decode step dearly once the caches are cold (docs/benchmarks.md)."""

    def __init__(self, layout, query_map: torch.Tensor, value_map: torch.Tensor, rope: RopeKeys | None, sides: tuple[lib.Side, lib.Side]):
        self.key_bits, self.value_bits = lib.side_bits(layout, "key"), lib.side_bits(layout, "value")
        self.kv_heads = layout.key_coef.shape[1]
        self.d_v = value_map.shape[2]
        self.rope = rope  # holds the rotation's arrays, as _held the maps: the pointers below point into them
        self._held = (query_map, value_map)  # (byref holds the structures)
        self._query_map, self._value_map = query_map.data_ptr(), value_map.data_ptr()
        self._sides = sides
        self._keys, self._values = ctypes.byref(sides[0]), ctypes.byref(sides[1])
        self._key_side, self._value_side = ctypes.pointer(sides[0]), ctypes.pointer(sides[1])  # for a GroupCallStruct's fields
        self._group = layout.group if layout.side_format("key").low_bits else 0
        self._spare_outputs: dict[tuple, list[torch.Tensor]] = {}
        self._attention = lib.library().coefficient_attention
        self._rotation = self._rope_pointer = None
        if rope is not None:
            rotation = lib.RopeStruct(
                rope.order.data_ptr(), rope.inv_freq.numel(), rope.inv_freq.data_ptr(), rope.scaling, rope.first, rope.offsets.data_ptr(), rope.turns.data_ptr()
            )
            self._rotation, self._rope_pointer = ctypes.byref(rotation), ctypes.pointer(rotation)

    @classmethod
    def of(cls, layout, query_map: torch.Tensor, value_map: torch.Tensor, rope: RopeKeys | None = None) -> "KernelCall | None":
        """The call over ``layout``'s arrays.

        Parameters
        ----------
        layout : PackedLayout
        query_map, value_map : torch.Tensor
            The maps of :func:`kernel_maps`.
        rope : RopeKeys or None
            A pre-RoPE state's rotation.

        Returns
        -------
        KernelCall or None
            None when the arrays do not lie as the kernels read them.
        """
        sides = lib.kernel_sides(layout)
        return None if sides is None else cls(layout, query_map, value_map, rope, sides)

    def __call__(self, q: torch.Tensor, layout, tile: int, exact: ExactTokens | None = None) -> torch.Tensor:
        """The attention output of queries ``q`` over ``layout``'s first ``num_tokens`` tokens.

        Parameters
        ----------
        q : torch.Tensor
            (N, H_q, d) or (H_q, d) queries, H_q = g H (float32 work).
        layout : PackedLayout
            The layout this call was made for, or one whose arrays are the same (an append's).
        tile : int
            Tokens per tile of the value sums.
        exact : ExactTokens or None
            A windowed state's exact tokens.

        Returns
        -------
        torch.Tensor
            (N, H_q, d_v) float32, or (H_q, d_v) for unbatched q.
        """
        Hq, d = q.shape[-2:]
        N = q.shape[0] if q.dim() == 3 else 1
        T = layout.num_tokens
        if q.dtype != torch.float32 or not q.is_contiguous():
            q = q.to(torch.float32).contiguous()
        tail = self._tail(layout)
        tail_stride = 0 if tail is None else tail.stride(1)
        out = self._output(q.shape[:-1] + (self.d_v,))
        parts = None if exact is None else ctypes.byref(_exact_struct(exact))
        rc = self._attention(
            self.key_bits, self.value_bits, N * self.kv_heads, Hq // self.kv_heads, T, tile, q.data_ptr(), d, self._query_map, self._keys,
            None if tail is None else tail.data_ptr(), tail_stride, self._rotation, self._values, self._value_map, self.d_v, parts, out.data_ptr(),
        )  # fmt: skip
        lib.check(rc, "coefficient_attention")
        return out

    def group_call(
        self, q: torch.Tensor, layout, tile: int, exact: ExactTokens | None, rows: torch.Tensor, queries: int, out: torch.Tensor, held: list
    ) -> lib.GroupCallStruct:
        """The arguments of this call for one head group of a layer (``struct group_call`` of
        ``layer_attention``): what :meth:`__call__` passes, with the group's query heads and
        outputs read and written where they lie in the layer's ``q`` and ``out``.

        Parameters
        ----------
        q : torch.Tensor
            The layer's queries, (N, H_q, d) or (H_q, d), float32 and contiguous.
        layout : PackedLayout
            The group state's layout (as for :meth:`__call__`).
        tile : int
            Tokens per tile of the value sums.
        exact : ExactTokens or None
            The group state's exact tokens.
        rows : torch.Tensor
            (N H_group,) int64: each (sequence, KV head) pair's first query row in q and out.
        queries : int
            Query heads per KV head (g).
        out : torch.Tensor
            The layer's output, (N, H_q, d_v) or (H_q, d_v) float32, contiguous.
        held : list
            Receives what must stay alive until the kernel returns (a converted key tail).

        Returns
        -------
        GroupCallStruct
        """
        tail = self._tail(layout)
        if tail is not None:
            held.append(tail)
        return lib.GroupCallStruct(
            self.key_bits, self.value_bits, rows.numel(), queries,
            layout.num_tokens, tile, q.data_ptr(), q.shape[-1], self._query_map, self._key_side, None if tail is None else tail.data_ptr(),
            0 if tail is None else tail.stride(1), self._rope_pointer, self._value_side, self._value_map, self.d_v,
            None if exact is None else ctypes.pointer(_exact_struct(exact)), rows.data_ptr(), out.data_ptr(),
        )  # fmt: skip

    def _tail(self, layout) -> torch.Tensor | None:
        """The unfinished key group's keys as the kernel reads them (float32 rows, each head's
        evenly spaced), kept in float (spec/quantization.md Q2); None when there is none."""
        T = layout.num_tokens
        if not (self._group and T % self._group):
            return None
        tail = layout.key_tail
        if tail.dtype != torch.float32 or not lib.in_place(tail):
            tail = tail[:, :, : T % self._group].to(torch.float32).contiguous()
        return tail

    def _output(self, shape: tuple) -> torch.Tensor:
        """A float32 array of ``shape`` that no earlier call returned: one of the disjoint views
        of a block allocated at once (up to OUTPUTS_PER_BLOCK outputs in OUTPUT_BLOCK_BYTES),
        since one ``torch.empty`` per step is a large share of a cold decode step
        (docs/benchmarks.md). A block made in inference mode holds inference tensors, which the
        caller could not update in place outside it, so each mode has its own."""
        return spare_output(self._spare_outputs, shape)


def spare_output(spares: dict, shape: tuple) -> torch.Tensor:
    """A float32 array of ``shape`` that no earlier call with ``spares`` returned (see
    :meth:`KernelCall._output`): a view of a block of up to OUTPUTS_PER_BLOCK outputs allocated
    at once, kept in ``spares`` per shape and inference mode."""
    key = (shape, torch.is_inference_mode_enabled())
    spare = spares.get(key)
    if not spare:
        count = max(1, min(OUTPUTS_PER_BLOCK, OUTPUT_BLOCK_BYTES // (4 * math.prod(shape))))
        spare = spares[key] = list(torch.empty((count, *shape), dtype=torch.float32).unbind(0))
    return spare.pop()


def _exact_struct(exact: ExactTokens) -> lib.ExactStruct:
    """The ``struct exact_part`` of a windowed state's exact tokens (their arrays held by ``exact``)."""
    held = [exact.sinks, exact.recent]
    count = [0 if part is None else part[0].shape[2] for part in held]
    pointer = lambda i, part: None if part is None or part[i].shape[2] == 0 else part[i].data_ptr()  # noqa: E731
    return lib.ExactStruct((ctypes.c_void_p * 2)(*(pointer(0, part) for part in held)), (ctypes.c_void_p * 2)(*(pointer(1, part) for part in held)),
                           (ctypes.c_int64 * 2)(*count), exact.scale)  # fmt: skip


def kernel_attend(q: torch.Tensor, state, scale: float | None) -> torch.Tensor | None:
    """Spec A2/A3 of a one-chunk state in one call of the C kernel: the kernel route of
    :func:`subspace_ref_torch.plan.plan_attend`, and the decode route ``TorchBackend.attend_route``
    hands to ``subspace_ref.attend``. A windowed state's exact tokens join the same softmax in
    the call (spec/window.md W3).

    Parameters
    ----------
    q : torch.Tensor
        (N, H_q, d) or, unbatched, (H_q, d).
    state : SubspaceState
        A state the plan routes to the kernel.
    scale : float or None
        Logit scale (None: 1/sqrt(d)).

    Returns
    -------
    torch.Tensor or None
        The output of q's shape with d_v columns, in q's dtype; None when the state's arrays no
        longer lie as the kernels read them (the caller then takes the general route).
    """
    d = q.shape[-1]
    call = kernel_call(state, d, scale)
    if call is None:
        return None
    lay = state.layout
    exact = None if state.window is None else ExactTokens.of_window(state.window, 1.0 / math.sqrt(d) if scale is None else float(scale))
    out = call(q, lay, token_tiles(lay.num_tokens).step, exact)
    return out if out.dtype == q.dtype else out.to(q.dtype)


class LayerKernel:
    """Spec/layer_state.md L5 of a layer whose every head group the plan routes to the C kernel,
    in one call of the kernels' ``layer_attention``: each group's :class:`KernelCall` arguments
    (:meth:`KernelCall.group_call`), its query heads read from and its outputs written to where
    they lie in the layer's query-head order (no gather of q, no reassembly of the outputs).
    The decode route ``TorchBackend.attend_layer_route`` hands to ``LayerState.attend``; called
    as ``route(q, layer, scale)``, it reads the layer's groups afresh on every call and holds
    only the row tables of the layer's head groups and its output blocks."""

    def __init__(self) -> None:
        self._rows: dict[tuple, torch.Tensor] = {}
        self._spare_outputs: dict[tuple, list[torch.Tensor]] = {}
        self._attention = lib.library().layer_attention

    def rows(self, heads: tuple[int, ...], N: int, Hq: int, g: int) -> torch.Tensor:
        """(N len(heads),) int64: the first query row of each (sequence, KV head) pair of a group
        of KV heads ``heads`` in a layer's (N, H_q) query heads (query head i reads KV head i // g)."""
        key = (heads, N, Hq, g)
        rows = self._rows.get(key)
        if rows is None:
            rows = self._rows[key] = torch.tensor([n * Hq + h * g for n in range(N) for h in heads], dtype=torch.int64)
        return rows

    def __call__(self, q: torch.Tensor, layer, scale: float | None) -> torch.Tensor | None:
        """The layer's attention output.

        Parameters
        ----------
        q : torch.Tensor
            (N, H_q, d) or, unbatched, (H_q, d).
        layer : LayerState
            A layer state every group of which the plan routes to the kernel.
        scale : float or None
            Logit scale (None: 1/sqrt(d)).

        Returns
        -------
        torch.Tensor or None
            q's shape with d_v columns, in q's dtype; None when a group's arrays no longer lie
            as the kernels read them (the caller then attends group by group).
        """
        Hq, d = q.shape[-2:]
        N = q.shape[0] if q.dim() == 3 else 1
        g = Hq // layer.kv_heads
        s = 1.0 / math.sqrt(d) if scale is None else float(scale)
        x = q if q.dtype == torch.float32 and q.is_contiguous() else q.to(torch.float32).contiguous()
        groups = layer.groups
        calls = (lib.GroupCallStruct * len(groups))()
        held: list = []
        out = None
        for i, group in enumerate(groups):
            state = group.state
            call = kernel_call(state, d, scale)
            if call is None:
                return None
            if out is None:
                out = spare_output(self._spare_outputs, x.shape[:-1] + (call.d_v,))
            lay = state.layout
            exact = None if state.window is None else ExactTokens.of_window(state.window, s)
            arguments = call.group_call(x, lay, token_tiles(lay.num_tokens).step, exact, self.rows(group.heads, N, Hq, g), g, out, held)
            calls[i] = arguments  # a copy of the fields: what they point to stays held until the call returns
            held.append((call, exact, arguments))
        lib.check(self._attention(len(groups), calls), "layer_attention")
        return out if out.dtype == q.dtype else out.to(q.dtype)


def kernel_call(state, d: int, scale: float | None) -> KernelCall | None:
    """The :class:`KernelCall` of a one-chunk state for head size d and logit scale ``scale``,
    prepared once and found by one lookup per decode step that checks the bases (content:
    version counters) and the coefficient arrays (identity: appends write them in place, a
    growth replaces them). None where the arrays do not lie as the kernels read them.

    Parameters
    ----------
    state : SubspaceState
    d : int
        Query head size.
    scale : float or None
        Logit scale (None: 1/sqrt(d)).

    Returns
    -------
    KernelCall or None
    """
    lay = state.layout
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)

    def make_call():
        query_map, value_map, rope = kernel_maps(state, d, scale)
        return KernelCall.of(lay, query_map, value_map, rope)

    return lay.derived(("kernel_call", d, s), map_sources(lay), make_call, views=lib.side_arrays(lay))


def kernel_maps(state, d: int, scale: float | None) -> tuple[torch.Tensor, torch.Tensor, RopeKeys | None]:
    """What the kernel takes for a one-chunk state besides its arrays: the query map, the value
    map (:func:`~subspace_ref_torch.maps.one_chunk_maps`) and, for a pre-RoPE state
    (spec/rope.md P3), the rotation of its keys, with gamma * scale * B (N H, r, d), its dims in
    the rotation's order, as the query map: each key is rebuilt by it and turned to its position
    in the kernel. Derived once per bases.

    Parameters
    ----------
    state : SubspaceState
    d : int
        Query head size.
    scale : float or None
        Logit scale (None: 1/sqrt(d)).

    Returns
    -------
    tuple
        (query map, value map, RopeKeys or None).
    """
    maps = one_chunk_maps(state, d, scale, torch.float32)
    rope = getattr(state.policy, "rope", None)
    if rope is None:
        return maps[0], maps[1], None
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)

    def make_rope():
        order = rope_order(rope, d, torch.device("cpu"))
        rebuild = maps[0].mT[..., order].contiguous()  # (N H, r, d): gamma scale B, dims in rope order
        return rebuild, rope_keys(order, rope.inv_freq, rope.attention_scaling, first_compressed_position(state))

    rebuild, keys = state.layout.derived(("kernel_rope", s), (maps[0],), make_rope, writes=False)
    return rebuild, maps[1], keys


def low_bit_rows(layout, which: str, a: int, b: int) -> torch.Tensor:
    """Spec Q2: int4 / int2 coefficients of tokens [a, b) of every head, read by the kernels.

    Parameters
    ----------
    layout : PackedLayout
        A layout whose ``which`` side is int4 / int2 (the plan's ``kernel_rows``).
    which : {"key", "value"}
    a, b : int
        The token range.

    Returns
    -------
    torch.Tensor
        (N, H, b - a, r) float32, as the oracle reads them (``quantization.read_low_bit``):
        fl32(code s + z), keys of whole groups with their group's per-channel scales and zeros
        and the unfinished group from its float tail, values with their token's.
    """
    N, H = layout.key_coef.shape[:2]
    bits = layout.side_format(which).low_bits
    side = lib.kernel_sides(layout)[0 if which == "key" else 1]
    complete = layout.num_tokens // layout.group * layout.group if which == "key" else layout.num_tokens
    end = min(b, complete)
    out = torch.empty((N, H, b - a, side.rank), dtype=torch.float32)
    if end > a:
        lib.check(lib.library().low_bit_rows(bits, N * H, a, end - a, ctypes.byref(side), out.data_ptr(), b - a), "low_bit_rows")
    if b > end:  # the unfinished key group, kept in float (spec/quantization.md Q2)
        out[:, :, max(a, end) - a :] = layout.key_tail[:, :, max(a, complete) - complete : b - complete]
    return out


def softmax_exp(x: torch.Tensor) -> torch.Tensor:
    """e^x (float32, contiguous) by the exponential of the kernels' softmax: for its tests.

    Parameters
    ----------
    x : torch.Tensor

    Returns
    -------
    torch.Tensor
        float32, x's shape.
    """
    x = x.to(torch.float32).contiguous()
    out = torch.empty_like(x)
    lib.library().softmax_exp(x.numel(), x.data_ptr(), out.data_ptr())
    return out


__all__ = [
    "ExactTokens",
    "KernelCall",
    "LayerKernel",
    "RopeKeys",
    "kernel_attend",
    "kernel_call",
    "kernel_maps",
    "low_bit_rows",
    "rope_keys",
    "softmax_exp",
    "spare_output",
]
