"""Exact attention sinks, a full-precision recent window, a length threshold and small-lookahead
anchoring (spec/window.md).

A state built with ``window=W`` (and/or ``min_tokens=M``) holds its tokens in two parts that
partition [0, T): the compressed part, tokens [0, T_c) in the policy's packed layout (spec A9),
and the exact part, tokens [T_c, T) kept as keys and values in the state's dtype, where
``T_c = 0`` while T < M and ``T_c = max(T - W, 0)`` after (spec/window.md W1). With ``sinks=S``
the first S tokens are kept exact as well, and the compressed part and the recent window split
the tokens after them as a window state with threshold max(M - S, 0) would (W7). Attention
treats each exact part as one more chunk of spec A3 with identity bases and gamma = 1 (W3, W8).

This module holds the exact parts (:class:`ExactWindow`), the append that moves tokens from the
window to the compressed part (W2, W7), the oracle's exact chunks (W3) and the lookahead
snapshot (W4). It
imports no accelerator library: torch arrays are recognised by type, as in
:mod:`subspace_ref.arrays`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from subspace_ref import _checks
from subspace_ref import frequent_directions as fd
from subspace_ref.arrays import clone, concat


@dataclass
class ExactWindow:
    """The exact parts of a windowed state (spec/window.md W1, W7): hyper-parameters ``size``
    (W), ``min_tokens`` (M), ``lookahead`` (L_h, adaptive states only), ``sinks`` (S); the
    recent exact tokens ``keys`` (N, H, e, d), ``values`` (N, H, e, d_v), oldest first; and,
    when S > 0, the sink tokens ``sink_keys`` (N, H, s, d), ``sink_values`` (N, H, s, d_v),
    s = min(T, S) (None when S = 0).

    The arrays hold exactly the live tokens (no spare capacity), so copies, conversions, byte
    counts and saved files take them whole (they are in :data:`subspace_ref.layout.STATE_ARRAYS`)."""

    size: int
    min_tokens: int
    lookahead: int
    keys: Any
    values: Any
    sinks: int = 0
    sink_keys: Any = None
    sink_values: Any = None

    @property
    def recent(self) -> int:
        """e, the number of recent exact tokens (after the compressed part)."""
        return self.keys.shape[2]

    @property
    def sink_count(self) -> int:
        """s = min(T, S), the number of sink tokens held."""
        return 0 if self.sink_keys is None else self.sink_keys.shape[2]

    @property
    def count(self) -> int:
        """s + e, every exact token."""
        return self.recent + self.sink_count


def options(window: Any, min_tokens: Any, lookahead: Any, kind: str) -> tuple[int, int, int]:
    """The checked (W, M, L_h): non-negative ints, L_h <= W, L_h only for adaptive states.
    TypeError/ValueError naming the argument otherwise (spec/window.md W1, W4)."""
    values = []
    for name, value in (("window", window), ("min_tokens", min_tokens), ("lookahead", lookahead)):
        value = _checks.integer(name, value)
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        values.append(value)
    W, M, L = values
    if L > W:
        raise ValueError(f"lookahead must be <= window = {W} (lookahead tokens are the exact ones), got {L}")
    if L and kind != "adaptive":
        raise ValueError(f"lookahead applies to adaptive states only (it anchors new chunks), got lookahead={L} for a {kind} state")
    return W, M, L


def sink_option(sinks: Any, rope: Any = None) -> int:
    """The checked S of spec/window.md W7: a non-negative int (with pre-RoPE bases the
    compressed tokens' positions start at S: W10)."""
    S = _checks.integer("sinks", sinks)
    if S < 0:
        raise ValueError(f"sinks must be >= 0, got {S}")
    return S


def first_compressed_position(state) -> int:
    """Spec/window.md W10: the position of compressed token 0, S (the sinks hold positions
    0..S-1 and every later token passes through the recent window in order), 0 without sinks.
    Pre-RoPE states un-rotate and rotate compressed token t at position S + t."""
    return 0 if state.window is None else state.window.sinks


def empty(window: int, min_tokens: int, lookahead: int, n: int, heads: int, d: int, d_v: int, dtype, sinks: int = 0) -> ExactWindow | None:
    """The exact part of an empty state, or None when W = M = S = 0: the plain state, unchanged."""
    if window == 0 and min_tokens == 0 and sinks == 0:
        return None
    zeros = lambda dim: np.zeros((n, heads, 0, dim), dtype=dtype)  # noqa: E731
    sink_arrays = (zeros(d), zeros(d_v)) if sinks else (None, None)
    return ExactWindow(window, min_tokens, lookahead, zeros(d), zeros(d_v), sinks, *sink_arrays)


def compressed_count(T: int, window: int, min_tokens: int) -> int:
    """T_c of spec/window.md W1: 0 while T < M, else max(T - W, 0). Non-decreasing in T (W1.1)."""
    return 0 if T < min_tokens else max(T - window, 0)


def after_sinks_threshold(min_tokens: int, sinks: int) -> int:
    """The length threshold of the token stream after the sinks (spec/window.md W7): the whole
    state holds T = S + T', so T >= M iff T' >= M - S."""
    return max(min_tokens - sinks, 0)


def append(state, keys: Any, values: Any, compress) -> None:
    """Spec/window.md W2 for validated keys (N, H, n, d), values (N, H, n, d_v) in the state's
    family and dtype. ``compress(state, keys, values, ahead)`` is the backend's append of the
    tokens leaving the exact part (``ahead``: the lookahead tokens after them, or None; W4); the
    operations layer passes it. The compressed part is appended first (its backend commits only
    at its end) and the exact part replaced after, so a failure anywhere leaves the state as it
    was."""
    win = state.window
    sinks = {}  # the sinks, once full, are the state's own arrays and change no more: kept, not copied
    if win.sink_count < win.sinks:
        # spec/window.md W7: the first S tokens of the stream fill the sinks, the rest follow W2
        take = min(win.sinks - win.sink_count, keys.shape[2])
        sink_keys, sink_values = concat([win.sink_keys, keys[:, :, :take]], 2), concat([win.sink_values, values[:, :, :take]], 2)
        keys, values = keys[:, :, take:], values[:, :, take:]
        if keys.shape[2] == 0:  # nothing else to do, nothing else can fail
            state.window = replace(win, sink_keys=clone(sink_keys), sink_values=clone(sink_values))
            return
        sinks = {"sink_keys": clone(sink_keys), "sink_values": clone(sink_values)}  # committed at step 4
    T_c = state.layout.num_tokens
    # step 1: the new compressed count, of the stream after the sinks (W7)
    T_new = T_c + win.recent + keys.shape[2]
    moved = compressed_count(T_new, win.size, after_sinks_threshold(win.min_tokens, win.sinks)) - T_c
    # step 2: the exact tokens followed by the new ones cover [T_c, T_new), in order
    all_k, all_v = concat([win.keys, keys], 2), concat([win.values, values], 2)
    if moved > 0:
        # step 3: the oldest `moved` leave the exact part through the policy's ordinary append
        # step 3 (W4): with lookahead, the L_h tokens after them, which have arrived, anchor new chunks
        after = slice(moved, moved + win.lookahead)
        ahead = (all_k[:, :, after], all_v[:, :, after]) if win.lookahead else None
        compress(state, all_k[:, :, :moved], all_v[:, :, :moved], ahead)
    # step 4: the rest is the exact part (copies: the state never holds views of the caller's arrays)
    state.window = replace(win, keys=clone(all_k[:, :, max(moved, 0) :]), values=clone(all_v[:, :, max(moved, 0) :]), **sinks)


def add_exact_chunk(partial, qv: np.ndarray, win: ExactWindow, n: int, h: int, scale: float, work) -> None:
    """Spec/window.md W3 and W8 in the oracle: the recent exact tokens of (sequence n, head h),
    and the sink tokens, each enter the blockwise softmax of spec A3 as one more chunk with
    B = I, E = I and gamma = 1: logits scale * K q, values V (``(w V) I = w V`` exactly, so no
    identity product is formed)."""
    for keys, values in ((win.sink_keys, win.sink_values), (win.keys, win.values)):
        if keys is None or keys.shape[2] == 0:
            continue
        K = np.asarray(keys[n, h]).astype(work)
        V = np.asarray(values[n, h]).astype(work)
        partial.add_chunk(work.type(scale) * (K @ qv), V, np.eye(V.shape[1], dtype=work))


def lookahead_stream(keys: Any, values: Any, ahead: tuple | None) -> tuple | None:
    """(keys, values, L_h) of a block followed by the L_h tokens after it (spec/window.md W4),
    or None without lookahead: the argument :func:`anchor_buffers` reads."""
    if ahead is None or ahead[0].shape[2] == 0:
        return None
    return concat([keys, ahead[0]], 2), concat([values, ahead[1]], 2), ahead[0].shape[2]


def anchor_buffers(buf_k: Any, filled_k: int, buf_v: Any, filled_v: int, policy, following: tuple | None, i: int, insert=fd.insert):
    """Spec/window.md W4: the FD buffers from which a new chunk's bases are taken when token i
    of the block fires. Without lookahead (``following`` None) the buffers themselves (spec A7
    step 3, bit for bit); with it, copies into which the L_h tokens after token i (rows
    i+1 .. i+L_h of ``following``, from :func:`lookahead_stream`) have been inserted. ``insert``
    is the array library's spec A4 insertion, which must leave its input buffer unchanged."""
    if following is None:
        return buf_k, filled_k, buf_v, filled_v
    all_k, all_v, L = following
    rows = slice(i + 1, i + 1 + L)
    buf_k, filled_k = insert(buf_k, filled_k, all_k[:, :, rows], policy.ell_k)
    buf_v, filled_v = insert(buf_v, filled_v, all_v[:, :, rows], policy.ell_v)
    return buf_k, filled_k, buf_v, filled_v
