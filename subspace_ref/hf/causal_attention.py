"""The causal evaluator: coefficient-space attention of a block of queries (a prefill, teacher
forcing) over a state, each query seeing the state as it was right after its own token's append
(spec/models.md "Prefill"). The decode step (one query) does not come here: it is one
``subspace_ref.attend`` call."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from subspace_ref.arrays import array_family
from subspace_ref.hf.attention import allowed_positions

#: Query tiles of the causal evaluator hold about this many logits.
TILE_ELEMENTS = 1 << 22


def prefix_view(state, length: int):
    """The state as it was after its first ``length`` tokens were appended, for static and
    adaptive states (a view sharing the arrays). Exact because stored coefficients never change
    after their append, chunk bases are frozen when their chunk opens, and warm-up rows added to
    chunk 0 after token ``t`` meet zero coefficients of tokens ``<= t`` (spec A7 step 0).
    Rotating states rewrite past coefficients at each refresh: a prefix view is the state at
    step ``length - 1`` only when no refresh happened after it (the caller's duty).

    Parameters
    ----------
    state : SubspaceState
        A static or adaptive state (rotating: see above).
    length : int
        Tokens of the view, 1 .. ``state.num_tokens``.

    Returns
    -------
    SubspaceState
        A view sharing the arrays; do not append to it.

    Raises
    ------
    ValueError
        If ``length`` is out of range.

    Examples
    --------
    :func:`causal_attention`'s example compares it with ``attend`` over a prefix view.
    """
    from subspace_ref.state import SubspaceState

    lay = state.layout
    if not 0 < length <= lay.num_tokens:
        raise ValueError(f"length must lie in [1, {lay.num_tokens}], got {length}")
    num_chunks = lay.num_chunks
    if state.kind == "adaptive":
        # chunk j exists at step length-1 iff it started at or before token `length` (a trigger
        # at token t opens chunk j+1 at t+1 during t's append)
        starts = lay.chunk_starts
        if array_family(starts) == "torch":
            valid = torch.arange(starts.shape[-1], device=starts.device) < num_chunks[..., None]
            num_chunks = ((starts <= length) & valid).sum(-1)
        else:
            valid = np.arange(starts.shape[-1]) < np.asarray(num_chunks)[..., None]
            num_chunks = ((starts <= length) & valid).sum(-1).astype(np.int64)
    view = replace(lay, num_tokens=length, num_chunks=num_chunks)
    return SubspaceState(state.policy, view, state.sketches, state.batched, state.engine)


def _torch(x, device) -> torch.Tensor:
    return x.to(device) if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x)).to(device)


def _coefficients(lay, which: str, T: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Rows [0, T) of one side's coefficients (N, H, T, r) as torch ``dtype``, dequantised by
    spec A10's definition when the layout is int8 (the same function the backends use)."""
    fmt = lay.side_format(which)
    if fmt.low_bits:  # int4/int2 (spec/quantization.md Q2)
        from subspace_ref.quantization import read_low_bit

        return _torch(read_low_bit(lay, which, 0, T, lay.dtype, lay.num_tokens), device).to(dtype)  # Q1: read once into the state's dtype
    coef = getattr(lay, f"{which}_coef")[:, :, :T]
    if fmt.per_token_scale:
        from subspace_ref.quantization import dequantize_rows

        coef = dequantize_rows(coef, getattr(lay, f"{which}_scale")[:, :, :T], np.float32 if array_family(coef) != "torch" else torch.float32)
    return _torch(coef, device).to(dtype)


@dataclass(frozen=True)
class ExactPart:
    """The exact tokens the queries of a block at positions ``first_position ..`` of a windowed
    state may see (spec/window.md W1, W7): ``keys`` (N, H, e, d), ``values`` (N, H, e, d_v) at
    ``positions`` (e,): the sinks and the recent window as they were before the block was
    appended, then the block itself. Tokens the block's append moved into the compressed part
    are here too: a query before their eviction sees them exactly (W2, per query)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor


def exact_part(state, keys: torch.Tensor, values: torch.Tensor) -> ExactPart | None:
    """The :class:`ExactPart` of ``state`` (before appending the block ``keys`` (N, H, n, d),
    ``values``) and the block; None for a state without exact tokens."""
    win = state.window
    if win is None:
        return None
    device, T0, n = keys.device, state.num_tokens, keys.shape[2]
    held_k = [_torch(x, device) for x in (win.sink_keys, win.keys) if x is not None]
    held_v = [_torch(x, device) for x in (win.sink_values, win.values) if x is not None]
    # the block rounded to the state's dtype, as the window will hold it (spec/window.md W2 step 4)
    keys, values = keys.to(held_k[-1].dtype), values.to(held_v[-1].dtype)
    s, e = win.sink_count, win.recent
    positions = torch.cat([torch.arange(s), torch.arange(T0 - e, T0 + n)]).to(device)
    return ExactPart(torch.cat(held_k + [keys], dim=2), torch.cat(held_v + [values], dim=2), positions)


def compressed_visible(state, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For a state grown to each of ``lengths`` tokens: (compressed tokens, sink tokens) then
    (spec/window.md W1, W7; a state without a window compresses every token, has no sinks)."""
    from subspace_ref.window import after_sinks_threshold, compressed_count

    lengths = np.asarray(lengths, dtype=np.int64)
    win = state.window
    if win is None:
        return lengths, np.zeros_like(lengths)
    sinks = np.minimum(lengths, win.sinks)
    threshold = after_sinks_threshold(win.min_tokens, win.sinks)
    return np.array([compressed_count(int(t), win.size, threshold) for t in lengths - sinks], dtype=np.int64), sinks


def causal_attention(
    q: torch.Tensor,
    state,
    first_position: int,
    scale: float | None = None,
    *,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
    exact: ExactPart | None = None,
) -> torch.Tensor:
    """Coefficient-space attention of queries at positions ``first_position + i`` (q: (N, H_q, n, d),
    any torch dtype/device) over ``state``'s tokens ``0 .. first_position + n - 1``, query ``i``
    attending tokens ``t <= first_position + i`` only (causal mask on the coefficient logits).

    For static and adaptive states this is, per query, exactly ``subspace_ref.attend`` over
    :func:`prefix_view` ``(state, first_position + i + 1)``: logits
    ``gamma_h * scale * (B_{j(t)} q) . c_t``, softmax over the allowed tokens with the global
    maximum (spec A3.1), output ``sum_j (w_j^T D_j) E_j / Z``. Nothing is reconstructed: bases
    act on the query and on the r_v-dimensional weighted sums only. Returns (N, H_q, n, d_v) in
    q's dtype; computed in float64 when q and the state are float64, else float32.

    ``mask`` (a transformers 4-d mask (N or 1, H_q or 1, n, first_position + n), boolean or
    additive): query ``i`` attends only the tokens it allows as well (left padding, sliding
    windows); a query allowed no token gets zeros. ``softcap``: logits ``l`` become
    ``softcap * tanh(l / softcap)`` before masking (Gemma2), as the model's eager attention does.

    Windowed states (spec/window.md; ``state`` already holds the block, ``exact`` is
    :func:`exact_part` taken before it was appended): query ``i`` at position ``p`` sees what
    the state held right after token ``p``'s append, the first ``T_c(p + 1)`` compressed tokens
    (coefficient logits as above) and every other token ``<= p`` exactly (logits ``scale q . k``,
    values ``v``, gamma = 1), all under one softmax (W3, W8). A token evicted within the block
    is exact for the queries before its eviction and compressed after it: its coefficients are
    the ones it got when it was evicted (W2.1; adaptive and static coefficients never change).

    Parameters
    ----------
    q : torch.Tensor
        (N, H_q, n, d) queries, H_q a multiple of the state's H.
    state : SubspaceState
        Holding at least ``first_position + n`` tokens.
    first_position : int
        Position of the first query.
    scale : float, optional
        Logit scale; default ``d ** -0.5``.
    mask : torch.Tensor, optional
        A transformers 4-d mask.
    softcap : float, optional
        Logit soft-capping.
    exact : ExactPart, optional
        Required for a windowed state, and only then.

    Returns
    -------
    torch.Tensor
        (N, H_q, n, d_v) in q's dtype.

    Raises
    ------
    ValueError
        If the state holds too few tokens, or ``exact`` is given for the wrong kind of state.

    Examples
    --------
    ::

        import numpy as np
        import torch
        import subspace_ref as sr
        from subspace_ref.hf import causal_attention, prefix_view

        rng = np.random.default_rng(0)
        K, V = rng.standard_normal((2, 1, 2, 12, 8))             # keys, values (N, H, T, d)
        state = sr.SubspaceState.static(sr.calibrate(K[0], V[0], rank_k=4, rank_v=4), batch=1, dtype=np.float64)
        state.append(K, V)
        q = torch.from_numpy(rng.standard_normal((1, 2, 4, 8)))  # 4 queries at positions 8..11
        out = causal_attention(q, state, first_position=8)       # (1, 2, 4, 8)
        np.allclose(out[:, :, 0].numpy(), sr.attend(q[:, :, 0].numpy(), prefix_view(state, 9)))  # True
    """
    lay = state.layout
    N, Hq, n, d = q.shape
    H = lay.key_coef.shape[1]
    g = Hq // H
    T_all = first_position + n
    if T_all > state.num_tokens or first_position < 0:
        raise ValueError(f"queries at positions {first_position}..{T_all - 1} need {T_all} tokens, the state holds {state.num_tokens}")
    if (state.window is None) != (exact is None):
        raise ValueError("exact: give exact_part(state, ...) for a state with a window or sinks, and only then")
    visible, sinks = compressed_visible(state, np.arange(first_position + 1, T_all + 1))
    T = int(visible[-1])  # compressed tokens any query sees
    device = q.device
    visible_t = torch.from_numpy(visible).to(device)
    sinks_t = torch.from_numpy(sinks).to(device)
    offset = 0 if state.window is None else state.window.sinks  # mask column of compressed token 0 (W7)
    state_dtype = str(lay.dtype).removeprefix("torch.")
    work = torch.float64 if q.dtype == torch.float64 and state_dtype == "float64" else torch.float32
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)

    C = _coefficients(lay, "key", T, work, device)  # (N, H, T, r)
    D = _coefficients(lay, "value", T, work, device)  # (N, H, T, r_v)
    num_chunks = _torch(lay.num_chunks, device)
    J = int(num_chunks.max()) if state.kind == "adaptive" else 1
    chunks = (slice(None), slice(None), slice(0, J))  # bases decoded as stored (spec/storage.md S2)
    B = _torch(lay.basis("key", chunks, lay.dtype), device).to(work)  # (N, H, J, r, d)
    E = _torch(lay.basis("value", chunks, lay.dtype), device).to(work)  # (N, H, J, r_v, d_v)
    gamma = _torch(lay.gamma, device).to(torch.float64).mul(s).to(work)  # (H,)
    # many short chunks (an adaptive state that opens one on most tokens): projecting every query
    # on every chunk costs J r d per query, rebuilding each token's key and value once r d per
    # token; rebuild when the first is larger (J r > T), transiently, as a prefill's keys are
    rebuild = J > 1 and J * B.shape[3] > T
    if J > 1:
        valid = torch.arange(J, device=device) < num_chunks[..., None]  # (N, H, J)
        # spare chunk slots hold undefined data: never multiply them, not even by zero
        E = torch.where(valid[..., None, None], E, torch.zeros((), dtype=work, device=device))
        starts = _torch(lay.chunk_starts[:, :, :J], device)
        tokens = torch.arange(T, device=device)
        last = torch.where(valid, starts, torch.full((), T + 1, dtype=starts.dtype, device=device)).contiguous()  # ascending per (n, h)
        index = torch.searchsorted(last, tokens.expand(N, H, T).contiguous().to(last.dtype), right=True) - 1  # (N, H, T): chunk of each token
        # token range [lo_j, hi_j) covering chunk j of every (sequence, head): work per chunk is
        # confined to it, so the total is about one pass over the tokens, not J passes
        host_starts = starts.cpu().numpy()
        host_valid = valid.cpu().numpy()
        spans = []
        for j in range(0 if rebuild else J):
            if not host_valid[..., j].any():
                spans.append((0, 0))
                continue
            lo = int(host_starts[..., j][host_valid[..., j]].min())
            nxt = np.where(host_valid[..., j + 1], host_starts[..., j + 1], T) if j + 1 < J else np.full(host_valid.shape[:2], T)
            hi = int(np.minimum(nxt[host_valid[..., j]], T).max())
            spans.append((min(lo, T), hi))

    rope = getattr(state.policy, "rope", None)
    K_full = V_full = None  # rebuilt keys (N, H, T, d) and values (N, H, T, d_v), when used
    if rope is not None:  # spec/rope.md P3: pre-RoPE keys rebuilt and rotated, (N, H, T, d)
        from subspace_ref.rope import rotate
        from subspace_ref.window import first_compressed_position

        first = first_compressed_position(state)  # spec/window.md W10
        K_full = rotate(torch.matmul(C, B[:, :, 0]), np.arange(first, first + T), rope)
    elif rebuild:
        K_full, V_full = _rebuilt(C, B, index), _rebuilt(D, E, index)
    out = torch.empty((N, H, g, n, E.shape[-1]), dtype=work, device=device)
    # a tile's logits (N, H_q, m, T) and projected queries (N, H_q, J, m, r) stay near TILE_ELEMENTS
    if exact is not None:
        K_exact = exact.keys.to(device=device, dtype=work).reshape(N, H, 1, -1, d)
        V_exact = exact.values.to(device=device, dtype=work)
        pos = exact.positions.to(device)
    width = T + (0 if exact is None else pos.shape[0])
    tile = max(1, TILE_ELEMENTS // max(1, N * Hq * max(width, 0 if K_full is not None else J * B.shape[3])))
    keys_pos = torch.arange(T, device=device)
    for a in range(0, n, tile):
        b = min(n, a + tile)
        qt = q[:, :, a:b].reshape(N, H, g, b - a, d).to(work)
        if K_full is not None:
            logits = torch.matmul(qt * gamma[None, :, None, None, None], K_full.mT[:, :, None])
        elif J == 1:
            qp = torch.matmul(qt, B[:, :, 0].mT[:, :, None]) * gamma[None, :, None, None, None]  # gamma_h * scale * B q: (N, H, g, m, r)
            logits = torch.matmul(qp, C.mT[:, :, None])  # (N, H, g, m, T)
        else:
            # gamma_h * scale * B_j q for every chunk: (N, H, J, g, m, r)
            qp = torch.matmul(qt[:, :, None], B.mT[:, :, :, None]) * gamma[None, :, None, None, None, None]
            logits = torch.full((N, H, g, b - a, T), -math.inf, dtype=work, device=device)
            for j, (lo, hi) in enumerate(spans):
                if lo >= hi:
                    continue
                sel = (index[:, :, lo:hi] == j)[:, :, None, None, :]
                part = torch.matmul(qp[:, :, j], C[:, :, lo:hi].mT[:, :, None])
                logits[..., lo:hi] = torch.where(sel, part, logits[..., lo:hi])
        allowed = keys_pos[None, :] < visible_t[a:b, None]  # (m, T): the compressed tokens of each query's step
        columns = keys_pos + offset
        if exact is not None:
            p = (first_position + torch.arange(a, b, device=device))[:, None]
            s_p, c_p = sinks_t[a:b, None], visible_t[a:b, None]
            # exact for query p: a sink, or a token <= p not yet compressed at p's step (W1, W7)
            allowed = torch.cat([allowed, (pos[None] <= p) & ((pos[None] < s_p) | (pos[None] >= s_p + c_p))], dim=-1)
            columns = torch.cat([columns, pos])
            exact_logits = torch.matmul(qt * s, K_exact.mT)  # (N, H, g, m, e), gamma = 1 (W3)
            logits = torch.cat([logits, exact_logits], dim=-1)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        if mask is not None:
            rows = allowed_positions(mask[:, :, a:b][..., columns]).to(device)
            rows = rows[:, :, None] if rows.shape[1] == 1 else rows.reshape(rows.shape[0], H, g, b - a, -1)
            allowed = allowed & rows
        logits = logits.masked_fill(~allowed, -math.inf)
        top = logits.amax(-1, keepdim=True)
        w = torch.exp(logits - torch.where(torch.isfinite(top), top, torch.zeros((), dtype=work, device=device)))
        Z = w.sum(-1, keepdim=True)
        Z = torch.where(Z > 0, Z, torch.ones((), dtype=work, device=device))  # a fully masked query (padding) gets zeros
        if exact is not None:
            w, w_exact = w[..., :T], w[..., T:]
        if V_full is not None:
            acc = torch.matmul(w, V_full[:, :, None])
        elif J == 1:
            acc = torch.matmul(torch.matmul(w, D[:, :, None]), E[:, :, 0][:, :, None])
        else:
            acc = torch.zeros((N, H, g, b - a, E.shape[-1]), dtype=work, device=device)
            for j, (lo, hi) in enumerate(spans):
                if lo >= hi:
                    continue
                wj = torch.where((index[:, :, lo:hi] == j)[:, :, None, None, :], w[..., lo:hi], torch.zeros((), dtype=work, device=device))
                acc = acc + torch.matmul(torch.matmul(wj, D[:, :, None, lo:hi]), E[:, :, j][:, :, None])
        if exact is not None:
            acc = acc + torch.matmul(w_exact, V_exact[:, :, None])
        out[:, :, :, a:b] = acc / Z
    return out.reshape(N, Hq, n, -1).to(q.dtype)


def _rebuilt(coef: torch.Tensor, bases: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Each token's vector from its coefficients and its chunk's basis: coef (N, H, T, r),
    bases (N, H, J, r, d), index (N, H, T) -> (N, H, T, d), in token tiles of about
    TILE_ELEMENTS gathered basis entries."""
    N, H, T, r = coef.shape
    out = torch.empty((N, H, T, bases.shape[-1]), dtype=coef.dtype, device=coef.device)
    n_idx = torch.arange(N, device=coef.device)[:, None, None]
    h_idx = torch.arange(H, device=coef.device)[None, :, None]
    step = max(1, TILE_ELEMENTS // max(1, N * H * r * bases.shape[-1]))
    for a in range(0, T, step):
        b = min(T, a + step)
        out[:, :, a:b] = torch.matmul(coef[:, :, a:b, None, :], bases[n_idx, h_idx, index[:, :, a:b]])[..., 0, :]
    return out


__all__ = ["ExactPart", "causal_attention", "compressed_visible", "exact_part", "prefix_view"]
