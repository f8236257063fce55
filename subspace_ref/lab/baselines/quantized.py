"""Quantised KV cache (KIVI-style asymmetric scheme; own code).

Keys are quantised **per channel** over groups of ``group`` consecutive tokens, values **per
token** (over the head's channels), both asymmetric: ``code = round((x - min) / step)``,
``step = (max - min) / (2^bits - 1)``, dequantised as ``code * step + min`` (so the error is at
most ``step / 2``). A key group's statistics need all its tokens, so — as in KIVI — the keys of an
unfinished group stay in full precision until the group's last token arrives: at query position
``p`` a key ``t`` is quantised iff its group ended at or before ``p``. Values are quantised as they
arrive. The teacher-forced evaluation applies exactly this rule per (query, key) pair, so it
equals decoding.

transformers 5.23's ``QuantizedCache`` was checked and not used: its ``quanto`` and ``hqq``
backends need packages that are not installed here (no network), and its ``fp8`` backend
quantises per tensor with a scale frozen at the first update and returns the unquantised states
of the prefill call, so a teacher-forced window would not be quantised at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from subspace_ref.lab.baselines._attention import causal_keep, repeat_kv
from subspace_ref.byte_convention import Bytes, Geometry, make_bytes


def quantize_asym(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric uniform quantisation of ``x`` with one (step, min) per slice reduced over ``dim``:
    returns integer codes (as x's dtype), steps and minima (keepdim)."""
    lo = x.amin(dim=dim, keepdim=True)
    hi = x.amax(dim=dim, keepdim=True)
    levels = 2**bits - 1
    step = (hi - lo) / levels
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.clamp(torch.round((x - lo) / safe), 0, levels)
    return codes, torch.where(step > 0, step, torch.zeros_like(step)), lo


def fake_quant(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """``x`` quantised and dequantised with one (step, min) per slice reduced over ``dim``."""
    codes, step, lo = quantize_asym(x, bits, dim)
    return codes * step + lo


def quantize_keys(k: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Keys (B, H, T, d) dequantised per channel per group of ``group`` tokens (last group may be
    partial: its statistics are over the tokens it has)."""
    B, H, T, d = k.shape
    out = torch.empty_like(k)
    for a in range(0, T, group):
        out[:, :, a : a + group] = fake_quant(k[:, :, a : a + group], bits, dim=2)
    return out


@dataclass(frozen=True)
class QuantizedKV:
    """``bits``-bit KV: keys per channel over ``group`` tokens, values per token; fp16 scale and
    zero point each; unfinished key groups in fp16."""

    bits: int = 8
    group: int = 64
    family: str = "quantized KV"
    source: str = "own code (KIVI-style per-channel keys / per-token values; transformers QuantizedCache unusable offline)"

    @property
    def name(self) -> str:
        return f"{self.bits}-bit KV (g={self.group})"

    def bytes(self, geom: Geometry) -> Bytes:
        fb, d, dv, C = geom.float_bytes, geom.head_dim, geom.value_dim, geom.context
        residual = C % self.group  # keys of an unfinished group, fp16 instead of codes
        return make_bytes(
            geom,
            key_codes=d * self.bits / 8 * (C - residual) / C,
            key_scales=2 * fb * d * (C // self.group) / C,
            key_residual=d * fb * residual / C,
            value_codes=dv * self.bits / 8,
            value_scales=2 * fb,
        )

    def runtime(self, layer_idx: int) -> "_QuantRuntime":
        return _QuantRuntime(self)


class _QuantRuntime:
    def __init__(self, m: QuantizedKV):
        self.m = m

    def attend(self, q, k, v, scaling):
        n, T = q.shape[2], k.shape[2]
        g = q.shape[1] // k.shape[1]
        kq = quantize_keys(k, self.m.bits, self.m.group)
        vq = fake_quant(v, self.m.bits, dim=3)
        pos = torch.arange(T - n, T, device=q.device)[:, None]
        t = torch.arange(T, device=q.device)[None, :]
        done = ((t // self.m.group) + 1) * self.m.group - 1 <= pos  # key t's group complete at query p
        logits_q = q @ repeat_kv(kq, g).transpose(-1, -2)
        logits_e = q @ repeat_kv(k, g).transpose(-1, -2)
        logits = torch.where(done, logits_q, logits_e) * scaling
        logits = logits.masked_fill(~causal_keep(n, T, q.device), float("-inf"))
        return torch.softmax(logits, dim=-1) @ repeat_kv(vq, g)
