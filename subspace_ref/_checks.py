"""Argument checks shared by the public API: every message names the argument and what was expected."""

from __future__ import annotations

from typing import Any

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


def shape(name: str, x: Any, expected: tuple) -> None:
    """ValueError unless ``x.shape`` matches ``expected``, where None matches any length."""
    got = tuple(x.shape)
    if len(got) != len(expected) or any(e is not None and e != g for e, g in zip(expected, got)):
        want = "(" + ", ".join("*" if e is None else str(e) for e in expected) + ")"
        raise ValueError(f"{name} has shape {got}; expected {want}")


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int,)) and not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def open_unit_interval(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must lie in the open interval (0, 1), got {value}")
    return value


def float_dtype(name: str, x: Any) -> None:
    """TypeError unless ``x`` has a floating dtype."""
    kind = str(x.dtype)
    if not any(f in kind for f in ("float16", "float32", "float64", "bfloat16")):
        raise TypeError(f"{name} has dtype {kind}; expected float16, bfloat16, float32 or float64")
