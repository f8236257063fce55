"""Dtype names and array conversion into torch tensors (used by ``SubspaceState.to``)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from subspace_ref.arrays import array_family

DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a torch dtype without its ``torch.`` prefix.

    Parameters
    ----------
    dtype : torch.dtype

    Returns
    -------
    str
    """
    return str(dtype).removeprefix("torch.")


def as_torch_dtype(dtype: Any) -> torch.dtype:
    """torch.float32, np.float32, np.dtype('float32'), 'float32' or 'torch.float32' -> torch.float32.

    Parameters
    ----------
    dtype : any

    Returns
    -------
    torch.dtype
        TypeError for a dtype the backend does not take.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, str) else None
    if name is None:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    if name not in DTYPES:
        raise TypeError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[name]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype arithmetic runs in: float32 for the half types, else the dtype itself.

    Parameters
    ----------
    dtype : torch.dtype

    Returns
    -------
    torch.dtype
    """
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def to_tensor(x: Any, device: Any = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Any numpy, cupy or torch array (or Python scalar/list) as a torch tensor on ``device``
    (default: CPU for host arrays, the array's own device for cupy/torch). Floating arrays are
    cast to ``dtype`` when given; integer arrays keep their dtype (int64 chunk offsets, int8
    coefficients of spec A10). Host arrays are always copied; a torch tensor already on the
    device with the dtype is returned as is.

    Parameters
    ----------
    x : array_like
    device : any, optional
    dtype : torch.dtype, optional

    Returns
    -------
    torch.Tensor
    """
    family = "numpy" if isinstance(x, (int, float, list, tuple, np.generic)) else array_family(x)
    if family == "numpy" and "float8_e4m3fn" in str(getattr(x, "dtype", "")):
        # float8 bases (spec/storage.md S1): torch cannot read ml_dtypes arrays, but the bits agree
        t = torch.from_numpy(np.array(x, copy=True).view(np.uint8)).view(torch.float8_e4m3fn)
    elif family == "numpy":
        t = torch.from_numpy(np.array(x, copy=True))
    elif family == "cupy":
        t = torch.from_dlpack(x)  # zero-copy on the GPU; .to() below copies if needed
    else:
        t = x.detach()
    target = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return t.to(device=device if device is not None else t.device, dtype=target)


def converter(device: Any = None, dtype: Any = None) -> Callable[[Any], torch.Tensor]:
    """The ``Backend.converter`` of the torch backend; ValueError for a device torch cannot
    use here, TypeError for an unsupported dtype (both raised now, not on first use).

    Parameters
    ----------
    device : any, optional
    dtype : any, optional

    Returns
    -------
    callable
        An array to a torch tensor on ``device`` in ``dtype``.
    """
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but torch sees no CUDA device")
    if dev is not None and dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:i]' for the torch backend, got {device!r}")
    tdtype = as_torch_dtype(dtype) if dtype is not None else None

    def convert(x: Any) -> torch.Tensor:
        """``x`` as a torch tensor on the converter's device, in its dtype.

        Parameters
        ----------
        x : array_like

        Returns
        -------
        torch.Tensor
        """
        return to_tensor(x, dev, tdtype)

    return convert
