"""Subspace configurations of issue 16 as baseline entries: per-head ranks and coefficient bits
(an :class:`~subspace_ref.allocation.Allocation`), post- or pre-RoPE key bases, an exact recent
window and attention sinks.

Evaluated as exact attention over what the state stores (spec/quantization.md Q2.1: the state's
attention is exact attention over its reconstruction): per (query position p, key t),

* t exact (a sink, t < S, or in the window, t > p − W): the cached k_t, v_t;
* otherwise k̂_t = Bᵀ ĉ_t (pre-RoPE bases: R_t Bᵀ ĉ_t, with c_t = B R_t⁻¹ k_t, spec/rope.md P2),
  ĉ_t the int8/int4/int2 reading of spec/quantization.md Q1 when key t's group of G tokens is
  complete at p, else the exact coefficients (KIVI's tail); v̂_t = Eᵀ d̂_t, values quantised per
  token. Bits 16 are fp16 coefficients (rounding not simulated, as budget.py says).

``tests/test_baselines.py`` checks one layer against :class:`subspace_ref.SubspaceState` (numpy
oracle, int4, pre-RoPE, window), so this evaluation is the state's attention, batched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from subspace_ref.allocation import Allocation
from subspace_ref.baselines._attention import causal_keep


@dataclass(frozen=True)
class Frontier:
    allocation: Allocation
    label: str
    family: str = "subspace (issue 16)"
    source: str = "this project (allocation.py; evaluated over the state's reconstruction, spec/quantization.md Q2.1)"

    @property
    def name(self) -> str:
        return self.label

    def bytes(self, geom):
        return self.allocation.bytes(geom)

    def with_bases(self, svd: list, svd_pre: list | None, rope) -> "_BoundFrontier":
        return _BoundFrontier(self.allocation, svd, svd_pre, rope)


class _BoundFrontier:
    def __init__(self, alloc: Allocation, svd: list, svd_pre: list | None, rope):
        self.alloc, self.svd, self.svd_pre, self.rope = alloc, svd, svd_pre, rope

    def runtime(self, layer_idx: int) -> "_FrontierRuntime":
        heads = self.alloc.heads[layer_idx]
        bases = []
        for h, c in enumerate(heads):
            src = self.svd_pre if c.key_basis == "pre_rope" else self.svd
            bases.append((torch.from_numpy(src[layer_idx]["Wk"][h, : c.rank_k].copy()).float(),
                          torch.from_numpy(self.svd[layer_idx]["Wv"][h, : c.rank_v].copy()).float()))
        return _FrontierRuntime(heads, bases, self.alloc.group, self.alloc.window, self.alloc.sinks, self.rope)


def _quantized_keys(c: torch.Tensor, bits: int, group: int, first: int = 0) -> torch.Tensor:
    """Coefficients (B, T, r) as read once their group is complete (the tail's rows are only
    read before that, so they are left as they are). The groups are those of the compressed
    stream, which starts at token ``first`` (after the sinks: spec/window.md W10); the rows
    before it are exact tokens, never read from here."""
    from subspace_ref.quantization import dequantize_groups, dequantize_rows, quantize_groups, quantize_rows

    if bits == 16 or c.shape[-1] == 0:
        return c
    if bits == 8:  # spec A10: per token, at once (no groups)
        q, s = quantize_rows(c)
        return dequantize_rows(q, s, c.dtype)
    B, T, r = c.shape
    done = max(0, T - first) // group * group
    out = c.clone()
    if done:
        q, s, z = quantize_groups(c[:, first : first + done].reshape(B, done // group, group, r), bits, -2)
        out[:, first : first + done] = dequantize_groups(q, s, z, -2, c.dtype).reshape(B, done, r)
    return out


def _quantized_values(d: torch.Tensor, bits: int) -> torch.Tensor:
    from subspace_ref.quantization import dequantize_groups, dequantize_rows, quantize_groups, quantize_rows

    if bits == 16 or d.shape[-1] == 0:
        return d
    if bits == 8:
        q, s = quantize_rows(d)
        return dequantize_rows(q, s, d.dtype)
    q, s, z = quantize_groups(d, bits, -1)
    return dequantize_groups(q, s, z, -1, d.dtype)


class _FrontierRuntime:
    def __init__(self, heads, bases, group, window, sinks, rope):
        self.heads, self.bases, self.group, self.window, self.sinks, self.rope = heads, bases, group, window, sinks, rope

    def attend(self, q, k, v, scaling):
        from subspace_ref.rope import rotate

        n, T = q.shape[2], k.shape[2]
        g = q.shape[1] // k.shape[1]
        positions = np.arange(T)
        pos = torch.arange(T - n, T, device=q.device)[:, None]
        t = torch.arange(T, device=q.device)[None, :]
        causal = causal_keep(n, T, q.device)
        exact = (t < self.sinks) | (t > pos - self.window) if (self.window or self.sinks) else torch.zeros_like(causal)
        # compressed tokens are t = S .. p - W, indexed u = t - S: key t's group is complete at
        # query p when its last index is at most the last compressed index p - W - S
        u = t - self.sinks
        done = ((u // self.group) + 1) * self.group - 1 <= pos - self.window - self.sinks
        outs = []
        for h, (c, (Bk, Ev)) in enumerate(zip(self.heads, self.bases)):
            kk, vv = k[:, h].float(), v[:, h].float()
            qh = q[:, h * g : (h + 1) * g].float()  # (B, g, n, d)
            x = rotate(kk, positions, self.rope, inverse=True) if c.key_basis == "pre_rope" else kk
            coef = x @ Bk.T
            k_tail = coef @ Bk
            k_done = _quantized_keys(coef, c.bits_k, self.group, self.sinks) @ Bk
            if c.key_basis == "pre_rope":
                k_tail, k_done = rotate(k_tail, positions, self.rope), rotate(k_done, positions, self.rope)
            v_hat = _quantized_values(vv @ Ev.T, c.bits_v) @ Ev
            lq = qh @ k_done.transpose(-1, -2)[:, None]
            lf = qh @ k_tail.transpose(-1, -2)[:, None]
            le = qh @ kk.transpose(-1, -2)[:, None]
            quantized = done if c.bits_k in (2, 4) else torch.ones_like(done)  # int8 (A10) and fp16: no tail
            logits = torch.where(exact, le, torch.where(quantized, lq, lf)) * scaling
            w = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
            we = torch.where(exact, w, torch.zeros_like(w))
            outs.append(we @ vv[:, None] + (w - we) @ v_hat[:, None])
        return torch.cat(outs, dim=1).to(q.dtype)


__all__ = ["Frontier"]
