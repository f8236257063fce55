"""Backends by name: the built-in ones, and third-party ones from the ``subspace_ref.backends``
entry-point group. Nothing is imported until a backend is asked for, so ``import subspace_ref``
never imports torch, triton or cupy. Every backend, built-in or third-party, declares a
:class:`~subspace_ref.capabilities.Capabilities` as its ``capabilities`` attribute."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable

from subspace_ref.backend import Availability, Backend
from subspace_ref.capabilities import Capabilities

ENTRY_POINT_GROUP = "subspace_ref.backends"

_BUILTIN = {
    "numpy": "subspace_ref.numpy_backend:NumpyBackend",
    "torch": "subspace_ref_torch:TorchBackend",
    "triton": "subspace_ref_triton:TritonBackend",
    "cupy": "subspace_ref_cupy:CupyBackend",
}
_added: dict[str, Callable[[], Backend]] = {}
_instances: dict[str, Backend] = {}


@dataclass(frozen=True)
class BackendInfo:
    name: str
    available: bool
    reason: str

    def __str__(self) -> str:
        return f"{self.name}: " + ("available" if self.available else f"unavailable ({self.reason})")


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    """Register a backend at run time (entry points do the same for installed packages).

    Parameters
    ----------
    name : str
        The name ``backend=`` arguments use; registering a name again replaces its backend.
    factory : callable
        Called with no arguments on first use; returns the backend (a :class:`Backend`).

    Returns
    -------
    None

    Examples
    --------
    >>> import subspace_ref as sr
    >>> from subspace_ref.numpy_backend import NumpyBackend
    >>> sr.register_backend("my-numpy", NumpyBackend)
    >>> sr.get_backend("my-numpy").array_family
    'numpy'
    """
    _added[name] = factory
    _instances.pop(name, None)


def _sources() -> dict[str, Any]:
    found: dict[str, Any] = dict(_BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep)
    found.update(_added)
    return found


def registered() -> list[str]:
    return sorted(_sources())


def _load(name: str) -> Backend:
    source = _sources()[name]
    if isinstance(source, str):
        module, attr = source.split(":")
        return getattr(importlib.import_module(module), attr)()
    if hasattr(source, "load"):
        return source.load()()
    return source()


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``, imported and built on first use.

    Parameters
    ----------
    name : str
        A registered name: "numpy", "torch", "triton", "cupy", an entry point's or one given to
        :func:`register_backend`.

    Returns
    -------
    Backend
        The one instance of that backend.

    Raises
    ------
    ValueError
        For an unregistered name, listing the registered ones.
    RuntimeError
        When the backend's module cannot be imported (carrying the import error).

    Examples
    --------
    >>> import subspace_ref as sr
    >>> sr.get_backend("numpy").name
    'numpy'
    """
    if isinstance(name, str) and name in _instances:
        # fast path: every append and attend asks, and scanning entry points is slow (docs/benchmarks.md)
        return _instances[name]
    if not isinstance(name, str) or name not in _sources():
        raise ValueError(f"unknown backend {name!r}; registered backends: {', '.join(registered())}")
    if name not in _instances:
        try:
            _instances[name] = _load(name)
        except (ImportError, AttributeError) as err:
            raise RuntimeError(f"backend {name!r} cannot be imported: {err}") from err
    return _instances[name]


def backend_availability(name: str) -> Availability:
    try:
        return get_backend(name).availability()
    except RuntimeError as err:
        return Availability(False, str(err))


def declared_capabilities() -> dict[str, Capabilities | None]:
    """Every registered backend's declared capabilities (None for one that cannot be imported
    or declares none), whether or not it runs on this machine."""
    out: dict[str, Capabilities | None] = {}
    for name in registered():
        try:
            caps = getattr(get_backend(name), "capabilities", None)
        except RuntimeError:
            caps = None
        out[name] = caps if isinstance(caps, Capabilities) else None
    return out


def backends() -> list[BackendInfo]:
    """Every registered backend with whether it runs on this machine and, if not, why.

    Returns
    -------
    list of BackendInfo
        One per registered name, sorted: ``name``, ``available`` and ``reason`` (empty when available).

    Examples
    --------
    >>> import subspace_ref as sr
    >>> [str(b) for b in sr.backends() if b.name == "numpy"]
    ['numpy: available']
    """
    out = []
    for name in registered():
        a = backend_availability(name)
        out.append(BackendInfo(name, a.available, a.reason))
    return out
