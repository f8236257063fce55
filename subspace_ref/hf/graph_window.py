"""The exact parts of a windowed graph layer: attention sinks and the recent window at fixed
addresses (spec/models.md M11.14; spec/window.md W1-W3, W7-W10).

A windowed state keeps its first ``S`` tokens (the sinks) and its last ``W`` tokens exact and
compresses the tokens between. A :class:`~subspace_ref.hf.GraphSubspaceLayer` over such a state
holds the sinks and a ring of ``W`` recent slots in one ``(N, H, S + W, ·)`` array (token
``t >= S`` at ring slot ``(t - S) mod W``, after the sinks), so a decode step writes one row of each at slots
derived from the device token count, and compresses the row the ring gives up: no host value,
no allocation, as a captured graph needs. The compressed part is the head groups' storage, with
its own device count ``T_c``; a decode step through the kernel merges the exact part into the
groups' launches, any other attention merges the groups' log-sum-exps with the exact part's.
"""

from __future__ import annotations

import torch


def compressed_count(T: int, sinks: int, window: int) -> int:
    """T_c after T tokens (spec/window.md W1, W7 with the threshold M' <= W + 1, M11.14)."""
    return max(T - sinks - window, 0)


class ExactParts:
    """Sinks (``S``) and the recent ring (``W``) of a windowed graph layer, in the model's dtype,
    and the compressed count ``compressed`` (a device tensor) that the head groups read."""

    def __init__(self, sinks: int, window: int, batch: int, heads: int, d: int, d_v: int, dtype, device):
        self.sinks, self.window = int(sinks), int(window)
        # sinks then ring in one array, so a decode step attends over it without a concatenation
        self.keys = torch.zeros((batch, heads, self.sinks + self.window, d), dtype=dtype, device=device)
        self.values = torch.zeros((batch, heads, self.sinks + self.window, d_v), dtype=dtype, device=device)
        self.sink_keys, self.sink_values = self.keys[:, :, : self.sinks], self.values[:, :, : self.sinks]
        self.ring_keys, self.ring_values = self.keys[:, :, self.sinks :], self.values[:, :, self.sinks :]
        self.slots = torch.arange(self.sinks + self.window, device=device)
        self.compressed = torch.zeros((), dtype=torch.int64, device=device)
        self.candidates = None  # the exact keys, values and positions of the last eager block, for its queries (step 4)

    def held(self) -> tuple[torch.Tensor, ...]:
        """The per-sequence arrays (beam reorder, reset, bytes): the sinks and the ring's, whose views
        the other attributes are."""
        return (self.keys, self.values)

    # ------------------------------------------------------------------ writes (M11.14 steps 1-2)
    def token(self, keys: torch.Tensor, values: torch.Tensor, count: torch.Tensor):
        """Step 1 for token ``count`` (a device scalar; keys (N, H, 1, d)): the key and value the
        ring gives up (or the token itself when W = 0) and its compressed index, and a function
        that writes the token into the sinks or the ring. Without an eviction (the first S + W
        tokens) the index is 0 and the row unread until a real token 0 overwrites it."""
        S, W = self.sinks, self.window
        after = (count - S).clamp(min=0)
        if W:
            slot = (after % W).view(1)
            out_k, out_v = self.ring_keys.index_select(2, slot), self.ring_values.index_select(2, slot)
            index = (after - W).clamp(min=0)
        else:
            out_k, out_v, index = keys, values, after

        def store():
            if S:
                sink = count.clamp(max=S - 1).view(1)
                is_sink = count < S
                self.sink_keys.index_copy_(2, sink, torch.where(is_sink, keys, self.sink_keys.index_select(2, sink)))
                self.sink_values.index_copy_(2, sink, torch.where(is_sink, values, self.sink_values.index_select(2, sink)))
            if W:
                in_ring = count >= S
                self.ring_keys.index_copy_(2, slot, torch.where(in_ring, keys, out_k))
                self.ring_values.index_copy_(2, slot, torch.where(in_ring, values, out_v))

        return out_k, out_v, index, store

    def block(self, keys: torch.Tensor, values: torch.Tensor, T0: int):
        """Step 2 for tokens T0 .. T0 + n - 1 (eager, host counts): the keys and values that move
        to the compressed part, its indices c0 .. c1 - 1, and a function that writes the block's
        sinks and recent tokens; keeps the exact candidates of the block's queries (step 4)."""
        S, W = self.sinks, self.window
        n = keys.shape[2]
        T1 = T0 + n
        u0, u1 = max(T0 - S, 0), max(T1 - S, 0)
        c0, c1 = max(u0 - W, 0), max(u1 - W, 0)
        skip = min(max(S - T0, 0), n)  # the block's sink tokens
        after_k, after_v = keys[:, :, skip:], values[:, :, skip:]  # tokens S + u0 .. S + u1 - 1
        dev = keys.device
        ring_rows = torch.arange(c0, u0, device=dev) % max(W, 1)  # recent before the block: tokens S + c0 .. S + u0 - 1
        old_k, old_v = self.ring_keys.index_select(2, ring_rows), self.ring_values.index_select(2, ring_rows)
        moving = slice(max(c0, u0) - u0, max(c1 - u0, 0))
        out_k = torch.cat([old_k[:, :, : max(min(c1, u0) - c0, 0)], after_k[:, :, moving]], dim=2)
        out_v = torch.cat([old_v[:, :, : max(min(c1, u0) - c0, 0)], after_v[:, :, moving]], dim=2)
        held_sinks = min(T1, S)
        sink_k = torch.cat([self.sink_keys[:, :, : min(T0, S)], keys[:, :, :skip]], dim=2)
        sink_v = torch.cat([self.sink_values[:, :, : min(T0, S)], values[:, :, :skip]], dim=2)
        self.candidates = (torch.cat([sink_k, old_k, after_k], dim=2), torch.cat([sink_v, old_v, after_v], dim=2),
                      torch.cat([torch.arange(held_sinks, device=dev), S + torch.arange(c0, u1, device=dev)]))

        def store():
            if skip:
                self.sink_keys[:, :, T0 : T0 + skip] = keys[:, :, :skip]
                self.sink_values[:, :, T0 : T0 + skip] = values[:, :, :skip]
            if W:
                first = max(u1 - W, u0)
                rows = torch.arange(first, u1, device=dev)
                self.ring_keys.index_copy_(2, rows % W, after_k[:, :, first - u0 :])
                self.ring_values.index_copy_(2, rows % W, after_v[:, :, first - u0 :])

        return out_k, out_v, c0, c1, store

    def advance(self, T: torch.Tensor) -> None:
        """The compressed count after T tokens, on the device."""
        self.compressed.copy_((T - self.sinks - self.window).clamp(min=0))

    # ------------------------------------------------------------------ attention (M11.14 steps 3-5)
    def visible(self, T: torch.Tensor, n: int, eager_T: int | None):
        """The exact keys, values (N, H, E, ·), which each of the last n queries sees (n, E) and
        the positions of the E slots: one query (a decode step), the sinks and the ring's filled
        slots; a block (eager, T its host count), the candidates :meth:`block` kept (then
        dropped), query p seeing position t iff t <= p and t is a sink or t >= S + T_c(p + 1)."""
        S, W = self.sinks, self.window
        if n == 1:
            keys, values = self.keys, self.values
            after = (T - S).clamp(min=0)
            ring = self.slots - S  # slot j holds the last u = j (mod W) below T - S, position S + u
            positions = torch.where(self.slots < S, self.slots, S + ring + W * ((after - 1 - ring).clamp(min=0) // max(W, 1)))
            filled = torch.where(self.slots < S, self.slots < T, ring < after.clamp(max=W))
            return keys, values, filled[None, :], positions
        keys, values, positions = self.candidates
        self.candidates = None  # a prompt-sized copy: not kept past its forward
        p = torch.arange(eager_T - n, eager_T, device=keys.device)[:, None]
        first_recent = S + (p + 1 - S - W).clamp(min=0)
        return keys, values, (positions[None, :] <= p) & ((positions[None, :] < S) | (positions[None, :] >= first_recent)), positions

    def query_counts(self, T: int, n: int, device) -> torch.Tensor:
        """T_c(p + 1) for the last n queries p = T - n .. T - 1 (eager): the compressed tokens each sees."""
        return (torch.arange(T - n + 1, T + 1, device=device) - self.sinks - self.window).clamp(min=0)

    def reorder(self, idx: torch.Tensor) -> None:
        for t in self.held():
            t.copy_(t.index_select(0, idx))

    def reset(self) -> None:
        for t in self.held():
            t.zero_()
        self.compressed.zero_()
        self.candidates = None


def exact_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scaling: float, compute_dtype):
    """Spec W3's exact chunk for queries (N, H_q, n, d) over keys, values (N, H, E, ·) under
    ``visible`` (n, E, or per sequence (N or 1, 1, n, E)): the output (N, n, H_q, d_v) and the
    log-sum-exp (N, H_q, n), both in ``compute_dtype`` (-inf and zeros where a query sees no
    exact token)."""
    N, Hq, n, d = query.shape
    H = keys.shape[1]
    q = query.to(compute_dtype).view(N, H, Hq // H, n, d)
    logits = torch.einsum("bhgnd,bhed->bhgne", q, keys.to(compute_dtype)) * scaling
    return softmax_sum(logits, visible, values.to(compute_dtype))


def softmax_sum(logits: torch.Tensor, visible: torch.Tensor, values: torch.Tensor):
    """The weighted sum of ``values`` (N, H, E, v) under softmax(``logits`` (N, H, g, n, E)) over
    the ``visible`` (n, E), or per sequence (N or 1, 1, n, E), slots, and the log-sum-exp:
    (N, n, H g, v), (N, H g, n); zeros and -inf for a query that sees nothing."""
    N, H, g, n, _ = logits.shape
    if visible.dim() == 4:  # per sequence: the heads' axes
        visible = visible[:, :, None]
    logits = logits.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    weights = torch.where(torch.isfinite(lse)[..., None], torch.exp(logits - lse[..., None]), torch.zeros_like(logits))
    out = torch.einsum("bhgne,bhev->bhgnv", weights, values)
    return out.reshape(N, H * g, n, -1).transpose(1, 2), lse.reshape(N, H * g, n)


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Spec A3.2 over whole parts: outputs (N, n, H_q, d_v), each normalised, and their log-sum-
    exps (N, H_q, n) -> the output over all their tokens (a part of -inf carries no weight; a
    query with no token in any part gets zeros, so a padding row passes no NaN to later layers)."""
    lse = torch.stack([p[1] for p in parts])
    top = lse.max(dim=0).values
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lse - top)  # (P, N, H_q, n)
    total = weights.sum(dim=0)
    # a part over no token (lse -inf) may hold NaN (the kernel's 0/0): weight 0 and no NaN
    out = sum(torch.where(torch.isfinite(p[1]).transpose(1, 2)[..., None], p[0], 0.0) * w.transpose(1, 2)[..., None] for p, w in zip(parts, weights))
    total = total.transpose(1, 2)[..., None]
    return torch.where(total > 0, out / total, 0.0)  # a query that sees nothing (a padding row): zeros, not NaN


__all__ = ["ExactParts", "compressed_count", "exact_attention", "merge", "softmax_sum"]
