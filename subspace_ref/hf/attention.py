"""The attention function a transformers model calls when its cache is a :class:`SubspaceCache`.

Routing (spec/models.md "Routing"). transformers 5.x attention modules do, per layer::

    key_states, value_states = past_key_values.update(key_states, value_states, layer_idx)
    attn_output, _ = ALL_ATTENTION_FUNCTIONS[config._attn_implementation](
        module, query_states, key_states, value_states, attention_mask, scaling=..., dropout=..., **kwargs)

:func:`register` adds :func:`subspace_attention` under the name :data:`ATTN_IMPLEMENTATION`
(and the sdpa mask builder under the same name); :func:`use_subspace_attention` selects it for
one model (``model.set_attn_implementation``). Nothing in transformers is patched.

A :class:`~subspace_ref.hf.cache.SubspaceLayer`'s ``update`` keeps the new post-RoPE keys and
values as *pending* and returns them tagged with the layer. :func:`subspace_attention` sees the
tag, appends the pending tokens to the layer's :class:`~subspace_ref.SubspaceState` and computes
attention in coefficient space:

* one query per sequence (decode): ``subspace_ref.attend(q, state, backend=...)``, the library
  call, on any registered backend;
* several queries (prefill, teacher forcing): each query position ``p`` attends the tokens
  ``<= p`` of the state *as it was after appending token p* -- :func:`causal_attention`
  (coefficient space, causal mask over the coefficient logits; exact for static and adaptive
  states, whose stored coefficients never change), with rotating states cut at refresh
  boundaries by the layer (see :meth:`SubspaceLayer.attend_pending`). ``prefill="attend"``
  instead calls ``subspace_ref.attend`` once per position over :func:`prefix_view`.

Untagged keys (a model using this implementation with a ``DynamicCache`` or no cache) go to
transformers' own sdpa function unchanged, so the model behaves exactly as with "sdpa".
Observers (:func:`observe`, used by :mod:`subspace_ref.hf.capture`) see every call's post-RoPE
query, key and value.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import replace
from typing import Any, Callable, Iterator

import numpy as np
import torch

from subspace_ref.arrays import array_family

#: The name under which :func:`subspace_attention` is registered in transformers.
ATTN_IMPLEMENTATION = "subspace_ref"

#: Layers whose update returned tagged keys not yet consumed by the attention function.
_PENDING: "weakref.WeakSet[Any]" = weakref.WeakSet()
_OBSERVERS: list[Callable[..., None]] = []
#: Attribute set on the key tensor returned by ``SubspaceLayer.update``.
TAG = "_subspace_ref_layer"
#: Query tiles of the causal evaluator hold about this many logits.
TILE_ELEMENTS = 1 << 22


# ----------------------------------------------------------------------------- registration
def register() -> None:
    """Register :func:`subspace_attention` and the sdpa mask builder as :data:`ATTN_IMPLEMENTATION`
    (idempotent). Registering only adds a name; no model uses it until selected."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, subspace_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def use_subspace_attention(model) -> str:
    """Select :data:`ATTN_IMPLEMENTATION` for ``model`` (registering it first); returns the
    implementation it replaced. Without a :class:`SubspaceCache` the model then computes exactly
    what "sdpa" computes."""
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return previous


@contextlib.contextmanager
def subspace_attention_enabled(model) -> Iterator[None]:
    """Context manager: :func:`use_subspace_attention` on entry, the previous implementation on exit."""
    previous = use_subspace_attention(model)
    try:
        yield
    finally:
        if previous != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(previous)


@contextlib.contextmanager
def observe(fn: Callable[..., None]) -> Iterator[None]:
    """Call ``fn(module, query, key, value)`` on every call of :func:`subspace_attention` while the
    context is open. ``query`` (B, H_q, n, d) and ``key``/``value`` (B, H, n, d) are post-RoPE:
    the tensors the cache's ``update`` received (or, without a cache, would have received)."""
    _OBSERVERS.append(fn)
    try:
        yield
    finally:
        _OBSERVERS.remove(fn)


