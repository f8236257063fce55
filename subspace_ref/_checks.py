"""Argument checks shared by the public API: every message names the argument and what was expected."""

from __future__ import annotations

from typing import Any

import numpy as np

from subspace_ref.arrays import array_family, namespace


def finite(name: str, x: Any) -> None:
    """ValueError when ``x`` holds NaN or Inf."""
    if array_family(x) == "torch":
        import torch

        ok = bool(torch.isfinite(x).all())
    else:
        ok = bool(namespace(x).isfinite(x).all())
    if not ok:
        raise ValueError(f"{name} contains NaN or Inf; expected finite values")


def finite_norms(name: str, x: Any) -> None:
    """ValueError when some row's squared norm overflows x's dtype (finite entries, but every
    projection, residual and sketch of such a row would be Inf or NaN)."""
    # half-precision inputs are accumulated in float32 by every backend, so check there
    if array_family(x) == "torch":
        import torch

        wide = x.float() if x.element_size() < 4 else x
        ok = bool(torch.isfinite((wide * wide).sum(-1)).all())
    else:
        xp = namespace(x)
        wide = x.astype(np.float32) if x.dtype.itemsize < 4 else x
        with np.errstate(over="ignore", invalid="ignore"):
            ok = bool(xp.isfinite((wide * wide).sum(-1)).all())
    if not ok:
        raise ValueError(f"{name} has rows whose squared norm overflows {x.dtype}; expected |row|^2 within the dtype's range (rescale the inputs)")


def finite_rows(name: str, original: Any, x: Any) -> None:
    """:func:`finite` of ``original`` and :func:`finite_norms` of ``x`` (``original`` cast to
    the dtype it is kept in), with their messages, at the cost of one sum of squares where both
    hold: a finite sum of every squared entry (accumulated as finite_norms does) bounds every
    row's squared norm and excludes NaN and Inf. Only when that sum is not finite are the two
    precise checks run, to name the failure (or to find that only the total overflowed)."""
    if array_family(x) == "torch":
        import torch

        wide = x.float() if x.element_size() < 4 else x
        total = float(torch.sum(wide * wide))
    else:
        wide = x.astype(np.float32) if x.dtype.itemsize < 4 else x
        with np.errstate(over="ignore", invalid="ignore"):
            total = float(namespace(x).sum(wide * wide))
    if total != total or total in (float("inf"), float("-inf")):
        finite(name, original)
        finite_norms(name, x)


def as_array(name: str, x: Any) -> Any:
    """x as an array (NumPy for lists), or ValueError naming the argument for ragged input."""
    if isinstance(x, (list, tuple)):
        try:
            return np.asarray(x)
        except ValueError as err:
            raise ValueError(f"{name} is not a rectangular array: {err}") from None
    array_family(x)
    return x


def shape(name: str, x: Any, expected: tuple) -> None:
    """ValueError unless ``x.shape`` matches ``expected``, where None matches any length."""
    got = tuple(x.shape)
    if len(got) != len(expected) or any(e is not None and e != g for e, g in zip(expected, got)):
        want = "(" + ", ".join("*" if e is None else str(e) for e in expected) + ")"
        raise ValueError(f"{name} has shape {got}; expected {want}")


def integer(name: str, value: Any) -> int:
    """An int (NumPy integers too); TypeError naming the argument for bools, floats and others."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


def positive_int(name: str, value: Any) -> int:
    value = integer(name, value)
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def real(name: str, value: Any) -> float:
    """A real number; TypeError naming the argument otherwise."""
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {value!r}") from None


def open_unit_interval(name: str, value: float) -> float:
    value = real(name, value)
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must lie in the open interval (0, 1), got {value}")
    return value


def numpy_float_dtype(name: str, dtype: Any) -> np.dtype:
    """np.dtype(dtype) if it is float16/32/64; TypeError naming the argument otherwise."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be a NumPy float dtype, got {dtype!r}") from None
    if dt not in (np.float16, np.float32, np.float64):
        raise TypeError(f"{name} must be float16, float32 or float64, got {dt}")
    return dt


def float_dtype(name: str, x: Any) -> None:
    """TypeError unless ``x`` has a floating dtype."""
    kind = str(x.dtype)
    if not any(f in kind for f in ("float16", "float32", "float64", "bfloat16")):
        raise TypeError(f"{name} has dtype {kind}; expected float16, bfloat16, float32 or float64")
