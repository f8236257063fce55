"""How bases are stored (spec/storage.md S1-S3; seed 001 §10: "bases in FP16 by default;
optional FP8/INT8 bases ablated").

A state's bases are held *encoded* in its :class:`~subspace_ref.layout.PackedLayout`; every
reader gets them decoded through :meth:`PackedLayout.basis`, and every writer encodes through
:meth:`PackedLayout.store_basis`, which also returns what readers will decode, so an online
state projects with exactly the basis attention later reads. Works on NumPy, CuPy (native and
float16 only) and torch arrays; never imports torch itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from subspace_ref.arrays import array_family
from subspace_ref.quantization import quantize_rows

#: Spec S1: "native" keeps the state's dtype; the others are what the bytes hold. These are basis
#: formats, a vocabulary apart from the coefficient formats of :mod:`subspace_ref.formats`.
FORMATS = ("native", "float16", "float8_e4m3", "int8")
#: The basis format that stores the state's own dtype (the default).
NATIVE = FORMATS[0]
#: Basis formats whose rows carry one float32 scale each (spec S2; tensors ``*_basis_scale``).
ROW_SCALED = ("int8",)
#: Basis formats a file holds as raw bits (uint8) because NumPy has no such dtype.
RAW_BITS = ("float8_e4m3",)


def is_native(fmt: str) -> bool:
    """Whether bases in ``fmt`` are stored in the state's own dtype."""
    return fmt == NATIVE


def has_row_scales(fmt: str) -> bool:
    """Whether bases in ``fmt`` carry one float32 scale per row (spec S2)."""
    return fmt in ROW_SCALED


def is_float8_format(fmt: str) -> bool:
    """Whether bases in ``fmt`` are float8, stored in a file as their bits (uint8)."""
    return fmt in RAW_BITS


def file_dtype_name(fmt: str, stored: bool) -> str:
    """The dtype name of non-native stored bases: in memory, or (``stored``) in a file, where
    float8 bases are their bits as uint8 (spec/persistence.md)."""
    if is_float8_format(fmt):
        return "uint8" if stored else "float8_e4m3fn"
    return str(np.dtype({"float16": np.float16, "int8": np.int8}[fmt]))


def check_format(name: str, value: Any) -> str:
    """``value`` if it names a basis format, else ValueError naming the argument."""
    if not isinstance(value, str) or value not in FORMATS:
        raise ValueError(f"{name} must be one of {', '.join(repr(f) for f in FORMATS)}, got {value!r}")
    return value


def float8_dtype():
    """NumPy's float8 e4m3 (finite-only "fn" variant, max 448) from the ``ml_dtypes`` package."""
    import ml_dtypes

    return np.dtype(ml_dtypes.float8_e4m3fn)


def stored_dtype(fmt: str, dtype: Any) -> np.dtype:
    """Spec S1: the NumPy dtype of the stored bases of a state of float ``dtype``."""
    if fmt == "float8_e4m3":
        return float8_dtype()
    return np.dtype({"native": dtype, "float16": np.float16, "int8": np.int8}[fmt])


def row_error_bound(fmt: str, d: int) -> float:
    """Spec S2.1: a bound on |decode(encode(u)) - u| for a unit row u of length d: 0 for native,
    2^-11 for float16 (relative rounding of every entry), 2^-4 + sqrt(d) 2^-10 for float8 e4m3
    (3 mantissa bits, subnormal spacing 2^-9), sqrt(d) / 254 for int8 (|error| <= max|u| / 254 per
    entry). The warm-up (spec A7 step 0) treats a token whose residual against the stored rows is
    below twice this (relative to its norm) as already in their span: such a residual is the
    storage error of those rows, and normalising it would add a row of noise (with int8 bases on
    the shipped model, rows nearly parallel to earlier ones)."""
    import math

    if fmt == "native":
        return 0.0
    return {"float16": 2.0**-11, "float8_e4m3": 2.0**-4 + math.sqrt(d) * 2.0**-10, "int8": math.sqrt(d) / 254.0}[fmt]


def is_float8(x: Any) -> bool:
    return "float8_e4m3fn" in str(x.dtype)


def encode(x: Any, fmt: str, dtype: Any) -> tuple[Any, Any]:
    """Spec S2: bases ``x`` (..., r, d) as stored in ``fmt`` for a state of float ``dtype``:
    (stored, scale). ``scale`` is None except for int8, where it is one float32 per basis row
    (..., r): s = max|row| / 127, q = round(row / s) (the same rule as spec A10's coefficients)."""
    if fmt == "int8":
        return quantize_rows(x)
    if array_family(x) == "torch":
        import torch

        target = {"native": dtype, "float16": torch.float16, "float8_e4m3": torch.float8_e4m3fn}[fmt]
        return x.to(target), None
    return x.astype(stored_dtype(fmt, dtype)), None


def decode(stored: Any, scale: Any, dtype: Any) -> Any:
    """Spec S2: stored bases back in ``dtype`` (a new array). int8: q * s formed in float64,
    where it is exact (7-bit q times a float32 s), then rounded once to ``dtype``, so every
    backend and every ``dtype`` sees the same value up to that one rounding."""
    if array_family(stored) == "torch":
        if scale is None:
            return stored.to(dtype, copy=True)
        return (stored.double() * scale.double()[..., None]).to(dtype)
    if scale is None:
        return stored.astype(dtype)
    return (stored.astype(np.float64) * scale.astype(np.float64)[..., None]).astype(dtype)


def decoded_state(state):
    """``state`` itself for native bases, else a shallow copy whose layout holds the bases
    decoded into the state's dtype (native format, sharing every other array): what kernels that
    read native bases attend to. The decoding is cached for torch layouts (PackedLayout.decoded_bases)."""
    import copy
    from dataclasses import replace

    lay = state.layout
    if lay.basis_format == "native":
        return state
    view = copy.copy(state)
    view.layout = replace(
        lay,
        key_bases=lay.decoded_bases("key", lay.dtype),
        value_bases=lay.decoded_bases("value", lay.dtype),
        key_basis_scale=None,
        value_basis_scale=None,
        basis_format="native",
    )
    return view
