"""A full-precision recent window, a length threshold and small-lookahead anchoring (spec/window.md).

A state built with ``window=W`` (and/or ``min_tokens=M``) holds its tokens in two parts that
partition [0, T): the compressed part, tokens [0, T_c) in the policy's packed layout (spec A9),
and the exact part, tokens [T_c, T) kept as keys and values in the state's dtype, where
``T_c = 0`` while T < M and ``T_c = max(T - W, 0)`` after (spec/window.md W1). Attention treats
the exact part as one more chunk of spec A3 with identity bases and gamma = 1 (W3).

This module holds the exact part (:class:`ExactWindow`), the append that moves tokens from it to
the compressed part (W2), the oracle's exact chunk (W3) and the lookahead snapshot (W4). It
imports no accelerator library: torch arrays are recognised by type, as in
:mod:`subspace_ref.arrays`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from subspace_ref import _checks
from subspace_ref import frequent_directions as fd
from subspace_ref.arrays import array_family, clone, itemsize, namespace, numel


@dataclass
class ExactWindow:
    """The exact part of a windowed state (spec/window.md W1): hyper-parameters ``size`` (W),
    ``min_tokens`` (M), ``lookahead`` (L_h, adaptive states only) and the exact tokens
    ``keys`` (N, H, e, d), ``values`` (N, H, e, d_v) with e = T - T_c, oldest first.

    The arrays hold exactly the e live tokens (no spare capacity), so copies, conversions and
    saved files take them whole."""

    size: int
    min_tokens: int
    lookahead: int
    keys: Any
    values: Any

    @property
    def count(self) -> int:
        """e, the number of exact tokens."""
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the exact tokens: N H e (d + d_v) itemsize (spec/window.md W5)."""
        return (numel(self.keys) + numel(self.values)) * itemsize(self.keys)

    def arrays(self) -> dict[str, Any]:
        return {"window_keys": self.keys, "window_values": self.values}

    def map_arrays(self, fn) -> "ExactWindow":
        """A window with ``fn`` applied to both arrays (copies, conversions)."""
        return replace(self, keys=fn(self.keys), values=fn(self.values))


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


def empty(window: int, min_tokens: int, lookahead: int, n: int, heads: int, d: int, d_v: int, dtype) -> ExactWindow | None:
    """The exact part of an empty state, or None when W = M = 0: the plain state, unchanged."""
    if window == 0 and min_tokens == 0:
        return None
    return ExactWindow(window, min_tokens, lookahead, np.zeros((n, heads, 0, d), dtype=dtype), np.zeros((n, heads, 0, d_v), dtype=dtype))


def compressed_count(T: int, window: int, min_tokens: int) -> int:
    """T_c of spec/window.md W1: 0 while T < M, else max(T - W, 0). Non-decreasing in T (W1.1)."""
    return 0 if T < min_tokens else max(T - window, 0)


def _concat(a: Any, b: Any) -> Any:
    if array_family(a) == "torch":
        import torch  # the arrays are torch tensors already, so torch is loaded

        return torch.cat([a, b], dim=2)
    return namespace(a).concatenate([a, b], axis=2)


def append(state, keys: Any, values: Any, compress) -> None:
    """Spec/window.md W2 for validated keys (N, H, n, d), values (N, H, n, d_v) in the state's
    family and dtype. ``compress(state, keys, values, ahead)`` is the backend's append of the
    tokens leaving the exact part (``ahead``: the lookahead tokens after them, or None; W4); the
    operations layer passes it. The compressed part is appended first (its backend commits only
    at its end) and the exact part replaced after, so a failure anywhere leaves the state as it
    was."""
    win = state.window
    T_c = state.layout.num_tokens
    # step 1: the new compressed count
    T_new = T_c + win.count + keys.shape[2]
    moved = compressed_count(T_new, win.size, win.min_tokens) - T_c
    # step 2: the exact tokens followed by the new ones cover [T_c, T_new), in order
    all_k, all_v = _concat(win.keys, keys), _concat(win.values, values)
    if moved > 0:
        # step 3: the oldest `moved` leave the exact part through the policy's ordinary append
        # step 3 (W4): with lookahead, the L_h tokens after them, which have arrived, anchor new chunks
        after = slice(moved, moved + win.lookahead)
        ahead = (all_k[:, :, after], all_v[:, :, after]) if win.lookahead else None
        compress(state, all_k[:, :, :moved], all_v[:, :, :moved], ahead)
    # step 4: the rest is the exact part (copies: the state never holds views of the caller's arrays)
    state.window = replace(win, keys=clone(all_k[:, :, max(moved, 0) :]), values=clone(all_v[:, :, max(moved, 0) :]))


def add_exact_chunk(partial, qv: np.ndarray, win: ExactWindow, n: int, h: int, scale: float, work) -> None:
    """Spec/window.md W3 in the oracle: the exact tokens of (sequence n, head h) enter the
    blockwise softmax of spec A3 as one more chunk with B = I, E = I and gamma = 1: logits
    scale * K q, values V (``(w V) I = w V`` exactly, so no identity product is formed)."""
    K = np.asarray(win.keys[n, h]).astype(work)
    V = np.asarray(win.values[n, h]).astype(work)
    partial.add_chunk(work.type(scale) * (K @ qv), V, np.eye(V.shape[1], dtype=work))


def lookahead_stream(keys: Any, values: Any, ahead: tuple | None) -> tuple | None:
    """(keys, values, L_h) of a block followed by the L_h tokens after it (spec/window.md W4),
    or None without lookahead: the argument :func:`anchor_buffers` reads."""
    if ahead is None or ahead[0].shape[2] == 0:
        return None
    return _concat(keys, ahead[0]), _concat(values, ahead[1]), ahead[0].shape[2]


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
