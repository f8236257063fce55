"""A layer's compressed KV cache whose KV heads differ (spec/layer_state.md L1-L5): per head its
ranks, coefficient formats and basis kinds, as the allocator chooses them.

The heads of one configuration form a *head group*, held as one uniform
:class:`~subspace_ref.SubspaceState` over those heads (so every backend and kernel that reads a
uniform state reads a group unchanged). Sinks and the exact window are the layer's, one setting
for every group. Attention of a query head involves only its own KV head (spec A2), so
attending group by group and putting the outputs back in head order is the layer's attention:
each query head's one softmax over its sinks, compressed tokens and window (spec/window.md W3).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from subspace_ref import _checks, persistence
from subspace_ref.operations import _admission, _scans, attend, check_call
from subspace_ref.registry import get_backend
from subspace_ref.arrays import concat, itemsize, take
from subspace_ref.calibration import StaticBasis
from subspace_ref.basis_storage import NATIVE
from subspace_ref.formats import FLOAT, of_bits
from subspace_ref.layout import counted_nbytes
from subspace_ref.quantization import DEFAULT_GROUP
from subspace_ref.rope import RopeParams
from subspace_ref.state import SubspaceState


@dataclass(frozen=True)
class HeadConfig:
    """What one KV head stores (spec/layer_state.md L1): key and value ranks, each side's
    coefficient format (a :data:`subspace_ref.formats.FORMATS` name), and each side's basis kind:
    keys "post_rope" (a static basis over post-RoPE keys, plane bases included), "pre_rope"
    (spec/rope.md P2) or "identity" (rank d, keys stored as they are, quantised); values
    "subspace" or "identity".

    Parameters
    ----------
    rank_k, rank_v : int
        Key and value ranks (d and d_v for identity sides).
    key_format, value_format : str
        Coefficient formats, names of :data:`subspace_ref.formats.FORMATS` (default float).
    key_basis : str
        "post_rope", "pre_rope" or "identity".
    value_basis : str
        "subspace" or "identity".

    Examples
    --------
    >>> from subspace_ref import HeadConfig
    >>> HeadConfig(8, 8).key_format
    'float'
    """

    rank_k: int
    rank_v: int
    key_format: str = FLOAT
    value_format: str = FLOAT
    key_basis: str = "post_rope"
    value_basis: str = "subspace"

    @classmethod
    def of_allocation(cls, head) -> "HeadConfig":
        """The configuration of an :class:`~subspace_ref.allocation.HeadAllocation` (its bits name
        formats through :func:`~subspace_ref.formats.of_bits`; a plane basis is a post-RoPE one)."""
        kind = "post_rope" if head.key_basis == "plane" else head.key_basis
        return cls(int(head.rank_k), int(head.rank_v), of_bits(head.bits_k, "bits_k").name, of_bits(head.bits_v, "bits_v").name, kind, head.value_basis)


KEY_KINDS = ("post_rope", "pre_rope", "identity")
VALUE_KINDS = ("subspace", "identity")


@dataclass(frozen=True)
class HeadGroup:
    """KV heads ``heads`` (ascending) of one configuration, held by ``state`` (its head i is KV
    head ``heads[i]``). ``key_identity`` / ``value_identity``: that side's basis is the identity,
    held as an array for the kernels and not counted in :attr:`LayerState.nbytes`."""

    heads: tuple[int, ...]
    state: SubspaceState
    key_identity: bool = False
    value_identity: bool = False

    @property
    def flags(self) -> dict[str, bool]:
        return {"key_identity": self.key_identity, "value_identity": self.value_identity}


class LayerState:
    """One layer's compressed KV cache over KV heads of different configurations (spec/layer_state.md),
    built by :meth:`from_heads`; ``subspace_ref.attend(q, layer)`` attends over it on any
    backend (one call per head group), ``append`` takes (H, d) or (H, n, d) keys and values of
    all the layer's KV heads (a leading batch axis when built with ``batch=N``).

    Parameters
    ----------
    kv_heads : int
        The layer's KV heads.
    groups : sequence of HeadGroup
        Head groups covering each KV head exactly once (:meth:`from_heads` builds them).

    Examples
    --------
    >>> import numpy as np, subspace_ref as sr
    >>> rng = np.random.default_rng(0)
    >>> K, V = rng.standard_normal((2, 2, 64, 16))
    >>> basis = sr.calibrate(K, V, rank_k=8, rank_v=8)
    >>> layer = sr.LayerState.from_heads(basis, [sr.HeadConfig(8, 8, "int8", "int8"), sr.HeadConfig(16, 4, key_basis="identity")])
    >>> layer.append(K, V)
    LayerState(kv_heads=2, tokens=64, groups={[0]: int8, [1]: float})
    >>> sr.attend(rng.standard_normal((4, 16)), layer).shape
    (4, 16)
    """

    def __init__(self, kv_heads: int, groups: Sequence[HeadGroup]):
        groups = tuple(groups)
        heads = sorted(h for g in groups for h in g.heads)
        if heads != list(range(kv_heads)):
            raise ValueError(f"groups must cover each of the {kv_heads} KV heads exactly once, got heads {heads}")
        if not groups:
            raise ValueError("a layer state needs at least one head group")
        first = groups[0].state
        for g in groups:
            if g.state.heads != len(g.heads):
                raise ValueError(f"a group of heads {g.heads} holds a state of {g.state.heads} heads")
            if (g.state.batched, g.state.batch, g.state.d, g.state.d_v, g.state.num_tokens) != (first.batched, first.batch, first.d, first.d_v, first.num_tokens):
                raise ValueError("the groups' states must agree on batch, head sizes and tokens held")
        self.kv_heads = int(kv_heads)
        self.groups = groups

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_heads(
        cls,
        basis: StaticBasis,
        heads: Sequence[HeadConfig],
        *,
        rope: RopeParams | None = None,
        window: int = 0,
        sinks: int = 0,
        min_tokens: int = 0,
        group_size: int = DEFAULT_GROUP,
        batch: int | None = None,
        dtype: Any = None,
        bases: str = NATIVE,
    ) -> "LayerState":
        """A static layer state (spec/layer_state.md L2) whose KV head h stores what ``heads[h]``
        says, with the first ``heads[h].rank_k`` rows of ``basis.B[h]`` as its key basis and the
        first ``rank_v`` rows of ``basis.E[h]`` as its value basis (identity sides ignore them and
        have rank d / d_v). ``rope`` is required when a head's keys are pre-RoPE; ``window``,
        ``sinks``, ``min_tokens``, ``group_size``, ``batch``, ``dtype`` and ``bases`` are the
        :meth:`SubspaceState.static` keywords, shared by every head."""
        if not isinstance(basis, StaticBasis):
            raise TypeError(f"basis must be a StaticBasis, got {type(basis).__name__}")
        configs = [_checked(i, c, basis) for i, c in enumerate(heads)]
        if len(configs) != basis.heads:
            raise ValueError(f"heads must hold one HeadConfig per KV head of the basis ({basis.heads}), got {len(configs)}")
        if rope is None and any(c.key_basis == "pre_rope" for c in configs):
            raise ValueError("rope: heads with pre-RoPE key bases need the model's RopeParams (RopeParams.from_config(model.config))")
        dtype = _checks.numpy_float_dtype("dtype", basis.B.dtype if dtype is None else dtype)
        d, d_v = basis.B.shape[2], basis.E.shape[2]
        by_config: dict[HeadConfig, list[int]] = {}
        for h, c in enumerate(configs):
            by_config.setdefault(c, []).append(h)
        groups = []
        for c, hs in by_config.items():
            B = np.eye(d)[None].repeat(len(hs), 0) if c.key_basis == "identity" else basis.B[hs, : c.rank_k]
            E = np.eye(d_v)[None].repeat(len(hs), 0) if c.value_basis == "identity" else basis.E[hs, : c.rank_v]
            group_basis = StaticBasis(B=np.asarray(B, dtype=dtype), E=np.asarray(E, dtype=dtype), gamma=np.asarray(basis.gamma[hs], dtype=dtype),
                                      rank_k=(B.shape[1],) * len(hs), rank_v=(E.shape[1],) * len(hs))
            state = SubspaceState.static(
                group_basis, batch=batch, dtype=dtype, coefficients=(c.key_format, c.value_format), rope=rope if c.key_basis == "pre_rope" else None,
                bases=bases, window=window, min_tokens=min_tokens, sinks=sinks, group_size=group_size,
            )
            groups.append(HeadGroup(tuple(hs), state, c.key_basis == "identity", c.value_basis == "identity"))
        return cls(basis.heads, groups)

    # ----------------------------------------------------------------- shape facts
    @property
    def heads(self) -> int:
        """KV heads of the layer (what :meth:`append` takes)."""
        return self.kv_heads

    @property
    def batched(self) -> bool:
        return self.groups[0].state.batched

    @property
    def batch(self) -> int:
        return self.groups[0].state.batch

    @property
    def d(self) -> int:
        return self.groups[0].state.d

    @property
    def d_v(self) -> int:
        return self.groups[0].state.d_v

    @property
    def dtype(self):
        return self.groups[0].state.dtype

    @property
    def num_tokens(self) -> int:
        return self.groups[0].state.num_tokens

    @property
    def window(self):
        """The exact part's settings (every group has the same): the first group's ExactWindow or None."""
        return self.groups[0].state.window

    @property
    def nbytes(self) -> int:
        """Bytes the layer's cache holds (spec/layer_state.md L4): every group's :attr:`SubspaceState.nbytes`
        less the identity bases, which a deployment never stores."""
        return sum(g.state.nbytes - _identity_nbytes(g) for g in self.groups)

    @property
    def allocated_nbytes(self) -> int:
        """Bytes of every array the groups hold, identity bases and spare capacity included."""
        return sum(g.state.allocated_nbytes for g in self.groups)

    @property
    def full_cache_nbytes(self) -> int:
        """Bytes of the uncompressed K and V these tokens stand for, in the state's dtype."""
        return self.batch * self.kv_heads * self.num_tokens * (self.d + self.d_v) * itemsize(self.groups[0].state.layout.gamma)

    # ----------------------------------------------------------------- operations
    def append(self, keys: Any, values: Any) -> "LayerState":
        """Append one token (H, d) or a block (H, n, d) of keys and values of the layer's H KV
        heads (a leading batch axis for batched states). Each group takes its heads' rows; a
        failure in any group leaves every group as it was (spec/layer_state.md L3)."""
        axis = 1 if self.batched else 0
        for name, x, size in (("keys", keys, self.d), ("values", values, self.d_v)):
            shape = getattr(x, "shape", None)
            if shape is None or len(shape) < axis + 2 or shape[axis] != self.kv_heads or shape[-1] != size:
                want = "(N, H, d) or (N, H, n, d)" if self.batched else "(H, d) or (H, n, d)"
                raise ValueError(f"{name} must have shape {want} with H = {self.kv_heads} KV heads and last axis {size}, got {shape}")
        saved = [_snapshot(g.state) for g in self.groups]
        try:
            for g in self.groups:
                g.state.append(take(keys, list(g.heads), axis), take(values, list(g.heads), axis))
        except BaseException:
            for g, snap in zip(self.groups, saved):
                _restore(g.state, snap)
            raise
        return self

    def attend(self, q: Any, backend: str = "numpy", scale: float | None = None) -> Any:
        """Attention of q (H_q, d) -- or (N, H_q, d) -- over the layer: each group's query heads
        (those of its KV heads, GQA) attend over its state on ``backend``, and the outputs go back
        in query-head order (spec/layer_state.md L5). Also reached as ``subspace_ref.attend(q, layer)``.

        Once every group has admitted such queries (same type, dtype, device and shape) by that
        path and holds compressed tokens, a backend with ``attend_layer_route`` (spec L5.2; the
        torch backend on CPU: one call of the C kernels for every group) computes the layer in
        one step; it gives the same numbers."""
        axis = 1 if self.batched else 0
        shape = getattr(q, "shape", None)
        if shape is None or len(shape) != axis + 2 or shape[axis] % self.kv_heads:
            raise ValueError(f"q must have shape {'(N, H_q, d)' if self.batched else '(H_q, d)'} with H_q a multiple of the {self.kv_heads} KV heads, got {shape}")
        g = shape[axis] // self.kv_heads
        if len(self.groups) == 1:
            return attend(q, self.groups[0].state, backend=backend, scale=scale)
        key = _layer_admission(backend, q)
        if key is not None:  # L5.2: the backend's layer route, once every group admitted such queries
            route = self.groups[0].state.admitted.get(key, _NOT_ADMITTED)
            if route is not None and route is not _NOT_ADMITTED and all(grp.state.admitted.get(key) is route for grp in self.groups) and not _scans(backend):
                check_call(self, scale)
                out = route(q, self, scale)
                if out is not None:
                    return out
        rows, inverse = query_rows(self.groups, g)
        outs = [attend(take(q, r, axis), group.state, backend=backend, scale=scale) for r, group in zip(rows, self.groups)]
        out = take(concat(outs, axis), inverse, axis)
        # every group admitted such queries: ask the backend, once each holds compressed tokens
        # (a decision over arrays not yet allocated would not be the decode loop's)
        if key is not None and any(key not in grp.state.admitted for grp in self.groups) and all(grp.state.layout.num_tokens for grp in self.groups):
            ask = getattr(get_backend(backend), "attend_layer_route", None)
            route = ask(q, self) if ask is not None else None
            for grp in self.groups:
                grp.state.admitted[key] = route
        return out

    def reconstruct(self) -> tuple[np.ndarray, np.ndarray]:
        """(K_hat, V_hat) the layer stands for, heads in order (:meth:`SubspaceState.reconstruct`)."""
        axis = 1 if self.batched else 0
        parts = [g.state.reconstruct() for g in self.groups]
        order = np.argsort([h for g in self.groups for h in g.heads])
        K = np.concatenate([p[0] for p in parts], axis=axis)
        V = np.concatenate([p[1] for p in parts], axis=axis)
        return np.take(K, order, axis=axis), np.take(V, order, axis=axis)

    def copy(self) -> "LayerState":
        return LayerState(self.kv_heads, [HeadGroup(g.heads, g.state.copy(), g.key_identity, g.value_identity) for g in self.groups])

    def to(self, backend: str, device: Any = None, dtype: Any = None) -> "LayerState":
        """A copy whose groups' arrays belong to ``backend``'s family (:meth:`SubspaceState.to`)."""
        return LayerState(self.kv_heads, [HeadGroup(g.heads, g.state.to(backend, device, dtype), g.key_identity, g.value_identity) for g in self.groups])

    def save(self, path) -> None:
        """Write the layer to one file (spec/persistence.md §6): :func:`subspace_ref.persistence.save_layer`."""
        persistence.save_layer(self.kv_heads, [(g.heads, g.flags, g.state) for g in self.groups], path)

    @classmethod
    def load(cls, path) -> "LayerState":
        """Read a layer written by :meth:`save` (NumPy arrays)."""
        kv_heads, groups = persistence.load_layer_parts(path)
        return cls(kv_heads, [HeadGroup(heads, SubspaceState(*parts), **flags) for heads, flags, parts in groups])

    def __repr__(self) -> str:
        shown = ", ".join(f"{list(g.heads)}: {g.state.layout.coefficients}" for g in self.groups)
        return f"LayerState(kv_heads={self.kv_heads}, tokens={self.num_tokens}, groups={{{shown}}})"


