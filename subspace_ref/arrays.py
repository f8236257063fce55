"""Array-family helpers that let one algorithm run on NumPy and CuPy arrays alike.

NumPy and CuPy share one API, so the oracle's code in :mod:`subspace_ref.numpy_backend` runs on
either through ``xp``. Torch is recognised by type name only, so this module never imports it.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def array_family(x: Any) -> str:
    """"numpy", "cupy" or "torch", from the array's type; ValueError for anything else."""
    if isinstance(x, np.ndarray):
        return "numpy"
    module = type(x).__module__.split(".")[0]
    if module in ("cupy", "torch"):
        return module
    raise ValueError(f"expected a numpy, cupy or torch array, got {type(x).__name__}")


def namespace(x: Any):
    """The NumPy-compatible module for ``x``: numpy, cupy, or for torch tensors array-api-compat's
    torch namespace (NumPy's names and keyword arguments over torch; array creation without
    ``device=`` lands on the CPU, so code shared with torch creates arrays only from its inputs)."""
    family = array_family(x)
    if family == "numpy":
        return np
    if family == "cupy":
        import cupy

        return cupy
    import array_api_compat.torch

    return array_api_compat.torch


def to_numpy(x: Any) -> np.ndarray:
    """A host NumPy copy of any supported array (bfloat16 becomes float32)."""
    family = array_family(x)
    if family == "numpy":
        return x
    if family == "cupy":
        return x.get()
    x = x.detach()
    if str(x.dtype) == "torch.bfloat16":
        x = x.float()
    if str(x.dtype) == "torch.float8_e4m3fn":  # NumPy's float8 comes from ml_dtypes (spec/storage.md S1)
        import ml_dtypes
        import torch

        return x.cpu().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return x.cpu().numpy()


def zeros(shape: tuple, like: Any) -> Any:
    """A zero array of ``shape`` with ``like``'s family, dtype and device."""
    if array_family(like) == "torch":
        import torch

        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    return namespace(like).zeros(shape, dtype=like.dtype)


def grown(x: Any, axis: int, size: int) -> Any:
    """``x`` with axis ``axis`` extended to ``size`` by zeros (a new array; ``x`` is untouched)."""
    if x.shape[axis] >= size:
        return x
    shape = list(x.shape)
    shape[axis] = size
    out = zeros(tuple(shape), like=x)
    index = [slice(None)] * x.ndim
    index[axis] = slice(0, x.shape[axis])
    out[tuple(index)] = x
    return out


def numel(x: Any) -> int:
    return x.numel() if array_family(x) == "torch" else int(x.size)


def itemsize(x: Any) -> int:
    return x.element_size() if array_family(x) == "torch" else int(x.itemsize)


def clone(x: Any) -> Any:
    return x.clone() if array_family(x) == "torch" else x.copy()


def concat(parts: list, axis: int) -> Any:
    """``parts`` (arrays of one family) joined along ``axis``."""
    if array_family(parts[0]) == "torch":
        import torch  # the arrays are torch tensors already, so torch is loaded

        return torch.cat(parts, dim=axis)
    return namespace(parts[0]).concatenate(parts, axis=axis)


def take(x: Any, rows: list, axis: int) -> Any:
    """The entries ``rows`` (a list of ints) of ``x`` along ``axis``, in that order (a new array)."""
    if array_family(x) == "torch":
        import torch

        return x.index_select(axis, torch.as_tensor(rows, dtype=torch.long, device=x.device))
    xp = namespace(x)
    return xp.take(x, xp.asarray(rows), axis=axis)
