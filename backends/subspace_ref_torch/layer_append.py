"""A decode step's appends of every head group of a layer in one call of the C kernels
(``kernels/static_append.c``: ``layer_window_append``; spec/layer_state.md L3).

Served: a layer whose groups are static torch states on the CPU, float32, each with an exact
window (spec/window.md W2, W7) that is full with its sinks filled, so that one new token per
(sequence, KV head) makes exactly the oldest recent token leave for the compressed part. The
call projects that token (un-rotated first for pre-RoPE keys: spec/rope.md P2), stores it as
``kernel_stores.static_append`` stores it (same projection and stores, so the same bits), and
writes each group's new recent window and (int4 / int2 keys) new key tail into fresh arrays.
Everything a state reads is replaced, never written (as :func:`subspace_ref.window.append` and
the static append do), so restore points, crops and the layer's rollback hold as before.

What depends only on the layer's shapes is checked once (:func:`layer_appender`, at the
layer's admission); a step checks only what an append can change (window fill, capacity, the
arrays' identity). A step the kernels do not serve, or any non-zero return (a token that may
fail the finite check, a coefficient beyond float16's range), returns False with nothing
changed: the caller then appends group by group, which runs every check and raises the error.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from subspace_ref.window import after_sinks_threshold, compressed_count
from subspace_ref_torch import kernel_library as lib
from subspace_ref_torch.kernel_stores import MAX_STORE_GROUP, MAX_STORE_RANK, _unrotation

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class WindowAppendStruct(ctypes.Structure):
    """``struct window_append`` of ``kernels/static_append.c``: one head group's step."""

    _fields_ = [
        ("key_bits", ctypes.c_int), ("value_bits", ctypes.c_int), ("heads", _i64), ("a", _i64), ("keys", _ptr), ("values", _ptr),
        ("rows", _ptr), ("d", _i64), ("d_v", _i64), ("window", _i64), ("window_keys", _ptr), ("window_values", _ptr),
        ("new_window_keys", _ptr), ("new_window_values", _ptr), ("key_basis", _ptr), ("value_basis", _ptr),
        ("rope", ctypes.POINTER(lib.UnrotationStruct)), ("first_position", _i64), ("old_tail", _ptr), ("new_tail", _ptr),
        ("key_side", ctypes.POINTER(lib.Side)), ("value_side", ctypes.POINTER(lib.Side)),
    ]  # fmt: skip


def _static_reason(state) -> str | None:
    """Why the kernel cannot serve this group's decode appends for the state's life (None: it can)."""
    if state.policy.kind != "static" or state.engine != "torch":
        return "not a static torch state"
    lay, win = state.layout, state.window
    if win is None or win.size < 1 or win.lookahead:
        return "no exact window"
    if not isinstance(lay.key_coef, torch.Tensor) or not lay.key_coef.is_cpu or lay.dtype != torch.float32:
        return "not a float32 CPU state"
    if lib.side_bits(lay, "key") is None or lib.side_bits(lay, "value") is None:
        return "a side the kernels do not store"
    r, r_v = lay.key_bases.shape[3], lay.value_bases.shape[3]
    if r < 1 or max(r, r_v) > MAX_STORE_RANK or state.d > lib.MAX_DIM:
        return "ranks or head sizes beyond the kernels' buffers"
    if lay.side_format("key").low_bits and lay.group > MAX_STORE_GROUP:
        return "a key group beyond the kernels' buffers"
    return None


def layer_appender(states, heads, keys: torch.Tensor, values: torch.Tensor) -> "LayerAppender | None":
    """The one-call append of a layer's groups (``states[i]`` holding KV heads ``heads[i]``) for new
    tokens shaped like ``keys`` (N, H, 1, d) and ``values`` (N, H, 1, d_v), or None where the
    kernels do not serve it for the states' life (then every step appends group by group)."""
    if lib.library() is None or keys.dtype != torch.float32 or values.dtype != torch.float32 or not (keys.is_cpu and values.is_cpu):
        return None
    if keys.dim() != 4 or keys.shape[2] != 1 or values.shape[:3] != keys.shape[:3]:
        return None
    if any(_static_reason(st) is not None for st in states):
        return None
    return LayerAppender(states, heads, keys.shape[0], keys.shape[1])


