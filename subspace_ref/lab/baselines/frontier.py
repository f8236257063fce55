"""A reconstruction simulation of the allocator's configurations (issue 16): per-head ranks and
coefficient bits (an :class:`~subspace_ref.allocation.Allocation`), post-RoPE, pre-RoPE, plane or
identity key bases, subspace or identity value bases, an exact recent window and attention sinks.

docs/baselines.md decodes these rows through ``SubspaceCache`` (``allocated_states``); this
module remains as an independent statement of what that cache computes, and
``tests/test_baselines.py`` checks that the two agree. It is exact attention over what the state
stores (spec/quantization.md Q2.1): per (query position p, key t),

* t exact (a sink, t < S, or in the window, t > p − W): the cached k_t, v_t;
* otherwise k̂_t = Bᵀ ĉ_t (pre-RoPE bases: R_t Bᵀ ĉ_t, with c_t = B R_t⁻¹ k_t, spec/rope.md P2;
  identity bases: B = I), ĉ_t the int8/int4/int2 reading of spec/quantization.md Q1 when key t's
  group of G tokens is complete at p, else the exact coefficients (KIVI's tail); v̂_t = Eᵀ d̂_t,
  values quantised per token (both read back by
  :meth:`subspace_ref.formats.CoefficientFormat.reconstruct`). Bits 16 are float coefficients
  (fp16 rounding not simulated, as :mod:`subspace_ref.byte_convention` says).

Computed in float64 when the model is float64 (the test's setting), else float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from subspace_ref.allocation import Allocation
from subspace_ref.lab.baselines._attention import causal_keep
from subspace_ref.formats import of_bits


@dataclass(frozen=True)
class Frontier:
    allocation: Allocation
    label: str
    family: str = "subspace (issue 16)"
    source: str = "this project (allocation.py; SubspaceCache of allocated_states, teacher_forced)"

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
            Wk, Wv = src[layer_idx]["Wk"][h], self.svd[layer_idx]["Wv"][h]
            # an identity side stores the raw channels (KIVI), not the full-rank SVD rotation of them
            Bk = np.eye(Wk.shape[-1]) if c.key_basis == "identity" else Wk[: c.rank_k]
            Ev = np.eye(Wv.shape[-1]) if c.value_basis == "identity" else Wv[: c.rank_v]
            bases.append((torch.from_numpy(np.array(Bk, dtype=np.float64)), torch.from_numpy(np.array(Ev, dtype=np.float64))))
        return _FrontierRuntime(heads, bases, self.alloc.group, self.alloc.window, self.alloc.sinks, self.rope)


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
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        outs = []
        for h, (c, (Bk, Ev)) in enumerate(zip(self.heads, self.bases)):
            Bk, Ev = Bk.to(work), Ev.to(work)
            kk, vv = k[:, h].to(work), v[:, h].to(work)
            qh = q[:, h * g : (h + 1) * g].to(work)  # (B, g, n, d)
            x = rotate(kk, positions, self.rope, inverse=True) if c.key_basis == "pre_rope" else kk
            coef = x @ Bk.T
            k_tail = coef @ Bk
            # groups of the compressed stream, which starts after the sinks (spec/window.md W10)
            k_done = of_bits(c.bits_k).reconstruct(coef, "key", self.group, self.sinks) @ Bk
            if c.key_basis == "pre_rope":
                k_tail, k_done = rotate(k_tail, positions, self.rope), rotate(k_done, positions, self.rope)
            v_hat = of_bits(c.bits_v).reconstruct(vv @ Ev.T, "value", self.group) @ Ev
            lq = qh @ k_done.transpose(-1, -2)[:, None]
            lf = qh @ k_tail.transpose(-1, -2)[:, None]
            le = qh @ kk.transpose(-1, -2)[:, None]
            quantized = done if of_bits(c.bits_k).low_bits else torch.ones_like(done)  # int8 (A10) and fp16: no tail
            logits = torch.where(exact, le, torch.where(quantized, lq, lf)) * scaling
            w = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
            we = torch.where(exact, w, torch.zeros_like(w))
            outs.append(we @ vv[:, None] + (w - we) @ v_hat[:, None])
        return torch.cat(outs, dim=1).to(q.dtype)


__all__ = ["Frontier"]