# --------------------------------------------------------------------------------- helpers
def _checked(i: int, c: Any, basis: StaticBasis) -> HeadConfig:
    """``c`` as a HeadConfig (an allocation's head is converted), checked against the basis."""
    if not isinstance(c, HeadConfig):
        if all(hasattr(c, a) for a in ("rank_k", "rank_v", "bits_k", "bits_v", "key_basis")):
            c = HeadConfig.of_allocation(c)
        else:
            raise TypeError(f"heads[{i}] must be a HeadConfig or an allocation's HeadAllocation, got {type(c).__name__}")
    if c.key_basis not in KEY_KINDS:
        raise ValueError(f"heads[{i}].key_basis must be one of {KEY_KINDS}, got {c.key_basis!r}")
    if c.value_basis not in VALUE_KINDS:
        raise ValueError(f"heads[{i}].value_basis must be one of {VALUE_KINDS}, got {c.value_basis!r}")
    d, d_v = basis.B.shape[2], basis.E.shape[2]
    for side, rank, dim, identity, have in (
        ("rank_k", c.rank_k, d, c.key_basis == "identity", basis.rank_k[i] if i < basis.heads else 0),
        ("rank_v", c.rank_v, d_v, c.value_basis == "identity", basis.rank_v[i] if i < basis.heads else 0),
    ):
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < (1 if side == "rank_k" else 0):
            raise ValueError(f"heads[{i}].{side} must be {'a positive' if side == 'rank_k' else 'a non-negative'} int, got {rank!r}")
        if identity and rank != dim:
            raise ValueError(f"heads[{i}].{side} is {rank}; an identity basis has rank {dim} (the head size)")
        if not identity and rank > have:
            raise ValueError(f"heads[{i}].{side} is {rank}, above the basis's {have} rows for head {i} (head size {dim})")
    if c.rank_v == 0 and c.value_format != FLOAT:  # no coefficients to quantise: the format stores nothing either way (Q0 step 2)
        c = HeadConfig(c.rank_k, 0, c.key_format, FLOAT, c.key_basis, c.value_basis)
    return c


