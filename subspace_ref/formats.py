"""The coefficient formats, one record each (spec/quantization.md Q0): what a side of a state stores
per token, which arrays that adds to the layout, how it is quantised and read back, and what it
costs under the byte convention (:mod:`subspace_ref.byte_convention`).

Every module that needs to know a format reads its record here: the layout and the states (which
arrays exist), capabilities (the names backends declare), persistence (the name in a file), the
allocator (its candidates' bytes and reconstructions) and the baselines. Adding a format is one
record in :data:`FORMATS` plus the kernels that read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from subspace_ref.quantization import dequantize_groups, dequantize_rows, quantize_groups, quantize_rows

SIDES = ("key", "value")
#: The name of float coefficients (stored in the state's dtype): every state's default format.
FLOAT = "float"


@dataclass(frozen=True)
class CoefficientFormat:
    """One way of storing a side's coefficients (spec/quantization.md Q0).

    ``name``: what ``coefficients=`` takes and files record. ``bits``: bits per coefficient under
    the byte convention (float coefficients count as fp16). ``low_bits``: the packed code width of
    int4/int2 (0 otherwise). ``per_token_scale``: one float32 scale per token (int8, spec A10).
    ``code_dtype``: the dtype of ``{side}_coef`` (None: the state's floating dtype). ``arrays``:
    per side, the layout arrays the format adds beside ``{side}_coef``."""

    name: str
    bits: int
    low_bits: int = 0
    per_token_scale: bool = False
    code_dtype: str | None = None
    key_arrays: tuple[str, ...] = ()
    value_arrays: tuple[str, ...] = ()

    def arrays(self, side: str) -> tuple[str, ...]:
        """The layout arrays this format adds to ``side`` ("key" or "value")."""
        return self.key_arrays if _side(side) == "key" else self.value_arrays

    def stored_bytes(self, side: str, rank: int, tokens: int, group: int, float_bytes: int = 2) -> dict[str, float]:
        """Bytes one head holds for ``tokens`` compressed tokens of ``side`` at ``rank`` (the byte
        convention, spec/quantization.md Q0): codes, their scales and zero points, and for
        low-bit keys the unfinished group of ``tokens mod group`` kept in floats."""
        side = _side(side)
        if rank == 0 or tokens == 0:
            return {}
        if self.low_bits == 0 and not self.per_token_scale:
            return {f"{side}_coefficients": rank * float_bytes * tokens}
        if self.per_token_scale:  # spec A10: r int8 codes and one float32 scale per token
            return {f"{side}_codes": rank * tokens, f"{side}_scales": 4 * tokens}
        row = math.ceil(rank * self.low_bits / 8)
        if side == "value":  # spec Q2: per token, an fp16 scale and zero point
            return {"value_codes": row * tokens, "value_scales": 2 * float_bytes * tokens}
        tail = tokens % group  # spec Q2: keys per channel over complete groups, the rest in floats
        return {"key_codes": row * (tokens - tail), "key_scales": 2 * float_bytes * rank * (tokens // group), "key_tail": rank * float_bytes * tail}

    def reconstruct(self, x: Any, side: str, group: int, first: int = 0) -> Any:
        """What a state reads back of coefficients ``x`` (..., T, r) stored in this format
        (spec A10, spec/quantization.md Q1-Q2): float as they are; int8 per token; low-bit values
        per token, low-bit keys per channel over the complete groups of ``group`` tokens counted
        from row ``first`` (rows before it and the unfinished group are left as they are: the
        exact tokens and the float tail). NumPy or torch arrays."""
        side = _side(side)
        if x.shape[-1] == 0 or (self.low_bits == 0 and not self.per_token_scale):
            return x
        if self.per_token_scale:
            q, s = quantize_rows(x)
            return dequantize_rows(q, s, x.dtype)
        if side == "value":
            q, s, z = quantize_groups(x, self.low_bits, -1)
            return dequantize_groups(q, s, z, -1, x.dtype)
        T, r = x.shape[-2], x.shape[-1]
        done = max(0, T - first) // group * group
        if not done:
            return x
        out = x.clone() if hasattr(x, "clone") else x.copy()
        blocks = x[..., first : first + done, :].reshape(*x.shape[:-2], done // group, group, r)
        q, s, z = quantize_groups(blocks, self.low_bits, -2)
        out[..., first : first + done, :] = dequantize_groups(q, s, z, -2, x.dtype).reshape(*x.shape[:-2], done, r)
        return out


_LOW_BIT_KEY = ("key_group_scale", "key_group_zero", "key_tail")
_LOW_BIT_VALUE = ("value_token_scale", "value_token_zero")

#: Every coefficient format, by name (spec/quantization.md Q0).
FORMATS: dict[str, CoefficientFormat] = {
    f.name: f
    for f in (
        CoefficientFormat(FLOAT, 16),
        CoefficientFormat("int8", 8, per_token_scale=True, code_dtype="int8", key_arrays=("key_scale",), value_arrays=("value_scale",)),
        CoefficientFormat("int4", 4, low_bits=4, code_dtype="uint8", key_arrays=_LOW_BIT_KEY, value_arrays=_LOW_BIT_VALUE),
        CoefficientFormat("int2", 2, low_bits=2, code_dtype="uint8", key_arrays=_LOW_BIT_KEY, value_arrays=_LOW_BIT_VALUE),
    )
}
#: The format of each width the allocator counts (16: float coefficients, fp16 under the convention).
BY_BITS: dict[int, CoefficientFormat] = {f.bits: f for f in FORMATS.values()}


#: The formats of layouts whose sides agree, and of those whose sides differ ("key/value").
UNIFORM_FORMATS: tuple[str, ...] = tuple(FORMATS)
MIXED_FORMATS: tuple[str, ...] = tuple(f"{a}/{b}" for a in FORMATS for b in FORMATS if a != b)


def _side(side: str) -> str:
    if side not in SIDES:
        raise ValueError(f'side must be "key" or "value", got {side!r}')
    return side


def coefficient_format(name: Any, argument: str = "coefficients") -> CoefficientFormat:
    """The record named ``name``; ValueError naming ``argument`` for anything else."""
    if isinstance(name, CoefficientFormat):
        return name
    if name not in FORMATS:
        raise ValueError(f"{argument} must be one of {', '.join(repr(n) for n in FORMATS)}, got {name!r}")
    return FORMATS[name]


def of_bits(bits: Any, argument: str = "bits") -> CoefficientFormat:
    """The record of a width the allocator counts: 16 (float), 8, 4 or 2."""
    if bits not in BY_BITS:
        raise ValueError(f"{argument} must be one of {tuple(BY_BITS)}, got {bits!r}")
    return BY_BITS[bits]


def side_formats(coefficients: Any) -> tuple[CoefficientFormat, CoefficientFormat]:
    """The (key, value) records of a ``coefficients=`` argument: one name for both sides, a
    (key, value) pair of names, or the name a layout reports (:func:`pair_name`, "key/value")."""
    if isinstance(coefficients, str) and "/" in coefficients:
        names = coefficients.split("/")
        if len(names) != 2 or names[0] == names[1]:
            raise ValueError(f"coefficients must be a format name or 'key/value' of two different names, got {coefficients!r}")
        coefficients = tuple(names)
    if isinstance(coefficients, (tuple, list)):
        if len(coefficients) != 2:
            raise ValueError(f"coefficients must be a format name or a (key, value) pair of names, got {coefficients!r}")
        return coefficient_format(coefficients[0], "coefficients[0] (keys)"), coefficient_format(coefficients[1], "coefficients[1] (values)")
    f = coefficient_format(coefficients)
    return f, f


def pair_name(key: CoefficientFormat, value: CoefficientFormat) -> str:
    """The name a layout of these side formats reports: one name when they agree, else
    ``"key/value"`` (e.g. "int4/int8"), which backends declare like any other format."""
    return key.name if key == value else f"{key.name}/{value.name}"


__all__ = ["BY_BITS", "FLOAT", "FORMATS", "MIXED_FORMATS", "SIDES", "UNIFORM_FORMATS", "CoefficientFormat", "coefficient_format", "of_bits", "pair_name", "side_formats"]
