"""State factories of :class:`~subspace_ref.hf.SubspaceCache`: what a layer's state is built from
on the layer's first ``update`` (``factory(spec: StateSpec) -> SubspaceState | LayerState``).
``static_states``, ``adaptive_states``, ``rotating_states`` and ``full_rank_states`` make the usual
ones; :class:`~subspace_ref.hf.allocated_states` makes the layer states of an allocation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from subspace_ref.calibration import StaticBasis
from subspace_ref.quantization import DEFAULT_GROUP
from subspace_ref.state import SubspaceState


@dataclass(frozen=True)
class StateSpec:
    """What a state factory is asked to build: the state of layer ``layer_idx`` for ``batch``
    sequences of ``heads`` KV heads with keys of size ``head_dim`` and values of size
    ``value_dim``, for a model computing in ``dtype`` on ``device``.

    Parameters
    ----------
    layer_idx, batch, heads, head_dim, value_dim : int
        The layer and the shapes of its keys (B, H, n, d) and values (B, H, n, d_v).
    dtype : torch.dtype
        The model's dtype.
    device : torch.device
        Where the keys are.

    Examples
    --------
    ::

        import torch
        from subspace_ref.hf import StateSpec, full_rank_states

        spec = StateSpec(0, batch=1, heads=2, head_dim=64, value_dim=64, dtype=torch.bfloat16, device=torch.device("cpu"))
        spec.state_dtype                             # dtype('float32')
        full_rank_states()(spec)                     # an empty static SubspaceState
    """

    layer_idx: int
    batch: int
    heads: int
    head_dim: int
    value_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def state_dtype(self) -> np.dtype:
        """The default floating dtype of states: float64 for float64 models, float32 otherwise
        (half-precision models still get float32 bases and sums, spec backend contract)."""
        return np.dtype(np.float64 if self.dtype == torch.float64 else np.float32)


StateFactory = Callable[[StateSpec], SubspaceState]


def per_layer(value: Any, layer_idx: int) -> Any:
    """``value`` for one layer: a callable is called with the layer index, a mapping is indexed
    by it, anything else (an int, a per-head tuple) applies to every layer."""
    if callable(value):
        return value(layer_idx)
    if isinstance(value, Mapping):
        return value[layer_idx]
    return value


def _side(compress: str) -> tuple[bool, bool]:
    if compress not in ("both", "keys", "values"):
        raise ValueError(f'compress must be "both", "keys" or "values", got {compress!r}')
    return compress in ("both", "keys"), compress in ("both", "values")


def identity_bases(heads: int, dim: int, dtype: Any = np.float64) -> np.ndarray:
    """(heads, dim, dim) identity bases: full rank, the side stored exactly.

    Parameters
    ----------
    heads, dim : int
        Number of heads and vector size.
    dtype : numpy dtype
        Of the result.

    Returns
    -------
    numpy.ndarray
        (heads, dim, dim), a writable copy.

    Examples
    --------
    ::

        from subspace_ref.hf import identity_bases

        identity_bases(2, 4).shape                   # (2, 4, 4)
    """
    return np.broadcast_to(np.eye(dim, dtype=dtype), (heads, dim, dim)).copy()


class static_states:
    """Factory of static states (spec A6) from one calibrated :class:`StaticBasis` per layer
    (a sequence indexed by layer, or a mapping). ``compress="keys"`` keeps values exact (identity
    value basis), ``"values"`` keeps keys exact; ``coefficients="int8"`` stores spec A10 INT8
    coefficients; ``dtype`` defaults to :attr:`StateSpec.state_dtype`; ``basis_format`` is how
    bases are stored (spec/storage.md S1, S6), by default "float16" below float64 (seed 001 §10)
    and "native" for float64 states (the exact oracle). ``window=W`` keeps the last W tokens
    exact, ``min_tokens=M`` compresses nothing below M tokens and ``sinks=S`` keeps the first S
    exact (spec/window.md; the
    :meth:`SubspaceState.static` keywords; an int, or per layer a mapping or a callable of the
    layer index); ``coefficients="int4" | "int2"`` stores spec/quantization.md Q2 codes, keys in
    groups of ``group_size`` tokens (also per layer).

    ``rope``: bases calibrated on pre-RoPE keys (spec/rope.md P2): a
    :class:`~subspace_ref.rope.RopeParams` (``RopeParams.from_config(model.config)``; or one per
    layer, a mapping or a callable) given to :meth:`SubspaceState.static`. The state un-rotates
    each appended key at its position (the cache's token index, which is the model's position
    for unpadded sequences) and rotates rebuilt keys back when attending: O(r d) per token
    (spec/roofline.md R13); every backend runs it.

    ``share``: "kv_head" (default) takes bases with one head per KV head, shared by the query
    heads of its group; "query_head" takes bases with one head per QUERY head (H_q = g H, e.g.
    :func:`subspace_ref.sharing.calibrate_query_heads`) and builds ``SubspaceState.static(...,
    query_group=g)`` states: g times the bytes of "kv_head" at the same ranks (values are stored
    per query head too; spec/sharing.md A3, B1). Any backend.

    Parameters
    ----------
    bases : sequence or mapping of StaticBasis
        One per compressed layer, indexed by layer.
    compress : str
        "both", "keys" or "values".
    coefficients : str
        "float", "int8", "int4" or "int2".
    dtype : numpy dtype, optional
        Of the states; default :attr:`StateSpec.state_dtype`.
    basis_format : str, optional
        Storage of the bases (:func:`default_basis_format`).
    rope : RopeParams, optional
        For pre-RoPE bases (or per layer).
    window, min_tokens, sinks, group_size : int, mapping or callable
        Exact window, compression threshold, sink tokens, low-bit key group (per layer allowed).
    share : str
        "kv_head" or "query_head".

    Returns
    -------
    static_states
        Called with a :class:`StateSpec`, returns an empty :class:`SubspaceState`.

    Raises
    ------
    ValueError
        On a bad ``compress`` or ``share``; when called, on bases whose heads or sizes differ
        from the model's.

    Examples
    --------
    ::

        import torch
        from subspace_ref.hf import capture, compress, static_states
        from subspace_ref.models.default_model import load_model

        model, config = load_model("default")
        ids = torch.tensor([list(b"def read_config(path):\\n    return json.load(open(path))\\n")])
        bases = capture(model, ids).calibrate(rank_k=16, rank_v=16)
        with compress(model, static_states(bases, coefficients="int8", window=16, sinks=4)) as kv:
            out = kv.generate(ids, max_new_tokens=8, do_sample=False)
    """

    def __init__(
        self,
        bases: Sequence[StaticBasis] | Mapping[int, StaticBasis],
        *,
        compress: str = "both",
        coefficients: str = "float",
        dtype: Any = None,
        basis_format: str | None = None,
        rope: Any = None,
        window: Any = 0,
        min_tokens: Any = 0,
        sinks: Any = 0,
        share: str = "kv_head",
        group_size: Any = DEFAULT_GROUP,
    ):
        self.bases = bases
        self.group_size = group_size
        self.keys, self.values = _side(compress)
        self.coefficients = coefficients
        self.dtype = dtype
        self.basis_format = basis_format
        self.rope = rope
        self.window, self.min_tokens, self.sinks = window, min_tokens, sinks
        if share not in ("kv_head", "query_head"):
            raise ValueError(f'share must be "kv_head" or "query_head", got {share!r}')
        self.share = share

    def __call__(self, spec: StateSpec) -> SubspaceState:
        basis = self.bases[spec.layer_idx]
        if not isinstance(basis, StaticBasis):
            raise TypeError(f"layer {spec.layer_idx}: expected a StaticBasis, got {type(basis).__name__}")
        group = 1
        if self.share == "query_head":  # spec/sharing.md A3: one basis head per query head
            if basis.B.shape[0] % spec.heads:
                raise ValueError(
                    f"layer {spec.layer_idx}: share='query_head' needs bases with a multiple of the model's {spec.heads} KV heads (one per query head), got {basis.B.shape[0]}"
                )
            group = basis.B.shape[0] // spec.heads
            spec = replace(spec, heads=basis.B.shape[0])
        if basis.B.shape[0] != spec.heads or basis.B.shape[2] != spec.head_dim or basis.E.shape[2] != spec.value_dim:
            raise ValueError(
                f"layer {spec.layer_idx}: basis has {basis.B.shape[0]} heads of size {basis.B.shape[2]}/{basis.E.shape[2]}, "
                f"the model has {spec.heads} KV heads of size {spec.head_dim}/{spec.value_dim}"
            )
        B = basis.B if self.keys else identity_bases(spec.heads, spec.head_dim, basis.B.dtype)
        E = basis.E if self.values else identity_bases(spec.heads, spec.value_dim, basis.E.dtype)
        gamma = basis.gamma if self.keys else np.ones_like(basis.gamma)
        if B is not basis.B or E is not basis.E:
            basis = StaticBasis.from_bases(B, E, gamma)
        dtype = self.dtype or spec.state_dtype
        return SubspaceState.static(
            basis,
            batch=spec.batch,
            dtype=dtype,
            coefficients=self.coefficients,
            bases=default_basis_format(self.basis_format, dtype),
            rope=per_layer(self.rope, spec.layer_idx),
            window=per_layer(self.window, spec.layer_idx),
            min_tokens=per_layer(self.min_tokens, spec.layer_idx),
            sinks=per_layer(self.sinks, spec.layer_idx),
            query_group=group,
            group_size=per_layer(self.group_size, spec.layer_idx),
        )


def default_basis_format(basis_format: str | None, dtype: Any) -> str:
    """spec/storage.md S6: the factories' basis format: ``basis_format`` when given; else
    "native" for float64 and float16 states (float16 bases are then native anyway) and
    "float16" for the others (seed 001 §10: "bases in FP16 by default")."""
    if basis_format is not None:
        return basis_format
    return "native" if np.dtype(dtype) in (np.float64, np.float16) else "float16"


class _online_states:
    kind = ""

    def __init__(
        self,
        *,
        rank_k: Any = None,
        rank_v: Any = None,
        compress: str = "both",
        coefficients: str = "float",
        dtype: Any = None,
        basis_format: str | None = None,
        **options: Any,
    ):
        self.keys, self.values = _side(compress)
        if self.keys and rank_k is None:
            raise ValueError("rank_k is required when keys are compressed")
        if self.values and rank_v is None:
            raise ValueError("rank_v is required when values are compressed")
        self.rank_k, self.rank_v = rank_k, rank_v
        self.coefficients = coefficients
        self.dtype = dtype
        self.basis_format = basis_format
        self.options = options

    def __call__(self, spec: StateSpec) -> SubspaceState:
        rank_k = per_layer(self.rank_k, spec.layer_idx) if self.keys else spec.head_dim
        rank_v = per_layer(self.rank_v, spec.layer_idx) if self.values else spec.value_dim
        options = {name: per_layer(value, spec.layer_idx) for name, value in self.options.items()}
        build = getattr(SubspaceState, self.kind)
        dtype = self.dtype or spec.state_dtype
        return build(
            spec.heads,
            spec.head_dim,
            spec.value_dim,
            rank_k=rank_k,
            rank_v=rank_v,
            batch=spec.batch,
            dtype=dtype,
            coefficients=self.coefficients,
            bases=default_basis_format(self.basis_format, dtype),
            **options,
        )


class adaptive_states(_online_states):
    """Factory of adaptive states (spec A7, seed 001 §5): ``rank_k``/``rank_v`` (an int, a
    per-head tuple, or per layer: a mapping or a callable of the layer index) and any keyword of
    :meth:`SubspaceState.adaptive` (``tau_k``, ``tau_v``, ``max_chunk``, ``warmup``,
    ``basis_format``: as in :class:`static_states`, the ``bases`` of the state;
    ``sketch_reset``, ``gamma``, ``ell_k``, ``ell_v``, ``window``, ``min_tokens``, ``lookahead``
    of spec/window.md, and the online-sketch variants ``ring_warm_start``, ``fd_stride``,
    ``reuse_angle`` of spec/sketch_variants.md; each may also be given per layer).
    ``compress="keys"``/``"values"`` stores the other side at full rank (rank = head size: every
    FD basis of that side is complete and stores it exactly up to rounding). Caveat from the
    state API: the warm-up length W is shared by both sides and at most the smaller rank, so
    chunk 0's full-rank-side basis holds only W warm-up rows; tokens after the warm-up and up
    to the first trigger (adaptive: usually the first of them fires) or the first refresh
    (rotating: up to ``refresh_every`` tokens, and rotation cannot restore them) are projected
    onto that W-dimensional span. Exactly one-sided compression needs a per-side warm-up in
    :class:`SubspaceState`; the static factory has none of this (identity basis).

    The states have :meth:`SubspaceState.adaptive`'s byte ceiling (spec A7.3, ``byte_ceiling=1.0``
    by default): a cache that replaces the stock one never holds more than it, whatever tau
    (``byte_ceiling=math.inf`` for the uncapped policy).

    Parameters
    ----------
    rank_k, rank_v : int, tuple, mapping or callable
        Key and value ranks (required for a compressed side).
    compress : str
        "both", "keys" or "values".
    coefficients : str
        "float" or a quantised format.
    dtype : numpy dtype, optional
        Of the states; default :attr:`StateSpec.state_dtype`.
    basis_format : str, optional
        Storage of the bases.
    **options
        Keywords of :meth:`SubspaceState.adaptive` (per layer allowed).

    Returns
    -------
    adaptive_states
        Called with a :class:`StateSpec`, returns an empty adaptive :class:`SubspaceState`.

    Raises
    ------
    ValueError
        If a compressed side has no rank, or ``compress`` is bad.

    Examples
    --------
    ::

        import torch
        from subspace_ref.hf import capture, compress, adaptive_states
        from subspace_ref.models.default_model import load_model

        model, config = load_model("default")
        ids = torch.tensor([list(b"def read_config(path):\\n    return json.load(open(path))\\n")])
        with compress(model, adaptive_states(rank_k=16, rank_v=16, tau_k=0.1, tau_v=0.1)) as kv:
            out = kv.generate(ids, max_new_tokens=8, do_sample=False)
    """

    kind = "adaptive"


class rotating_states(_online_states):
    """Factory of rotating states (spec A8, seed 003 SubSpace-A); arguments as
    :class:`adaptive_states` with :meth:`SubspaceState.rotating`'s keywords (``refresh_every``,
    ``window``, ``min_tokens``, ...).

    Parameters
    ----------
    rank_k, rank_v, compress, coefficients, dtype, basis_format
        As in :class:`adaptive_states`.
    **options
        Keywords of :meth:`SubspaceState.rotating` (per layer allowed).

    Returns
    -------
    rotating_states
        Called with a :class:`StateSpec`, returns an empty rotating :class:`SubspaceState`.

    Examples
    --------
    ::

        import torch
        from subspace_ref.hf import capture, compress, rotating_states
        from subspace_ref.models.default_model import load_model

        model, config = load_model("default")
        ids = torch.tensor([list(b"def read_config(path):\\n    return json.load(open(path))\\n")])
        with compress(model, rotating_states(rank_k=16, rank_v=16, refresh_every=16)) as kv:
            out = kv.generate(ids, max_new_tokens=8, do_sample=False)
    """

    kind = "rotating"


def full_rank_states(kind: str = "static", *, coefficients: str = "float", dtype: Any = None, **options: Any) -> StateFactory:
    """Factory of full-rank states: identity bases (static, gamma = 1), or rank = head size d on
    both sides (adaptive, rotating), whose FD bases are complete orthonormal bases. ``options``
    go to the adaptive/rotating constructor (e.g. ``refresh_every``).

    Static: keys and values are stored exactly (multiplying by 1 and adding zeros is exact), so
    with float coefficients the cache reproduces the stock ``DynamicCache`` up to summation
    order. Adaptive/rotating: exact only if the first W = d tokens' keys and values each span
    R^d: the warm-up (spec A7 step 0) adds a zero row for a token already in the span, and a
    later token outside that deficient span loses its component (until a trigger or refresh
    brings a complete basis, and for good in its own coefficients). A repeated token in the
    first d positions repeats its layer-0 value (values carry no position), so full rank is not
    exact then; tests/test_hf_cache.py uses distinct tokens.

    Parameters
    ----------
    kind : str
        "static", "adaptive" or "rotating".
    coefficients : str
        Coefficient format.
    dtype : numpy dtype, optional
        Of the states; default :attr:`StateSpec.state_dtype`.
    **options
        Keywords of the adaptive/rotating constructor (per layer allowed).

    Returns
    -------
    StateFactory
        ``factory(spec) -> SubspaceState``.

    Raises
    ------
    ValueError
        On another ``kind``.

    Examples
    --------
    ::

        import torch
        from subspace_ref.hf import capture, compress, full_rank_states
        from subspace_ref.models.default_model import load_model

        model, config = load_model("default")
        ids = torch.tensor([list(b"def read_config(path):\\n    return json.load(open(path))\\n")])
        with compress(model, full_rank_states()) as kv:     # the stock cache's logits, up to rounding
            out = kv.generate(ids, max_new_tokens=8, do_sample=False)
    """
    if kind not in ("static", "adaptive", "rotating"):
        raise ValueError(f'kind must be "static", "adaptive" or "rotating", got {kind!r}')

    def factory(spec: StateSpec) -> SubspaceState:
        state_dtype = dtype or spec.state_dtype
        if kind == "static":
            basis = StaticBasis.from_bases(identity_bases(spec.heads, spec.head_dim), identity_bases(spec.heads, spec.value_dim), 1.0)
            return SubspaceState.static(basis, batch=spec.batch, dtype=state_dtype, coefficients=coefficients)
        opts = {name: per_layer(value, spec.layer_idx) for name, value in options.items()}
        return getattr(SubspaceState, kind)(
            spec.heads,
            spec.head_dim,
            spec.value_dim,
            rank_k=spec.head_dim,
            rank_v=spec.value_dim,
            batch=spec.batch,
            dtype=state_dtype,
            coefficients=coefficients,
            **opts,
        )

    return factory


__all__ = ["StateFactory", "StateSpec", "adaptive_states", "default_basis_format", "full_rank_states", "identity_bases", "per_layer", "rotating_states", "static_states"]
