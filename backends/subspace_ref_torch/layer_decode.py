"""A layer's whole decode step in one call of the C kernels (``layer_decode``: spec/layer_state.md
L5.3): every head group's append (:mod:`subspace_ref_torch.layer_append`) and then the
attention of every query head over the states the appends leave (``layer_attention``, as
:class:`~subspace_ref_torch.cpu_kernels.LayerKernel` calls it), the same numbers as the two
calls made one after the other.

The Python around one decode step is a large share of it on a small model (docs/hf.md), so
the call's arguments are made once per layer and admission and a step only writes what a step
changes: the token count, the new exact window, the new key tail, the query and output
pointers. Served: layers the append serves (:func:`~subspace_ref_torch.layer_append.layer_appender`)
whose attention the torch backend routes to the C kernel for the states' life. A step the call
does not serve (a capacity growth, arrays the kernels do not read in place, a non-zero return)
returns None with nothing changed; the caller then appends and attends as before, which runs
every check and names any failure.
"""

from __future__ import annotations

import ctypes
import operator

import torch

from subspace_ref_torch import kernel_library as lib
from subspace_ref_torch.cpu_kernels import LayerKernel, kernel_call, spare_output
from subspace_ref_torch.layer_append import AppendStep, LayerAppender, layer_appender
from subspace_ref_torch.maps import map_sources, token_tiles

_VERSION = operator.attrgetter("_version")  # a torch array's in-place write counter


def layer_decoder(layer, heads, keys: torch.Tensor, values: torch.Tensor, q: torch.Tensor, scale: float) -> "LayerDecoder | None":
    """The one-call decode step of ``layer`` (a :class:`~subspace_ref.LayerState` whose group i
    holds KV heads ``heads[i]``) for new tokens shaped like ``keys`` (N, H, 1, d) and ``values``
    (N, H, 1, d_v) and queries like ``q`` (N, H_q, d), or (N, H_q, 1, d) as the attention
    function receives a decode step's, at logit ``scale``, or None where it is not served for the
    states' life."""
    from subspace_ref import get_backend

    states = [g.state for g in layer.groups]
    appender = layer_appender(states, heads, keys, values)
    if appender is None or not (q.dim() == 3 or (q.dim() == 4 and q.shape[2] == 1)) or q.dtype != torch.float32 or not q.is_cpu:
        return None
    if not isinstance(get_backend("torch").attend_layer_route(q if q.dim() == 3 else q[:, :, 0], layer), LayerKernel):
        return None
    return LayerDecoder(appender, layer, q.shape, scale)