# ----------------------------------------------------------------------------- the function
def subspace_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function registered as :data:`ATTN_IMPLEMENTATION` (transformers' signature).

    Returns ``(attn_output (B, n, H_q, d_v), None)``.
    """
    for fn in list(_OBSERVERS):
        fn(module, query, key, value)
    layer = getattr(key, TAG, None)
    if layer is None or layer.pending_keys is not key:
        idx = getattr(module, "layer_idx", None)
        if any(p.layer_idx == idx for p in list(_PENDING)):
            raise RuntimeError(
                f"layer {idx}: the keys returned by SubspaceCache.update did not reach the attention function "
                "unchanged; this model family is not supported by the subspace cache (see spec/models.md)"
            )
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    try:
        if dropout and module.training:
            raise NotImplementedError("attention dropout in training mode is not supported by the subspace cache; call model.eval()")
        for name in ("sliding_window", "softcap", "s_aux"):
            if kwargs.get(name) is not None:
                raise NotImplementedError(f"{name} is not supported by the subspace cache (layer {layer.layer_idx})")
        check_causal_mask(attention_mask, query.shape[2], layer.get_seq_length())
        if query.shape[1] % layer.state.heads:
            raise ValueError(f"{query.shape[1]} query heads for {layer.state.heads} KV heads")
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        out = layer.attend_pending(query, float(scaling))  # (B, H_q, n, d_v)
    except BaseException:
        # the forward is abandoned; earlier layers may already hold the tokens, so the cache is
        # left inconsistent (build a new one), but no stale pending keys survive
        layer._clear_pending()
        raise
    return out.transpose(1, 2).contiguous(), None


def check_causal_mask(mask, query_length: int, kv_length: int) -> None:
    """NotImplementedError unless ``mask`` is None or the plain causal mask of ``query_length``
    queries ending a ``kv_length``-token sequence (True/0 = attend). Padding is not supported:
    the compressed cache has no per-token mask."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.ndim != 4:
        raise NotImplementedError(f"the subspace cache supports only causal masks, got {type(mask).__name__}")
    if mask.shape[-1] != kv_length or mask.shape[-2] != query_length:
        raise NotImplementedError(f"mask of shape {tuple(mask.shape)} does not match {query_length} queries over {kv_length} tokens")
    past = kv_length - query_length
    causal = torch.arange(kv_length, device=mask.device)[None, :] <= (past + torch.arange(query_length, device=mask.device))[:, None]
    allowed = mask if mask.dtype == torch.bool else mask == 0
    if not torch.equal(allowed, causal.expand_as(allowed)):
        raise NotImplementedError(
            "the subspace cache supports only plain causal attention (no padding or custom masks); "
            "run sequences of equal length without padding"
        )


# ----------------------------------------------------------------------------- evaluators
def prefix_view(state, length: int):
    """The state as it was after its first ``length`` tokens were appended, for static and
    adaptive states (a view sharing the arrays). Exact because stored coefficients never change
    after their append, chunk bases are frozen when their chunk opens, and warm-up rows added to
    chunk 0 after token ``t`` meet zero coefficients of tokens ``<= t`` (spec A7 step 0).
    Rotating states rewrite past coefficients at each refresh: a prefix view is the state at
    step ``length - 1`` only when no refresh happened after it (the caller's duty)."""
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
    if lay.low_bits:  # int4/int2 (spec/quantization.md Q2)
        from subspace_ref.quantization import read_low_bit

        return _torch(read_low_bit(lay, which, 0, T, np.float32 if array_family(lay.key_coef) != "torch" else torch.float32, lay.num_tokens), device).to(dtype)
    coef = getattr(lay, f"{which}_coef")[:, :, :T]
    if lay.quantized:
        from subspace_ref.quantization import dequantize_rows

        coef = dequantize_rows(coef, getattr(lay, f"{which}_scale")[:, :, :T], np.float32 if array_family(coef) != "torch" else torch.float32)
    return _torch(coef, device).to(dtype)


def causal_attention(q: torch.Tensor, state, first_position: int, scale: float | None = None) -> torch.Tensor:
    """Coefficient-space attention of queries at positions ``first_position + i`` (q: (N, H_q, n, d),
    any torch dtype/device) over ``state``'s tokens ``0 .. first_position + n - 1``, query ``i``
    attending tokens ``t <= first_position + i`` only (causal mask on the coefficient logits).

    For static and adaptive states this is, per query, exactly ``subspace_ref.attend`` over
    :func:`prefix_view` ``(state, first_position + i + 1)``: logits
    ``gamma_h * scale * (B_{j(t)} q) . c_t``, softmax over the allowed tokens with the global
    maximum (spec A3.1), output ``sum_j (w_j^T D_j) E_j / Z``. Nothing is reconstructed: bases
    act on the query and on the r_v-dimensional weighted sums only. Returns (N, H_q, n, d_v) in
    q's dtype; computed in float64 when q and the state are float64, else float32.
    """
    lay = state.layout
    N, Hq, n, d = q.shape
    H = lay.key_coef.shape[1]
    g = Hq // H
    T = first_position + n
    if T > lay.num_tokens or first_position < 0:
        raise ValueError(f"queries at positions {first_position}..{T - 1} need {T} tokens, the state holds {lay.num_tokens}")
    device = q.device
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
    if J > 1:
        valid = torch.arange(J, device=device) < num_chunks[..., None]  # (N, H, J)
        # spare chunk slots hold undefined data: never multiply them, not even by zero
        E = torch.where(valid[..., None, None], E, torch.zeros((), dtype=work, device=device))
        starts = _torch(lay.chunk_starts[:, :, :J], device)
        tokens = torch.arange(T, device=device)
        index = ((starts[:, :, None, :] <= tokens[:, None]) & valid[:, :, None, :]).sum(-1) - 1  # (N, H, T)
        # token range [lo_j, hi_j) covering chunk j of every (sequence, head): work per chunk is
        # confined to it, so the total is about one pass over the tokens, not J passes
        host_starts = starts.cpu().numpy()
        host_valid = valid.cpu().numpy()
        spans = []
        for j in range(J):
            if not host_valid[..., j].any():
                spans.append((0, 0))
                continue
            lo = int(host_starts[..., j][host_valid[..., j]].min())
            nxt = np.where(host_valid[..., j + 1], host_starts[..., j + 1], T) if j + 1 < J else np.full(host_valid.shape[:2], T)
            hi = int(np.minimum(nxt[host_valid[..., j]], T).max())
            spans.append((min(lo, T), hi))

    rope = getattr(state.policy, "rope", None)
    if rope is not None:  # spec/rope.md P3: pre-RoPE keys rebuilt and rotated, (N, H, T, d)
        from subspace_ref.rope import rotate

        K_rot = rotate(torch.matmul(C, B[:, :, 0]), np.arange(T), rope)
    out = torch.empty((N, H, g, n, E.shape[-1]), dtype=work, device=device)
    # a tile's logits (N, H_q, m, T) and projected queries (N, H_q, J, m, r) stay near TILE_ELEMENTS
    tile = max(1, TILE_ELEMENTS // max(1, N * Hq * max(T, J * B.shape[3])))
    keys_pos = torch.arange(T, device=device)
    for a in range(0, n, tile):
        b = min(n, a + tile)
        qt = q[:, :, a:b].reshape(N, H, g, b - a, d).to(work)
        # gamma_h * scale * B_j q for every chunk: (N, H, J, g, m, r)
        qp = torch.matmul(qt[:, :, None], B.mT[:, :, :, None]) * gamma[None, :, None, None, None, None]
        if rope is not None:
            logits = torch.matmul(qt * gamma[None, :, None, None, None], K_rot.mT[:, :, None])
        elif J == 1:
            logits = torch.matmul(qp[:, :, 0], C.mT[:, :, None])  # (N, H, g, m, T)
        else:
            logits = torch.full((N, H, g, b - a, T), -math.inf, dtype=work, device=device)
            for j, (lo, hi) in enumerate(spans):
                if lo >= hi:
                    continue
                sel = (index[:, :, lo:hi] == j)[:, :, None, None, :]
                part = torch.matmul(qp[:, :, j], C[:, :, lo:hi].mT[:, :, None])
                logits[..., lo:hi] = torch.where(sel, part, logits[..., lo:hi])
        allowed = keys_pos[None, :] <= (first_position + torch.arange(a, b, device=device))[:, None]  # (m, T)
        logits = logits.masked_fill(~allowed, -math.inf)
        w = torch.exp(logits - logits.amax(-1, keepdim=True))
        Z = w.sum(-1, keepdim=True)
        if J == 1:
            acc = torch.matmul(torch.matmul(w, D[:, :, None]), E[:, :, 0][:, :, None])
        else:
            acc = torch.zeros((N, H, g, b - a, E.shape[-1]), dtype=work, device=device)
            for j, (lo, hi) in enumerate(spans):
                if lo >= hi:
                    continue
                wj = torch.where((index[:, :, lo:hi] == j)[:, :, None, None, :], w[..., lo:hi], torch.zeros((), dtype=work, device=device))
                acc = acc + torch.matmul(torch.matmul(wj, D[:, :, None, lo:hi]), E[:, :, j][:, :, None])
        out[:, :, :, a:b] = acc / Z
    return out.reshape(N, Hq, n, -1).to(q.dtype)


__all__ = [
    "ATTN_IMPLEMENTATION",
    "causal_attention",
    "check_causal_mask",
    "observe",
    "prefix_view",
    "register",
    "subspace_attention",
    "subspace_attention_enabled",
    "use_subspace_attention",
]
