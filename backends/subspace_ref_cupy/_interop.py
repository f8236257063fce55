"""Zero-copy views between torch CUDA tensors and CuPy arrays (DLPack), and dtype names.

Nothing here imports cupy or torch at module level: both are imported inside the functions,
which only run once the backend has been found available.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any

from subspace_ref.arrays import array_family


def dtype_name(x: Any) -> str:
    """"float32", "bfloat16", "int8", ... for a numpy, cupy or torch array."""
    return str(x.dtype).removeprefix("torch.")


def device_id(x: Any) -> int | None:
    """The CUDA device index of a cupy array or torch tensor; None for host arrays."""
    family = array_family(x)
    if family == "cupy":
        return int(x.device.id)
    if family == "torch":
        return x.device.index if x.device.type == "cuda" else None
    return None


def as_cupy(x: Any):
    """A contiguous CuPy view of a cupy array or torch CUDA tensor, sharing its memory when it is
    already contiguous.

    A torch bfloat16 tensor is viewed as int16: CuPy knows bfloat16 only when ml_dtypes is installed,
    and the kernels read raw bits anyway (the logical dtype travels separately, see
    :func:`dtype_name`)."""
    import cupy

    if array_family(x) == "torch":
        import torch

        x = x.detach()
        if x.dtype == torch.bfloat16:
            x = x.view(torch.int16)
        return cupy.from_dlpack(x.contiguous())
    return cupy.ascontiguousarray(x)


def as_cupy_float32(x: Any):
    """A float32 CuPy copy of a small array (gamma): cast on the side that knows the dtype."""
    import cupy

    if array_family(x) == "torch":
        return cupy.from_dlpack(x.detach().float().contiguous())
    return cupy.ascontiguousarray(x, dtype=cupy.float32)


def to_family(out: Any, family: str, logical_dtype: str) -> Any:
    """``out`` (a CuPy array) returned as ``family``'s array type, without a copy."""
    if family != "torch":
        return out
    import torch

    t = torch.from_dlpack(out)
    return t.view(torch.bfloat16) if logical_dtype == "bfloat16" else t


@contextmanager
def launch_context(device: int, *arrays: Any):
    """Run CuPy launches on ``device`` and, when any input is a torch tensor, on torch's current
    stream there: the kernels are then ordered after the torch work that produced the inputs and
    before the torch work that consumes the result, with no synchronisation."""
    import cupy

    stream = nullcontext()
    if any(array_family(a) == "torch" for a in arrays if a is not None):
        import torch

        current = torch.cuda.current_stream(device)
        if hasattr(cupy.cuda.Stream, "from_external") and hasattr(current, "__cuda_stream__"):
            stream = cupy.cuda.Stream.from_external(current)
        else:  # CuPy < 14 or torch without the CUDA stream protocol
            stream = cupy.cuda.ExternalStream(current.cuda_stream, device)
    with cupy.cuda.Device(device), stream:
        yield
