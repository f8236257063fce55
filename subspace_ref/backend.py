"""The backend interface (spec A9): what a decode step needs from an array library.

A backend computes the same functions as the NumPy oracle (:mod:`subspace_ref.numpy_backend`)
on its own arrays. It declares what it accepts as data (``capabilities``, a
:class:`~subspace_ref.capabilities.Capabilities`); the one composer of
:mod:`subspace_ref.capabilities` turns the declaration into every reason a call is refused, so a
caller is never left guessing why.

Backends see a state through :class:`StateView`, what they read of it, so this module and the
registry sit below :mod:`subspace_ref.state` (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from subspace_ref.capabilities import Capabilities


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run on this machine, and if not, why; true when it can.

    Parameters
    ----------
    available : bool
        Whether it can run.
    reason : str
        Why not (empty when available).

    Examples
    --------
    >>> import subspace_ref as sr
    >>> bool(sr.get_backend("numpy").availability())
    True
    """

    available: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.available


@runtime_checkable
class StateView(Protocol):
    """What a backend reads of a state (spec A9; :class:`~subspace_ref.state.SubspaceState` is
    one): its policy (spec A6-A8 hyper-parameters), packed arrays (``layout``), sketches, exact
    window (spec/window.md W1), whether it is batched, its backend name (``engine``), the calls
    already admitted (:func:`subspace_ref.operations.attend`) and its shape."""

    policy: Any
    layout: Any
    sketches: Any
    window: Any
    batched: bool
    engine: str
    admitted: dict

    @property
    def kind(self) -> str: ...

    @property
    def batch(self) -> int: ...

    @property
    def heads(self) -> int: ...

    @property
    def kv_heads(self) -> int: ...

    @property
    def d(self) -> int: ...

    @property
    def d_v(self) -> int: ...

    @property
    def dtype(self) -> Any: ...

    @property
    def num_tokens(self) -> int: ...

    def chunk_bounds(self, head: int, seq: int = 0) -> list[tuple[int, int]]: ...


@runtime_checkable
class GroupView(Protocol):
    """What a backend reads of one head group of a layer (spec/layer_state.md L1):
    its KV heads ``heads`` (ascending, the layer's indices) and the uniform state holding them."""

    heads: tuple[int, ...]
    state: StateView


@runtime_checkable
class LayerView(Protocol):
    """What a backend reads of a layer whose KV heads differ (spec/layer_state.md;
    :class:`~subspace_ref.layer_state.LayerState` is one): its KV heads and head groups."""

    kv_heads: int
    groups: tuple[GroupView, ...]


#: A layer's decode route (``Backend.attend_layer_route``): ``route(q, layer, scale)`` gives the
#: layer's attention output, or None where it does not serve the call.
LayerRoute = Callable[[Any, LayerView, "float | None"], Any]


@runtime_checkable
class Backend(Protocol):
    """Operations of one decode step over a packed state (spec A9).

    ``array_family`` names the array type the backend reads and writes ("numpy", "torch" or
    "cupy"); a state whose arrays are of that family is read in place, with no conversion.
    ``capabilities`` declares what it supports; ``devices`` and ``dtypes`` repeat two of its
    fields. A backend may add ``call_reasons(q, state) -> list[str]``: refusals only the arrays
    themselves show (devices that differ, strides, shared memory), asked after the declaration.

    A backend may also add ``attend_route(q, state)``, asked once per admitted query kind (see
    :func:`subspace_ref.operations.attend`): None, or a function ``route(q, state, scale)`` that
    ``attend`` then calls first on every call with such queries, with q as the caller passed it
    ((H_q, d) for an unbatched state) and the final result to return, or None where it does not
    serve the call (the state changed), and then ``attend`` runs. It must take the state as an
    argument, not hold it (states are copied with what they admitted), and re-read from it
    whatever an append can change. A decode loop's calls then skip what is decided once, which
    matters because each Python step around a kernel costs time comparable to the kernel's
    (docs/benchmarks.md, "The hot path of the dispatch layer").

    Optional too, ``attend_layer_route(q, layer) -> LayerRoute | None`` (``layer`` a
    :class:`LayerView`): asked by :meth:`subspace_ref.LayerState.attend` once per query kind
    after a call group by group has admitted every group (spec/layer_state.md L5.2); a route
    ``route(q, layer, scale)`` then computes every group's attention in one step (q and the
    result in the layer's query-head order), or gives None, and the layer attends group by
    group. The same rules as for ``attend_route`` hold: take the layer as an argument, re-read it.

    Examples
    --------
    >>> import subspace_ref as sr
    >>> isinstance(sr.get_backend("numpy"), sr.Backend)
    True
    """

    name: str
    array_family: str
    capabilities: Capabilities
    devices: tuple[str, ...]
    dtypes: tuple[str, ...]

    def availability(self) -> Availability:
        """Whether this machine can run the backend (imports, devices), without raising."""

    def not_supported_reasons(self, q: Any, state: StateView) -> list[str]:
        """Every reason this backend refuses ``attend(q, state)``; empty when it accepts:
        ``subspace_ref.capabilities.attend_reasons(self.name, self, q, state)``."""

    def converter(self, device: Any = None, dtype: Any = None) -> Callable[[Any], Any]:
        """A function turning any supported array into this backend's family on ``device``;
        floating arrays are cast to ``dtype`` when given (used by ``SubspaceState.to``)."""

    def append(self, state: StateView, keys: Any, values: Any) -> None:
        """Append validated ``keys`` (N, H, n, d) and ``values`` (N, H, n, d_v) to ``state``.

        Follows spec A6/A7/A8 for the state's policy. Arrays stay in the backend's family and
        on their device. Called only after the state has validated its input, so a failure here
        is a bug, not bad input.
        """

    def attend(self, q: Any, state: StateView, scale: float | None) -> Any:
        """Coefficient-space attention (spec A2, A3) of ``q`` (N, H_q, d) over ``state``.

        Returns (N, H_q, d_v) in ``q``'s dtype, accumulated in at least float32.
        """