def _identity_nbytes(group: HeadGroup) -> int:
    names = (("key_bases", "key_basis_scale") if group.key_identity else ()) + (("value_bases", "value_basis_scale") if group.value_identity else ())
    return counted_nbytes(group.state, names) if names else 0


def _snapshot(state: SubspaceState) -> tuple:
    # a static append replaces the layout and window objects and writes arrays only past the
    # tokens they hold (spec/layer_state.md L3), so holding the old objects keeps the old state
    return state.layout, state.window, dict(state.admitted)


def _restore(state: SubspaceState, snap: tuple) -> None:
    state.layout, state.window, state.admitted = snap[0], snap[1], snap[2]


_NOT_ADMITTED = object()


def _layer_admission(backend: str, q: Any) -> tuple | None:
    """The key under which a group state remembers the layer route for queries like ``q``
    (spec/layer_state.md L5.2): :func:`subspace_ref.operations.attend`'s admission, marked as the layer's."""
    key = _admission(backend, q)
    return None if key is None else ("layer",) + key


def query_rows(groups: Sequence[HeadGroup], g: int) -> tuple[list[list[int]], list[int]]:
    """Per group, the query heads of its KV heads (query head i reads KV head i // g, GQA), and the
    permutation that puts the groups' outputs, concatenated in group order, back in head order
    (spec/layer_state.md L5.1)."""
    rows = [[h * g + i for h in group.heads for i in range(g)] for group in groups]
    order = [r for group_rows in rows for r in group_rows]
    return rows, sorted(range(len(order)), key=order.__getitem__)


__all__ = ["KEY_KINDS", "VALUE_KINDS", "HeadConfig", "HeadGroup", "LayerState", "query_rows"]