class LayerAppender:
    """One layer's decode-step append (see the module docstring); built by :func:`layer_appender`.

    ``appender(states, keys, values)`` appends the one new token (N, H, 1, d) of every KV head to
    the group states (in the order given at construction) and returns True, or returns False with
    nothing changed."""

    def __init__(self, states, heads, batch: int, kv_heads: int):
        self.calls = (WindowAppendStruct * len(states))()
        self.magnitude = ctypes.c_double()
        self.held: list = [None] * len(states)  # per group: the arrays its call's pointers point into
        self.committed: list = [(None, None)] * len(states)  # per group: the layout and window the last step left
        self.low_bit_keys = [bool(st.layout.side_format("key").low_bits) for st in states]
        self.rows = []
        self.unrotations = []
        for i, (st, hs) in enumerate(zip(states, heads)):
            lay, win = st.layout, st.window
            rows = torch.tensor([n * kv_heads + h for n in range(batch) for h in hs], dtype=torch.int64)
            self.rows.append(rows)
            c = self.calls[i]
            c.key_bits, c.value_bits = lib.side_bits(lay, "key"), lib.side_bits(lay, "value")
            c.heads, c.rows, c.d, c.d_v, c.window = batch * len(hs), rows.data_ptr(), st.d, st.d_v, win.size
            rope = getattr(st.policy, "rope", None)
            if rope is not None:  # held here too: the cache may drop it, and the struct points into its arrays
                self.unrotations.append(_unrotation(rope, st.d))
                c.rope = ctypes.pointer(self.unrotations[-1][1])
            c.first_position = win.sinks
        self.batch, self.kv_heads = batch, kv_heads
        self.key_shape, self.value_shape = (batch, kv_heads, 1, states[0].d), (batch, kv_heads, 1, states[0].d_v)  # a step's new tokens

    def _arrays(self, i: int, lay) -> bool:
        """Point call i at ``lay``'s coefficient arrays and decoded bases (derived again only when
        they are other arrays than the last step's); False where they do not lie as the kernels read them."""
        held = self.held[i]
        arrays = lib.side_arrays(lay)
        if held is not None and held[0] is lay.key_bases and held[1] is lay.value_bases and all(a is b for a, b in zip(held[2], arrays)):
            return True
        sides = lib.kernel_sides(lay)
        if sides is None:
            return False
        kb = lay.decoded_bases("key", torch.float32)[:, :, 0].contiguous()
        vb = lay.decoded_bases("value", torch.float32)[:, :, 0].contiguous()
        c = self.calls[i]
        c.key_basis, c.value_basis = kb.data_ptr(), vb.data_ptr()
        c.key_side, c.value_side = ctypes.pointer(sides[0]), ctypes.pointer(sides[1])
        self.held[i] = (lay.key_bases, lay.value_bases, arrays, kb, vb, sides)
        return True

    def __call__(self, states, keys: torch.Tensor, values: torch.Tensor) -> bool:
        step = self.prepare(states, keys, values)
        if step is None or lib.library().layer_window_append(len(states), self.calls, ctypes.byref(self.magnitude)) != 0:
            return False  # nothing a state reads has changed: the caller's path names the failure
        self.commit(step)
        return True

    def prepare(self, states, keys: torch.Tensor, values: torch.Tensor) -> "AppendStep | None":
        """Fill the calls for this step's new tokens; None where the kernels do not serve it
        (nothing changed). What the calls point at stays held by the returned step."""
        if keys.shape[0] != self.batch or keys.shape[1] != self.kv_heads or keys.shape[2] != 1 or keys.dtype != torch.float32 or values.dtype != torch.float32:
            return None
        keys, values = keys.contiguous(), values.contiguous()
        commits = []
        for i, st in enumerate(states):
            lay, win = st.layout, st.window
            if not (lay is self.committed[i][0] and win is self.committed[i][1]) and not self._serves(i, lay, win):
                return None  # (what this appender committed last step still holds what _serves checked)
            if lay.num_tokens + 1 > lay.key_coef.shape[2]:
                lay = lay.with_capacity(lay.num_tokens + 1, lay.key_bases.shape[2])
                if not self._arrays(i, lay):
                    return None
            commits.append((st, lay, win, *self.fill(i, lay, win, keys.data_ptr(), values.data_ptr())))
        return AppendStep(commits, keys, values)

    def fill(self, i: int, lay, win, keys_at: int, values_at: int) -> tuple:
        """Point call i at this step's tokens (the contiguous keys and values at ``keys_at``,
        ``values_at``), ``lay``'s row and ``win``, and at fresh arrays for the new window and (int4 /
        int2 keys) key tail, which it returns: (new window keys, new window values, new tail or None)."""
        c = self.calls[i]
        new_k, new_v = torch.empty_like(win.keys), torch.empty_like(win.values)
        tail = None
        if self.low_bit_keys[i]:
            tail = torch.empty_like(lay.key_tail)
            c.old_tail, c.new_tail = lay.key_tail.data_ptr(), tail.data_ptr()
        c.a, c.keys, c.values = lay.num_tokens, keys_at, values_at
        c.window_keys, c.window_values = win.keys.data_ptr(), win.values.data_ptr()
        c.new_window_keys, c.new_window_values = new_k.data_ptr(), new_v.data_ptr()
        return new_k, new_v, tail

    def _serves(self, i: int, lay, win) -> bool:
        """Whether group i's state (its layout and window) is one the call appends to: a full
        window of float32 contiguous arrays with its sinks filled, a float32 contiguous key tail,
        arrays the kernels read in place (pointed at by call i)."""
        W = win.size
        if win.keys.shape[2] != W or win.sink_count != win.sinks or not (win.keys.is_contiguous() and win.values.is_contiguous()):
            return False
        if win.keys.dtype != torch.float32 or win.values.dtype != torch.float32:
            return False
        T = lay.num_tokens
        if compressed_count(T + W + 1, W, after_sinks_threshold(win.min_tokens, win.sinks)) != T + 1:
            return False
        if self.low_bit_keys[i] and (lay.key_tail.dtype != torch.float32 or not lay.key_tail.is_contiguous()):
            return False
        return self._arrays(i, lay)

    def commit(self, step: "AppendStep") -> None:
        """Adopt what a successful call wrote: each state one token longer, with its new window and tail."""
        for i, (st, lay, win, new_k, new_v, tail) in enumerate(step.groups):
            lay = _shallow_copy(lay)  # as dataclasses.replace(lay, num_tokens=...), without re-running its checks
            lay.num_tokens += 1
            if tail is not None:
                lay.key_tail = tail
            win = _shallow_copy(win)
            win.keys, win.values = new_k, new_v
            st.layout, st.window = lay, win
            self.committed[i] = (lay, win)


def _shallow_copy(x):
    """``copy.copy`` of a plain (dict-backed) dataclass instance, without its reduce protocol: a
    decode step makes four per layer."""
    out = object.__new__(type(x))
    out.__dict__.update(x.__dict__)
    return out


class AppendStep(NamedTuple):
    """A prepared step (:meth:`LayerAppender.prepare`): per group (state, its layout to be
    (grown, if it was), its window, new window keys and values, new key tail or None), and the
    contiguous new tokens the calls point at."""

    groups: list
    keys: torch.Tensor
    values: torch.Tensor


__all__ = ["AppendStep", "LayerAppender", "WindowAppendStruct", "layer_appender"]
