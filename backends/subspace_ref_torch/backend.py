"""``TorchBackend``: the Backend protocol (subspace_ref.backend) over torch tensors, CPU or CUDA.

This module imports torch lazily, so the backend can be registered, listed and asked for its
availability on a machine without torch.
"""

from __future__ import annotations

from typing import Any, Callable

from subspace_ref.arrays import array_family
from subspace_ref.backend import Availability
from subspace_ref.capabilities import Capabilities, attend_reasons


class TorchBackend:
    """Append (spec A6-A8) and coefficient-space attention (spec A2, A3) on torch tensors, with
    float or int8 (spec A10) coefficients.

    States must hold torch tensors (``state.to("torch", device=..., dtype=...)``); appends run
    on the state's device. float16/bfloat16 are computed in float32 and stored in their dtype.
    """

    name = "torch"
    array_family = "torch"
    # spec/window.md W3, W7-W9 in subspace_ref_torch.window; pre-RoPE states (spec/rope.md P2-P3) in append/attend;
    # of the sketch variants in its append (spec/sketch_variants.md S4) only both trigger orders (spec A7.2)
    capabilities = Capabilities(
        array_families=("torch",),
        devices=("cpu", "cuda"),
        dtypes=("float16", "bfloat16", "float32", "float64"),
        window=True,
        sinks=True,
        rope=True,
        sketch_variants=("trigger", "byte_ceiling", "track"),
    )
    devices = capabilities.devices
    dtypes = capabilities.dtypes

    def availability(self) -> Availability:
        """Whether torch imports (``Backend.availability``).

        Returns
        -------
        Availability
        """
        try:
            import torch  # noqa: F401
        except ImportError as err:
            return Availability(False, f"torch is not installed ({err}); pip install 'subspace_ref[torch]'")
        return Availability(True)

    def not_supported_reasons(self, q: Any, state) -> list[str]:
        """Every refusal of the declaration (``Backend.not_supported_reasons``).

        Parameters
        ----------
        q : any
        state : SubspaceState
            A state holding torch tensors.

        Returns
        -------
        list of str
        """
        return attend_reasons(self.name, self, q, state)

    def call_reasons(self, q: Any, state) -> list[str]:
        """Refusals only the arrays show (:func:`device_reasons`).

        Parameters
        ----------
        q : any
        state : SubspaceState
            A state holding torch tensors.

        Returns
        -------
        list of str
        """
        return device_reasons(q, state)

    def converter(self, device: Any = None, dtype: Any = None) -> Callable[[Any], Any]:
        """The converter of arrays to this backend (``Backend.converter``).

        Parameters
        ----------
        device : any, optional
        dtype : any, optional

        Returns
        -------
        callable
        """
        from subspace_ref_torch.convert import converter

        return converter(device, dtype)

    def append(self, state, keys, values) -> None:
        """Spec A6-A8 (:func:`subspace_ref_torch.append.append`).

        Parameters
        ----------
        state : SubspaceState
            A state holding torch tensors.
        keys, values : torch.Tensor
            (N, H, n, d) and (N, H, n, d_v).
        """
        from subspace_ref_torch.append import append

        append(state, keys, values)

    def attend(self, q, state, scale):
        """Spec A2/A3 (:func:`subspace_ref_torch.attend.attend`).

        Parameters
        ----------
        q : torch.Tensor
            (N, H_q, d).
        state : SubspaceState
            A state holding torch tensors.
        scale : float or None

        Returns
        -------
        torch.Tensor
            (N, H_q, d_v).
        """
        from subspace_ref_torch.attend import attend

        return attend(q, state, scale)

    def attend_route(self, q, state):
        """The decode route for queries like ``q`` (``Backend.attend_route``).

        Parameters
        ----------
        q : torch.Tensor
            Queries as the caller passes them.
        state : SubspaceState

        Returns
        -------
        callable or None
            :func:`~subspace_ref_torch.cpu_kernels.kernel_attend` where the plan routes such
            calls to the C kernel for the state's life (:attr:`~subspace_ref_torch.plan.Route.lasting`), else None.
        """
        from subspace_ref_torch.cpu_kernels import kernel_attend
        from subspace_ref_torch.plan import Way, plan_attend

        route = plan_attend(q, state)
        return kernel_attend if route.way is Way.KERNEL and route.lasting else None

    def attend_layer_route(self, q, layer):
        """The decode route of a layer's attention for queries like ``q`` (``Backend.attend_layer_route``).

        Parameters
        ----------
        q : torch.Tensor
            Queries as the caller passes them, (N, H_q, d) or (H_q, d).
        layer : LayerState
            A :class:`~subspace_ref.layer_state.LayerState` of torch tensors (``LayerView``).

        Returns
        -------
        callable or None
            A :class:`~subspace_ref_torch.cpu_kernels.LayerKernel` (one call of the C kernels
            for every head group) where the plan routes each group's queries to the C kernel
            for the state's life, else None (the layer attends group by group).
        """
        from subspace_ref_torch import kernel_library as lib
        from subspace_ref_torch.cpu_kernels import LayerKernel
        from subspace_ref_torch.plan import Way, plan_attend

        if not is_tensor(q) or q.dim() not in (2, 3) or q.shape[-2] % layer.kv_heads or lib.library() is None:
            return None
        g = q.shape[-2] // layer.kv_heads
        for group in layer.groups:
            rows = [h * g + i for h in group.heads for i in range(g)]
            route = plan_attend(q[..., rows, :], group.state)
            if route.way is not Way.KERNEL or not route.lasting:
                return None
        return LayerKernel()


def device_reasons(q: Any, state) -> list[str]:
    """The refusals every backend reading torch tensors shares beyond its declaration: q on
    another device than the state, the state's arrays spread over devices. None for arrays that
    are not torch tensors (the declaration refuses those).

    Parameters
    ----------
    q : any
        The query.
    state : SubspaceState
        A state holding torch tensors.

    Returns
    -------
    list of str
    """
    if not (is_tensor(q) and is_tensor(state.layout.key_coef)):
        return []
    sdev = state.layout.key_coef.device
    reasons = []
    if q.device != sdev:
        reasons.append(f"q is on {q.device} but the state is on {sdev}; move one of them")
    lay = state.layout
    devices = {x.device for x in (lay.key_coef, lay.value_coef, lay.key_bases, lay.value_bases, lay.gamma)}  # what attend reads
    if len(devices) > 1:
        reasons.append(f"the state's arrays are spread over devices {sorted(map(str, devices))}")
    return reasons


def is_tensor(x: Any) -> bool:
    """Whether ``x`` is a torch tensor.

    Parameters
    ----------
    x : any

    Returns
    -------
    bool
    """
    try:
        return array_family(x) == "torch"
    except ValueError:
        return False
