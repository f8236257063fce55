"""INT8 coefficients with one scale per token and head (spec A10; seed 001 §10, seed 003
"Quantization combination"). The CUDA and Triton kernels dequantise by the same definition."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from subspace_ref.arrays import array_family, concat, namespace


def quantize_rows(x: Any) -> tuple[Any, Any]:
    """Spec A10: per row (the last axis), s = max|x| / 127 and q = round(x / s) as int8.

    A zero row gets s = 0 and q = 0. Returns (q, s) with s in float32, one per row.
    """
    if array_family(x) == "torch":
        import torch

        # divide in float64 for float64 input, as the NumPy branch does, so both round alike
        wide = x.double() if x.dtype == torch.float64 else x.float()
        scale = (wide.abs().amax(dim=-1) / 127.0).float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).to(wide.dtype)
        q = torch.round(wide / safe[..., None]).clamp_(-127, 127).to(torch.int8)
        return q, scale
    xp = namespace(x)
    scale = (xp.abs(x).max(axis=-1) / 127.0).astype(np.float32)
    safe = xp.where(scale > 0, scale, 1.0).astype(np.float32)
    q = xp.clip(xp.rint(x / safe[..., None]), -127, 127).astype(np.int8)
    return q, scale


def dequantize_rows(q: Any, scale: Any, dtype: Any) -> Any:
    """Spec A10: x_hat = q * s, in ``dtype``."""
    if array_family(q) == "torch":
        return (q.float() * scale[..., None]).to(dtype)
    return (q.astype(np.float32) * scale[..., None]).astype(dtype)


# ---------------------------------------------------------------- low-bit coefficients (spec Q1-Q4)

#: Key coefficients share one scale and zero point per channel over groups of this many tokens
#: by default (KIVI's G; spec/quantization.md Q2).
DEFAULT_GROUP = 32
_FP16_MAX = 65504.0


def _fp16_round(x: Any, direction: float) -> Any:
    """x (float64/float32) rounded to float16 towards ``direction`` (-inf or +inf): the stored
    zero point is rounded down and the stored scale up, so the grid covers [min, max] (Q1)."""
    if array_family(x) == "torch":
        import torch

        h = x.to(torch.float16)
        wrong = (h.to(x.dtype) < x) if direction > 0 else (h.to(x.dtype) > x)
        return torch.where(wrong, torch.nextafter(h, torch.full_like(h, direction)), h)
    xp = namespace(x)
    h = x.astype(np.float16)
    wrong = (h.astype(x.dtype) < x) if direction > 0 else (h.astype(x.dtype) > x)
    return xp.where(wrong, xp.nextafter(h, np.float16(direction)), h)


def quantize_groups(x: Any, bits: int, axis: int, check_range: bool = True) -> tuple[Any, Any, Any]:
    """Spec Q1: asymmetric uniform quantisation of x to ``bits``-bit codes, one float16 zero point
    z and scale s per slice along ``axis`` (the axis the min and max are taken over).

    z = min rounded down to float16, s = (max - z) / (2^b - 1) rounded up to float16,
    q = round((x - z) / s) in [0, 2^b - 1] (q = 0 when s = 0). Returns (q uint8 of x's shape,
    s, z) with s and z float16 of x's shape without ``axis``. ``check_range=False`` skips the
    float16-range check on torch tensors (a host read, which a compiled graph cannot make)."""
    levels = (1 << bits) - 1
    if array_family(x) == "torch":
        import torch

        wide = x.double()
        lo, hi = wide.amin(dim=axis), wide.amax(dim=axis)
        if check_range:
            check_fp16_range(float(lo.abs().max()) if lo.numel() else 0.0, float(hi.abs().max()) if hi.numel() else 0.0)
        zero = _fp16_round(lo, -float("inf"))
        scale = _fp16_round((hi - zero.double()) / levels, float("inf"))
        safe = torch.where(scale > 0, scale.double(), torch.ones_like(hi))
        q = torch.round((wide - zero.double().unsqueeze(axis)) / safe.unsqueeze(axis)).clamp_(0, levels).to(torch.uint8)
        return q, scale, zero
    xp = namespace(x)
    wide = x.astype(np.float64)
    lo, hi = wide.min(axis=axis), wide.max(axis=axis)
    check_fp16_range(float(abs(lo).max()) if lo.size else 0.0, float(abs(hi).max()) if hi.size else 0.0)
    zero = _fp16_round(lo, -np.inf)
    scale = _fp16_round((hi - zero.astype(np.float64)) / levels, np.inf)
    safe = xp.where(scale > 0, scale.astype(np.float64), 1.0)
    q = xp.clip(xp.rint((wide - xp.expand_dims(zero.astype(np.float64), axis)) / xp.expand_dims(safe, axis)), 0, levels).astype(np.uint8)
    return q, scale, zero


def check_fp16_range(lo: float, hi: float) -> None:
    """ValueError unless |lo|, |hi| (a slice's extremes) lie within float16's range: the zero point
    and scale of Q1 are stored in float16."""
    if not (max(lo, hi) <= _FP16_MAX):
        raise ValueError(f"low-bit coefficients must be finite with |c| <= {_FP16_MAX} (their float16 scale and zero point); got max |c| = {max(lo, hi)}")


def dequantize_groups(q: Any, scale: Any, zero: Any, axis: int, dtype: Any) -> Any:
    """Spec Q1: x_hat = q * s + z, formed in float64 (exact: a b-bit integer times a float16,
    plus a float16) and rounded once to ``dtype``."""
    if array_family(q) == "torch":
        import torch

        wide = torch.float32 if q.device.type == "mps" else torch.float64
        return (q.to(wide) * scale.to(wide).unsqueeze(axis) + zero.to(wide).unsqueeze(axis)).to(dtype)
    return (q.astype(np.float64) * np.expand_dims(scale.astype(np.float64), axis) + np.expand_dims(zero.astype(np.float64), axis)).astype(dtype)


def packed_width(width: int, bits: int) -> int:
    """Bytes per row of ``width`` codes of ``bits`` bits, packed 8 / bits to a byte (Q1)."""
    return -(-width * bits // 8)


def pack(q: Any, bits: int) -> Any:
    """Codes (..., w) uint8 < 2^bits -> (..., packed_width(w, bits)) uint8: code i of a byte sits
    in bits [i * bits, (i + 1) * bits) (the first code in the low bits), the last byte zero-padded."""
    per = 8 // bits
    w = q.shape[-1]
    pad = packed_width(w, bits) * per - w
    if array_family(q) == "torch":
        import torch

        q = torch.nn.functional.pad(q, (0, pad)).reshape(*q.shape[:-1], packed_width(w, bits), per).to(torch.int32)
        shifts = torch.arange(per, device=q.device, dtype=torch.int32) * bits
        return (q << shifts).sum(-1).to(torch.uint8)
    q = np.concatenate([q, np.zeros(q.shape[:-1] + (pad,), np.uint8)], axis=-1).reshape(*q.shape[:-1], packed_width(w, bits), per)
    shifts = (np.arange(per) * bits).astype(np.uint8)
    return (q << shifts).sum(-1, dtype=np.uint32).astype(np.uint8)


def unpack(packed: Any, bits: int, width: int) -> Any:
    """Inverse of :func:`pack`: (..., packed_width(width, bits)) uint8 -> (..., width) codes."""
    per = 8 // bits
    mask = (1 << bits) - 1
    if array_family(packed) == "torch":
        import torch

        shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
        q = (packed.to(torch.int32)[..., None] >> shifts) & mask
        return q.reshape(*packed.shape[:-1], packed.shape[-1] * per)[..., :width].to(torch.uint8)
    shifts = (np.arange(per) * bits).astype(np.uint8)
    q = (packed[..., None] >> shifts) & np.uint8(mask)
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * per)[..., :width]


# ------------------------------------------- low-bit coefficients in the packed layout (spec Q2)

def _numpy_viewable(*arrays: Any) -> bool:
    """Whether every array is a CPU torch tensor that NumPy can view in place (not bfloat16,
    outside autograd)."""
    if any(array_family(x) != "torch" for x in arrays):
        return False
    import torch

    return all(x.device.type == "cpu" and x.dtype != torch.bfloat16 and not x.requires_grad for x in arrays)


def store_low_bit(lay, which: str, a: int, b: int, coef: Any) -> None:
    """Spec Q2: write coefficients (N, H, b - a, r) of tokens [a, b) into low-bit layout ``lay``.

    Values: codes and a float16 scale and zero point per token. Keys: every group of G tokens
    that [a, b) completes is quantised per channel (KIVI); the rows of the unfinished trailing
    group are held in float in ``key_tail`` (a new array: the state's own tail is never written).
    Rows [G floor(a / G), a) must be in the tail: tokens are appended in order, and rewrites
    (a rotating refresh) start at 0.

    CPU torch arrays are written through NumPy views of them by the NumPy branch: the same
    definition as the torch branch (kept for device arrays) and the same numbers, faster on a
    decode step's few dozen numbers (docs/benchmarks.md)."""
    if _numpy_viewable(coef, *(getattr(lay, name) for name in lay.side_arrays(which))):
        import torch

        views = replace(lay, **{name: getattr(lay, name).numpy() for name in lay.side_arrays(which)})
        store_low_bit(views, which, a, b, coef.detach().numpy())
        if which == "key":
            lay.key_tail = torch.from_numpy(views.key_tail)
        return
    bits = lay.side_format(which).low_bits
    if which == "value":
        q, scale, zero = quantize_groups(coef, bits, axis=-1)
        lay.value_coef[:, :, a:b] = pack(q, bits)
        lay.value_token_scale[:, :, a:b] = scale
        lay.value_token_zero[:, :, a:b] = zero
        return
    G = lay.group
    g0 = a // G
    head = lay.key_tail[:, :, : a - g0 * G]
    full = concat([head.to(coef.dtype) if array_family(coef) == "torch" else head.astype(coef.dtype), coef], axis=2)
    done = (full.shape[2] // G) * G
    if done:
        N, H, _, r = full.shape
        q, scale, zero = quantize_groups(full[:, :, :done].reshape(N, H, done // G, G, r), bits, axis=-2)
        lay.key_coef[:, :, g0 * G : g0 * G + done] = pack(q.reshape(N, H, done, r), bits)
        lay.key_group_scale[:, :, g0 : g0 + done // G] = scale
        lay.key_group_zero[:, :, g0 : g0 + done // G] = zero
    tail = lay.key_tail * 0
    tail[:, :, : full.shape[2] - done] = full[:, :, done:]
    lay.key_tail = tail


def read_low_bit(lay, which: str, a: int, b: int, dtype: Any, upto: int, index: tuple = (slice(None), slice(None))) -> Any:
    """Spec Q2: coefficients of tokens [a, b) (b <= ``upto``, the tokens written) of low-bit
    layout ``lay``, dequantised into ``dtype``: (..., b - a, r), ``index`` selecting over (N, H)."""
    bits = lay.side_format(which).low_bits
    if which == "value":
        width = lay.value_bases.shape[3]
        q = unpack(lay.value_coef[index + (slice(a, b),)], bits, width)
        return dequantize_groups(q, lay.value_token_scale[index + (slice(a, b),)], lay.value_token_zero[index + (slice(a, b),)], -1, dtype)
    G = lay.group
    width = lay.key_bases.shape[3]
    complete = (upto // G) * G
    parts = []
    if a < min(b, complete):
        g0, g1 = a // G, -(-min(b, complete) // G)
        q = unpack(lay.key_coef[index + (slice(g0 * G, g1 * G),)], bits, width)
        q = q.reshape(*q.shape[:-2], g1 - g0, G, width)  # whole groups: the scales are per group
        x = dequantize_groups(q, lay.key_group_scale[index + (slice(g0, g1),)], lay.key_group_zero[index + (slice(g0, g1),)], -2, dtype)
        parts.append(x.reshape(*x.shape[:-3], (g1 - g0) * G, width)[..., a - g0 * G : min(b, complete) - g0 * G, :])
    if b > complete:
        tail = lay.key_tail[index + (slice(max(a, complete) - complete, b - complete),)]
        parts.append(tail.to(dtype) if array_family(tail) == "torch" else tail.astype(dtype))
    if not parts:  # a == b
        empty = lay.key_tail[index + (slice(0, 0),)]
        return empty.to(dtype) if array_family(empty) == "torch" else empty.astype(dtype)
    return parts[0] if len(parts) == 1 else concat(parts, axis=-2)
