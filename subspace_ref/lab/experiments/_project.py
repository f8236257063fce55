"""Exact attention over projected keys and values, for models or bases the cache cannot serve.

A transformers attention function (registered under :data:`ATTN_NAME`) that, for layers with a
projector installed, replaces each KV head's keys by ``γ K P_B`` and values by ``V P_E`` and then
runs transformers' own sdpa attention. With a post-RoPE basis this is exactly what a static
``SubspaceCache`` computes (coefficient-space attention equals attention over the projected
keys and values, spec A2), which the runner checks; it serves two cases the cache does not:

* encoders (MiniLM): no cache at all, every token attends every token;
* pre-RoPE bases (seed 003 "RoPE ablations: bases computed pre- vs post-RoPE", seed 001 §7
  "rotation-aware basis"): the key is rotated back, projected on a basis calibrated on
  un-rotated keys, and rotated again: ``k̂_t = R_t P_B R_tᵀ k_t``. A cache would store the same r
  coefficients ``B R_tᵀ k_t`` per token (same memory as a static state), but the logit needs the
  query rotated to every token's position, ``(B R_tᵀ q)·c_t``, so attention no longer costs O(r)
  per token: this ablation measures quality only.

Observers (``OBSERVERS``) see ``(layer, q, k, v, out)`` after each call (MiniLM's capture).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np

ATTN_NAME = "subspace_ref_project"
#: layer -> (PK (H, d, d) or None, gamma (H,), PE (H, d_v, d_v) or None, pre_rope: bool)
PROJECTORS: dict[int, tuple] = {}
OBSERVERS: list = []
_ROTARY: dict[str, Any] = {}


def _rotate_half(x):
    import torch

    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _rope(x, cos, sin, inverse: bool):
    """Llama's rotate-half RoPE on the first cos.shape[-1] dimensions of x (B, H, n, d), or its
    inverse (divided by c² + s², as capture does: the model's cos/sin are float32)."""
    import torch

    r = cos.shape[-1]
    c, s = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    rot, rest = x[..., :r], x[..., r:]
    if inverse:
        rot = (rot * c - _rotate_half(rot) * s) / (c * c + s * s)
    else:
        rot = rot * c + _rotate_half(rot) * s
    return torch.cat((rot, rest), dim=-1)


def project_attention(module, query, key, value, attention_mask, **kwargs):
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    proj = PROJECTORS.get(module.layer_idx)
    if proj is not None:
        PK, g, PE, pre = proj
        if PK is not None:
            if pre:
                cos, sin = _ROTARY["cos"], _ROTARY["sin"]
                key = _rope(torch.einsum("bhnd,hde->bhne", _rope(key, cos, sin, inverse=True), PK.to(key.dtype)), cos, sin, inverse=False)
            else:
                key = torch.einsum("bhnd,hde->bhne", key, PK.to(key.dtype))
            key = key * g.to(key.dtype)[None, :, None, None]
        if PE is not None:
            value = torch.einsum("bhnd,hde->bhne", value, PE.to(value.dtype))
    out, w = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    for obs in OBSERVERS:
        obs(module.layer_idx, query, key, value, out)
    return out, w


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, project_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def set_projectors(bases: list | None, side: str = "both", pre_rope: bool = False) -> None:
    """Per-layer projectors from :class:`~subspace_ref.StaticBasis` objects (None: exact)."""
    import torch

    PROJECTORS.clear()
    if bases is None:
        return
    for li, b in enumerate(bases):
        keys, values = side in ("both", "keys"), side in ("both", "values")
        PK = torch.from_numpy(np.einsum("hrd,hre->hde", b.B, b.B)) if keys else None
        PE = torch.from_numpy(np.einsum("hrd,hre->hde", b.E, b.E)) if values else None
        g = torch.from_numpy(np.asarray(b.gamma, dtype=np.float64)) if keys else torch.ones(b.B.shape[0], dtype=torch.float64)
        PROJECTORS[li] = (PK, g, PE, pre_rope)


@contextlib.contextmanager
def projected(model, bases: list | None = None, side: str = "both", pre_rope: bool = False) -> Iterator[None]:
    """Run ``model`` with :func:`project_attention` and these projectors; restores the model's
    attention implementation and removes the rotary hook afterwards."""
    register()
    previous = model.config._attn_implementation
    hooks = []
    if pre_rope:
        mods = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
        if len(mods) != 1:
            raise ValueError(f"pre-RoPE projection needs exactly one rotary module, found {len(mods)}")
        hooks.append(mods[0].register_forward_hook(lambda _m, _i, out: _ROTARY.update(cos=out[0], sin=out[1])))
    model.set_attn_implementation(ATTN_NAME)
    set_projectors(bases, side, pre_rope)
    try:
        yield
    finally:
        set_projectors(None)
        for h in hooks:
            h.remove()
        _ROTARY.clear()
        model.set_attn_implementation(previous)
