"""The one decision of the torch ``attend``: which route serves a call (:func:`plan_attend`).

Routes: the one-chunk float path (:func:`subspace_ref_torch.attend.attend_one_chunk`), the C
kernel (:func:`subspace_ref_torch.cpu_kernels.kernel_attend`, spec R14) and the general torch
path (:func:`subspace_ref_torch.attend.attend_general`). The coefficient formats are read from
the state's declaration (``layout.key_format`` / ``value_format``, records in
:mod:`subspace_ref.formats`), one side at a time: the kernel reads each side in its own format.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from subspace_ref_torch import kernel_library as lib
from subspace_ref_torch import maps
from subspace_ref_torch.maps import used_chunks, work_dtype


class Way(enum.Enum):
    """The routes of the torch ``attend``."""

    ONE_CHUNK = "one chunk"
    KERNEL = "C kernel"
    GENERAL = "general"


@dataclass(frozen=True)
class Route:
    """What :func:`plan_attend` decided for a call.

    Attributes
    ----------
    way : Way
        The route.
    reason : str
        Why: what the state and the query are that made it so.
    chunks : int
        J, the chunks in use (1 on the one-chunk and kernel routes).
    lasting : bool
        Whether the decision holds for every later call with such queries while the state
        lives (only the kernel route of a static or rotating state): what
        ``TorchBackend.attend_route`` hands to ``subspace_ref.attend``.
    kernel_rows : bool
        General route only: whether int4 / int2 sides are dequantised by the kernels'
        ``low_bit_rows`` rather than by torch operations.
    """

    way: Way
    reason: str
    chunks: int = 1
    lasting: bool = False
    kernel_rows: bool = False


def plan_attend(q: torch.Tensor, state) -> Route:
    """The route of ``attend(q, state)`` on the torch backend.

    Parameters
    ----------
    q : torch.Tensor
        Queries, (N, H_q, d) or, for an unbatched state, (H_q, d).
    state : SubspaceState
        A state holding torch tensors.

    Returns
    -------
    Route
        One chunk for float coefficients in the work dtype of a static or rotating state
        without RoPE or exact tokens and at most VALUE_TILE tokens; the C kernel for any
        other one-chunk state whose sides are each int8, int4, int2 or float32 (not both float
        without RoPE), in float32 work on CPU tensors within the kernel's buffers; else general.
    """
    lay = state.layout
    dtype = work_dtype(q, state)
    rope = getattr(state.policy, "rope", None)
    lasting = state.policy.kind in ("static", "rotating")
    T = lay.num_tokens
    floats = lay.key_format == lay.value_format == "float"
    if floats and rope is None and state.window is None and lasting and lay.key_coef.dtype == dtype == lay.value_coef.dtype and T <= maps.VALUE_TILE:
        return Route(Way.ONE_CHUNK, f"one chunk of float coefficients in {dtype}, {T} <= {maps.VALUE_TILE} tokens")
    chunks = 1 if lasting else used_chunks(state)
    g = q.shape[-2] // lay.key_coef.shape[1]
    bits = (lib.side_bits(lay, "key"), lib.side_bits(lay, "value"))
    low_bit = bool(lay.side_format("key").low_bits or lay.side_format("value").low_bits)

    def ready() -> bool:  # what the kernels need of every call they serve, the library's build last
        return dtype == torch.float32 and q.is_cpu and lay.key_coef.is_cpu and lib.library() is not None and lib.kernel_sides(lay) is not None

    if chunks > 1:
        why = f"{chunks} chunks of bases"
    elif rope is not None and state.policy.kind != "static":
        why = f"pre-RoPE keys of a {state.policy.kind} state"
    elif floats and rope is None:
        why = "float coefficients without RoPE" + ("" if T <= maps.VALUE_TILE else f" beyond {maps.VALUE_TILE} tokens")
    elif dtype != torch.float32:
        why = f"work dtype {dtype}: the kernel computes in float32"
    elif None in bits:
        why = f"float coefficients stored as {lay.dtype}, not float32"
    elif g > lib.MAX_QUERIES or max(lay.key_coef.shape[-1], lay.value_coef.shape[-1]) > lib.MAX_ROW_BYTES or (rope is not None and q.shape[-1] > lib.MAX_DIM):
        why = "shape beyond the kernel's buffers"
    elif not (q.is_cpu and lay.key_coef.is_cpu):
        why = "not CPU tensors: the kernel runs on a CPU core"
    elif not ready():
        why = "arrays not lying as the kernel reads them" if lib.library_status()[0] else lib.library_status()[1]
    else:
        return Route(Way.KERNEL, f"one chunk of {lay.coefficients} coefficients", lasting=lasting)
    return Route(Way.GENERAL, why, chunks=chunks, kernel_rows=low_bit and ready())


__all__ = ["Route", "Way", "plan_attend"]
