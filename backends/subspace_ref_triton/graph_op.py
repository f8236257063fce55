"""The decode kernel as a torch operator, so a compiled decode step calls it without a graph
break: ``torch.ops.subspace_ref_triton.workspace_decode`` (spec/models.md M11.6).

``torch.compile`` cannot trace a Triton launch built by Python host code
(:meth:`~subspace_ref_triton.workspace.DecodeWorkspace.attend` picks its launch from the
layout); a ``torch.library`` custom operator is opaque to it. The operator reads only its
tensor arguments (under functionalization a compiled graph may hand it a copy of a buffer it
wrote in the same step), runs a registered :class:`DecodeWorkspace` over them and returns a
copy of the workspace's output. Its launches allocate nothing and read nothing on the host, so
a CUDA graph captures the step (``reduce-overhead``).

The workspace is found by its output tensor, passed as the ``handle`` argument: a tensor, not
an int, so a new cache's workspace is a new input of the same compiled graph rather than a new
constant that would recompile it (mark the handle's address static, as a cache's tensors are).

Importing this module registers the operator (in the ``subspace_ref_triton`` namespace only);
the graph cache imports it when it first builds a kernel layer.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch

from subspace_ref_triton.workspace import DecodeWorkspace

_WORKSPACES: "weakref.WeakValueDictionary[int, DecodeWorkspace]" = weakref.WeakValueDictionary()  # by their output's address
_ARRAYS: "weakref.WeakKeyDictionary[DecodeWorkspace, tuple[str, ...]]" = weakref.WeakKeyDictionary()


def register(workspace: DecodeWorkspace, arrays: list[str]) -> torch.Tensor:
    """The handle :func:`workspace_decode` finds ``workspace`` by (its output tensor), for as
    long as the caller holds the workspace; ``arrays``: the names of the layout arrays the
    caller will pass, in order."""
    _WORKSPACES[workspace.out.data_ptr()] = workspace
    _ARRAYS[workspace] = tuple(arrays)
    return workspace.out


@torch.library.custom_op("subspace_ref_triton::workspace_decode", mutates_args=())
def workspace_decode(q: torch.Tensor, arrays: list[torch.Tensor], num_tokens: torch.Tensor, handle: torch.Tensor, exact: list[torch.Tensor]) -> torch.Tensor:
    """Spec A3 of q (N, H_q, d) over the first ``num_tokens`` tokens of the layout of the
    workspace registered as ``handle``, with ``arrays`` (its registered names, in order: the
    coefficients and what their formats add) in place of its own: the output (N, H_q, d_v) in
    q's dtype, a copy. ``exact``: empty, or a windowed layer's exact sinks and ring ``[keys,
    values, count]`` and, for a head group that is not the whole layer, its KV heads' rows in
    them (spec/models.md M11.14 step 4: merged with the compressed part in one launch)."""
    ws = _WORKSPACES[handle.data_ptr()]
    layout = replace(ws.layout, **dict(zip(_ARRAYS[ws], arrays, strict=True)))
    return ws.attend(q, layout, num_tokens, exact or None).clone()


@workspace_decode.register_fake
def _(q, arrays, num_tokens, handle, exact):
    return q.new_empty((q.shape[0], q.shape[1], handle.shape[-1]))


__all__ = ["register", "workspace_decode"]
