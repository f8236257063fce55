"""The runtime every baseline shares: one transformers attention function that hands each layer's
query and *all* keys/values seen so far (a ``DynamicCache``) to the method's per-layer runtime.

Eviction is a permanent per-(sequence, KV head) mask over the ``DynamicCache``: a token masked
out at step ``p`` is never attended again, which is numerically the same as deleting it from the
cache (attention over a subset of the tokens); the bytes counted
(:mod:`subspace_ref.byte_convention`) are those an evicting cache would hold. Every method sees
query positions ``Tk-n .. Tk-1`` and computes each position exactly as token-by-token decoding
would, so one teacher-forced forward over a window equals decoding it (tests/test_baselines.py
checks it against ``n = 1`` steps).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

ATTN_NAME = "subspace_ref_baseline"
_ATTR = "_kv_baseline_runtime"


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, H, ...) -> (B, H*groups, ...): query head h_q uses KV head h_q // groups (transformers' convention)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def causal_keep(n: int, tk: int, device=None) -> torch.Tensor:
    """(n, tk) bool: query i (position tk-n+i) may see token t <= tk-n+i."""
    pos = torch.arange(tk - n, tk, device=device)[:, None]
    return torch.arange(tk, device=device)[None, :] <= pos


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, keep: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ s + log keep) v for q (B, Hq, n, d), k/v (B, H, Tk, ·), keep broadcastable to
    (B, H, n, Tk) (per KV head). Returns (B, Hq, n, d_v)."""
    g = q.shape[1] // k.shape[1]
    keep = keep.expand(k.shape[0], k.shape[1], q.shape[2], k.shape[2]) if keep.ndim == 4 else keep.expand(k.shape[0], k.shape[1], *keep.shape[-2:])
    return torch.nn.functional.scaled_dot_product_attention(
        q, repeat_kv(k, g), repeat_kv(v, g), attn_mask=repeat_kv(keep, g), scale=scaling
    )


def baseline_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: the module's baseline runtime, else stock sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rt = getattr(module, _ATTR, None)
    if rt is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if dropout and module.training:
        raise NotImplementedError("baselines run in eval mode only")
    # the causal mask is rebuilt by each method; padding is not supported (equal-length windows)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = rt.attend(query, key, value, scale)  # (B, Hq, n, d_v)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, baseline_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def attention_modules(model) -> list:
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")]
    if not mods:
        raise ValueError("no attention modules with layer_idx/k_proj found (Llama-style models only)")
    return mods


@contextlib.contextmanager
def applied(model, method) -> Iterator[None]:
    """Run ``model`` with ``method`` (anything with ``runtime(layer_idx)``) on every layer; the
    attention implementation is restored afterwards. Pad-free equal-length batches only."""
    register()
    previous = model.config._attn_implementation
    mods = attention_modules(model)
    for m in mods:
        setattr(m, _ATTR, method.runtime(m.layer_idx))
    model.set_attn_implementation(ATTN_NAME)
    try:
        yield
    finally:
        for m in mods:
            if hasattr(m, _ATTR):
                delattr(m, _ATTR)
        model.set_attn_implementation(previous)


@torch.no_grad()
def token_logprobs(model, ids: torch.Tensor, method=None, block_size: int | None = None) -> torch.Tensor:
    """log p(x_{t+1} | x_<=t) (B, T-1) float64 under ``method`` (None: stock), fed in blocks of
    ``block_size`` tokens (1: token-by-token decoding) with one ``DynamicCache``."""
    from transformers import DynamicCache

    from subspace_ref.hf_requirements import require_cache_api

    require_cache_api("token_logprobs")  # the model's cache= keyword
    model.eval()
    ctx = applied(model, method) if method is not None else contextlib.nullcontext()
    T = ids.shape[1]
    size = T if block_size is None else block_size
    out = []
    with ctx:
        cache = DynamicCache(config=model.config)
        for a in range(0, T, size):
            res = model(input_ids=ids[:, a : a + size], cache=cache, use_cache=True)
            cache = res.cache
            out.append(res.logits)
    logits = torch.cat(out, dim=1)
    logp = torch.log_softmax(logits[:, :-1].to(torch.float64), dim=-1)
    return logp.gather(-1, ids[:, 1:, None])[..., 0]