class LayerDecoder:
    """One layer's decode step (see the module docstring); built by :func:`layer_decoder`.

    ``decoder(states, keys, values, q)`` appends the new token (N, H, 1, d) of every KV head to
    the group states (in the layer's order) and returns the attention output (N, H_q, d_v) of
    ``q`` (N, H_q, d) over the layer ((N, H_q, 1, d_v) for ``q`` (N, H_q, 1, d)), or returns None
    with nothing changed."""

    def __init__(self, appender: LayerAppender, layer, q_shape: torch.Size, scale: float):
        N, Hq, d = q_shape[0], q_shape[1], q_shape[-1]
        self.appender, self.q_shape, self.d, self.scale = appender, tuple(q_shape), d, float(scale)
        self.g = Hq // layer.kv_heads
        rows = LayerKernel().rows
        self.rows = [rows(group.heads, N, Hq, self.g) for group in layer.groups]
        self.calls = (lib.GroupCallStruct * len(layer.groups))()
        self.exact = [lib.ExactStruct(scale=self.scale) for _ in layer.groups]  # the exact tokens' logit scale (no gamma)
        self.made_from: list = [None] * len(layer.groups)  # per group: the KernelCall its arguments came from
        self.sources: list = [((), ()) for _ in layer.groups]  # per group: the arrays that call was made from, and their versions
        self.d_v = layer.groups[0].state.d_v
        self.out_shape = self.q_shape[:-1] + (self.d_v,)
        self._spare_outputs: dict = {}
        self._decode = lib.library().layer_decode

    def __call__(self, states, keys: torch.Tensor, values: torch.Tensor, q: torch.Tensor) -> torch.Tensor | None:
        ap = self.appender
        if q.shape != self.q_shape or q.dtype != torch.float32 or keys.shape != ap.key_shape or values.shape != ap.value_shape:
            return None
        if keys.dtype != torch.float32 or values.dtype != torch.float32:
            return None
        keys, values = keys.contiguous(), values.contiguous()
        x = q if q.is_contiguous() else q.contiguous()
        out = spare_output(self._spare_outputs, self.out_shape)
        keys_at, values_at, x_at, out_at = keys.data_ptr(), values.data_ptr(), x.data_ptr(), out.data_ptr()
        groups, tile_for = [], None
        for i, st in enumerate(states):
            lay, win = st.layout, st.window
            last_lay, last_win = ap.committed[i]  # what the last step left: its arrays, bases and sinks are call i's
            arrays, versions = self.sources[i]
            if not (lay is last_lay and win is last_win and tuple(map(_VERSION, arrays)) == versions) and not self._admit(i, st, lay, win, x, out):
                return None
            T = lay.num_tokens
            if T + 1 > lay.key_coef.shape[2]:  # a capacity growth: the caller's path grows the arrays
                return None
            new_k, new_v, tail = ap.fill(i, lay, win, keys_at, values_at)
            c, e = self.calls[i], self.exact[i]
            e.keys[1], e.values[1] = new_k.data_ptr(), new_v.data_ptr()  # the attention reads the new window
            if tile_for != T:
                tile_for, tile = T, token_tiles(T + 1).step
            c.tokens, c.tile, c.q, c.out = T + 1, tile, x_at, out_at
            if tail is not None:
                c.key_tail = tail.data_ptr()
            groups.append((st, lay, win, new_k, new_v, tail))
        if self._decode(len(states), ap.calls, ctypes.byref(ap.magnitude), self.calls) != 0:
            return None  # nothing a state reads has changed: the caller's path names the failure
        ap.commit(AppendStep(groups, keys, values))
        return out

    def _admit(self, i: int, st, lay, win, x: torch.Tensor, out: torch.Tensor) -> bool:
        """Make call i's arguments for group i's state as it is (its layout ``lay`` and window
        ``win``: a state the last step did not leave, or bases written since); False where the
        call does not serve it."""
        if not self.appender._serves(i, lay, win):
            return False
        call = kernel_call(st, self.d, self.scale)
        if call is None or not self._point_sinks(i, win):
            return False
        if self.made_from[i] is not call:
            self.calls[i] = call.group_call(x, lay, 1, None, self.rows[i], self.g, out, [])
            self.calls[i].exact = ctypes.pointer(self.exact[i])
            self.made_from[i] = call
            arrays = tuple(a for a in map_sources(lay) if a is not None)
            self.sources[i] = (arrays, tuple(map(_VERSION, arrays)))
        self.exact[i].count[1] = win.size
        if self.appender.low_bit_keys[i]:
            self.calls[i].tail_head_stride = lay.key_tail.stride(1)
        return True

    def _point_sinks(self, i: int, win) -> bool:
        """Point group i's exact part at its sinks (spec/window.md W7); False where they do not lie
        as the kernel reads them."""
        e = self.exact[i]
        if win.sink_keys is None or win.sink_keys.shape[2] == 0:
            e.keys[0], e.values[0], e.count[0] = None, None, 0
            return True
        sk, sv = win.sink_keys, win.sink_values
        if sk.dtype != torch.float32 or sv.dtype != torch.float32 or not (sk.is_contiguous() and sv.is_contiguous()):
            return False
        e.keys[0], e.values[0], e.count[0] = sk.data_ptr(), sv.data_ptr(), sk.shape[2]
        return True


__all__ = ["LayerDecoder", "layer_decoder"]
