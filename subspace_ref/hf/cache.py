"""``SubspaceCache``: a transformers ``Cache`` whose layers hold :class:`~subspace_ref.SubspaceState`s.

Usage::

    from subspace_ref.hf import SubspaceCache, static_states, use_subspace_attention

    use_subspace_attention(model)                       # once per model (see attention.py)
    cache = SubspaceCache(model.config, static_states(bases), backend="torch")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=32, do_sample=False)

Each layer's state is built on the layer's first ``update`` by a *state factory*, a callable
``factory(spec: StateSpec) -> SubspaceState`` (``static_states``, ``adaptive_states``,
``rotating_states`` and ``full_rank_states`` make the usual ones), or given ready-made as one
state per layer. The cache stores only what the state stores (coefficients, bases, sketches):
``update`` hands the new post-RoPE keys and values to the attention function, which appends
them to the state and computes attention from it (spec/models.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

import subspace_ref
from subspace_ref.arrays import clone
from subspace_ref.calibration import StaticBasis
from subspace_ref.capabilities import require, state_reasons
from subspace_ref.hf import attention as _attn
from subspace_ref.layout import BY_NAME, FIXED, held_arrays, mapped_parts
from subspace_ref.operations import select_sequences
from subspace_ref.quantization import DEFAULT_GROUP
from subspace_ref.registry import get_backend
from subspace_ref.state import SubspaceState


@dataclass(frozen=True)
class StateSpec:
    """What a state factory is asked to build: the state of layer ``layer_idx`` for ``batch``
    sequences of ``heads`` KV heads with keys of size ``head_dim`` and values of size
    ``value_dim``, for a model computing in ``dtype`` on ``device``."""

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
    """(heads, dim, dim) identity bases: full rank, the side stored exactly."""
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
    per query head too; spec/sharing.md A3, B1). Any backend."""

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
    (``byte_ceiling=math.inf`` for the uncapped policy)."""

    kind = "adaptive"


class rotating_states(_online_states):
    """Factory of rotating states (spec A8, seed 003 SubSpace-A); arguments as
    :class:`adaptive_states` with :meth:`SubspaceState.rotating`'s keywords (``refresh_every``,
    ``window``, ``min_tokens``, ...)."""

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
    exact then; tests/test_hf_cache.py uses distinct tokens."""
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


# ----------------------------------------------------------------------------- the cache
class SubspaceLayer(CacheLayerMixin):
    """One layer of a :class:`SubspaceCache`: a :class:`SubspaceState` and nothing else.

    ``keys`` and ``values`` stay ``None``: the full K/V is never kept. Between a layer's
    ``update`` and its attention call the new tokens are *pending* (held only for that call).
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: "SubspaceCache", layer_idx: int, state: SubspaceState | None = None):
        super().__init__()
        self.cache = cache  # a plain reference: a deep copy of the cache copies its layers with it
        self.layer_idx = layer_idx
        self._given = state
        self.state: SubspaceState | None = None
        self.pending_keys: torch.Tensor | None = None
        self.pending_values: torch.Tensor | None = None
        self._forward_start = 0  # tokens held when the current forward began (rollback point)
        self._restore_point: tuple[SubspaceState, dict] | None = None  # see keep_restore_point
        self._forward_tokens: tuple | None = None  # the current forward's keys and values, while a restore point is kept

    def __repr__(self) -> str:
        return f"SubspaceLayer({self.layer_idx}, {self.state!r})"

    # -- CacheLayerMixin
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, d = key_states.shape
        spec = StateSpec(self.layer_idx, B, H, d, value_states.shape[-1], key_states.dtype, key_states.device)
        state = self._given if self._given is not None else self.cache.factory(spec)
        if not isinstance(state, SubspaceState):
            raise TypeError(f"layer {self.layer_idx}: the state factory returned {type(state).__name__}, expected a SubspaceState")
        self.state = self.cache.adopt(state, spec)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True
        self._forward_start = 0  # a layer built during a forward: its restore point is the empty state
        self.keep_restore_point()

    @torch.compiler.disable(reason="a SubspaceCache appends and attends in Python outside any graph")
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the new post-RoPE keys/values (B, H, n, d) as pending and return them tagged; the
        attention function appends them to the state and attends (see attention.py). Under
        ``torch.compile`` this and the attention function run eagerly (graph breaks around them)."""
        self.cache.check_model_attention()
        if self.pending_keys is not None:
            self._clear_pending()  # the abandoned forward leaves nothing behind
            raise RuntimeError(
                f"layer {self.layer_idx}: the previous update was never consumed by the attention function (an earlier forward "
                f"failed, or the model does not pass the cache's keys to attn_implementation={_attn.ATTN_IMPLEMENTATION!r})"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        st = self.state
        if key_states.ndim != 4 or key_states.shape[0] != st.batch or key_states.shape[1] != st.kv_heads or key_states.shape[3] != st.d:
            raise ValueError(f"layer {self.layer_idx}: keys of shape {tuple(key_states.shape)} do not fit the state {st!r} (batch {st.batch})")
        self.cache.begin_forward(self.layer_idx)
        self.pending_keys, self.pending_values = key_states, value_states
        setattr(key_states, _attn.TAG, self)
        return key_states, value_states

    def get_seq_length(self) -> int:
        committed = 0 if self.state is None else self.state.num_tokens
        return committed + (0 if self.pending_keys is None else self.pending_keys.shape[2])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state = None
        self._clear_pending()
        self.is_initialized = False

    def offload(self):  # the state stays where the backend put it
        pass

    def prefetch(self):
        pass

    # -- editing the held tokens (crop for assisted decoding, batch indexing for beams)
    def truncate_reason(self) -> str | None:
        """Why the last tokens of this layer's state cannot be dropped by cutting its arrays
        (None: they can, at any length). Only states whose stored coefficients are their whole
        history qualify: static states without an exact window or sinks. The others are cut
        through the restore point of the current forward (:meth:`crop`)."""
        st = self.state
        if st is None:
            return None
        if st.kind != "static":
            return f"the {st.kind} state's sketches have absorbed the dropped tokens"
        if st.window is not None:
            return "tokens that left the exact window are projected and cannot be made exact again"
        if st.layout.low_bits:
            return f"{st.layout.coefficients} keys are quantised in groups of {st.layout.group} tokens: a finished group cannot give its tokens back to the float tail"
        return None

    @property
    def is_croppable(self) -> bool:
        """Every layer can be cropped, back to the start of its last forward at least (:meth:`crop`)."""
        return True

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens (static states: coefficients are per token)."""
        if self.state is not None and num_tokens < self.state.num_tokens:
            self.state.layout = replace(self.state.layout, num_tokens=num_tokens)

    def keep_restore_point(self) -> None:
        """At the start of a forward: remember what :meth:`restore` needs to bring a state that
        cannot be truncated back to its present tokens. Appends write only rows and chunk slots
        past the state's counts (spare until then), copy bases and coefficients in use before
        rewriting them (warm-up rows, rotating refreshes: ``PackedLayout.with_private_bases``,
        private rotated coefficients), and replace the layout, sketch and window objects and
        their small fixed-size arrays (sketch buffers, exact window and sinks, key tail, chunk
        counts) rather than write them. So the restore point shares the state's objects; each
        fixed-size torch array's version counter is kept with it and checked by :meth:`restore`
        (an in-place write since would be a bug: it raises rather than restore a changed state),
        and arrays of other families, which have no counter, are copied. (Crop also needs the
        forward's tokens, which :meth:`attend_pending` keeps for forwards of at most
        ``max_crop_block`` tokens, so a prefill's are not held twice.)"""
        self._restore_point = self._forward_tokens = None
        st = self.state
        if st is None or self.truncate_reason() is None:
            return
        fixed = {name: x for name, x in held_arrays(st).items() if BY_NAME[name].axis == FIXED}
        if all(isinstance(x, torch.Tensor) for x in fixed.values()):
            point = SubspaceState(st.policy, st.layout, st.sketches, st.batched, st.engine, st.window)
            self._restore_point = (point, {name: (x, x._version) for name, x in fixed.items()})
        else:
            parts = mapped_parts(st, lambda a, x: clone(x) if a.axis == FIXED else x)
            self._restore_point = (SubspaceState(st.policy, parts["layout"], parts["sketches"], st.batched, st.engine, parts["window"]), {})

    def restore(self) -> None:
        """Bring the state back to the start of the current forward (see :meth:`keep_restore_point`)."""
        point, versions = self._restore_point
        written = [name for name, (x, version) in versions.items() if x._version != version]
        if written:
            raise RuntimeError(f"layer {self.layer_idx}: the state's {', '.join(written)} changed in place since the forward began; cannot restore it")
        self.state, self._restore_point = point, None

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (transformers' convention: negative).

        Static states without a window and with float or int8 coefficients: their coefficients
        are cut, to any length. Others (windowed, adaptive, rotating, int4/int2 whose key groups
        are quantised as a whole): the state goes back to its restore point at the start
        of the last forward and the forward's tokens up to the new length are appended again,
        which gives exactly the state of appending only those tokens; so they crop only back
        to the start of the last forward of at most ``max_crop_block`` tokens (what assisted
        and prompt-lookup decoding do: they crop the rejected candidates of the last forward)."""
        if tokens_to_remove > 0:
            raise ValueError(f"tokens_to_remove: expected a negative number of tokens to remove, got {tokens_to_remove}")
        if not tokens_to_remove or self.state is None:
            return
        keep = max(0, self.state.num_tokens + tokens_to_remove)
        if self.truncate_reason() is None:
            self.truncate(keep)
            return
        start = self._forward_start
        if self._forward_tokens is None or keep < start:
            reason = f"{self.truncate_reason()}; it crops back only to the start of its last forward of at most {self.cache.max_crop_block} tokens"
            require([reason], f"layer {self.layer_idx}: cannot crop to {keep} tokens")
        keys, values = self._forward_tokens
        self.restore()
        self._forward_tokens = None
        if keep > start:
            self._append(keys[:, :, : keep - start], values[:, :, : keep - start])

    def _index_batch(self, index: Any) -> None:
        if self.state is None or self.state.num_tokens == 0 and self._given is None:
            self.state, self.is_initialized = None, False  # built again, at the new batch size
            return
        st = self.state
        if isinstance(st.layout.key_coef, np.ndarray):
            index = np.asarray(index.cpu() if isinstance(index, torch.Tensor) else index)
        else:
            index = torch.as_tensor(index, device=st.layout.key_coef.device)
        self.state = select_sequences(st, index)  # every state array gathered along the batch axis
        self._restore_point = self._forward_tokens = None  # taken at the old batch

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._index_batch(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        batch = 0 if self.state is None else self.state.batch
        self._index_batch(torch.arange(batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._index_batch(indices)

    # -- attention
    def _clear_pending(self) -> None:
        if self.pending_keys is not None:
            try:
                delattr(self.pending_keys, _attn.TAG)
            except AttributeError:
                pass
        self.pending_keys = self.pending_values = None

    def abandon(self) -> None:
        """The forward failed: drop what is pending and give back every layer's tokens of this
        forward (static states; an online state's sketches cannot forget, see spec/models.md)."""
        self._clear_pending()
        self.cache.rollback_forward()

    def _append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        st = self.state
        if isinstance(st.layout.key_coef, np.ndarray):
            keys, values = _to_numpy(keys, st.dtype), _to_numpy(values, st.dtype)
        st.append(keys, values)

    def _attend_one(self, q: torch.Tensor, state: SubspaceState, scale: float) -> torch.Tensor:
        """subspace_ref.attend of q (B, H_q, d) over ``state``, back as q's tensor type."""
        x = _to_numpy(q, state.dtype) if isinstance(state.layout.key_coef, np.ndarray) else q
        out = subspace_ref.attend(x, state, backend=self.cache.backend, scale=scale)
        return out if isinstance(out, torch.Tensor) else torch.from_numpy(np.asarray(out)).to(device=q.device, dtype=q.dtype)

    def _attend_block(self, q: torch.Tensor, first_position: int, scale: float, exact: _attn.ExactPart | None, **masking: Any) -> torch.Tensor:
        """Queries q (B, H_q, m, d) at positions first_position.. over the state holding exactly
        tokens 0..first_position+m-1, each query causally (static/adaptive, or a rotating state
        with no refresh after first_position's append); ``exact``: the windowed state's
        :func:`~subspace_ref.hf.attention.exact_part` taken before the block was appended."""
        st = self.state
        if q.shape[2] == 1 and not any(v is not None for v in masking.values()):
            return self._attend_one(q[:, :, 0], st, scale)[:, :, None]
        if self.cache.prefill == "attend":
            views = [self._attend_one(q[:, :, i], _attn.prefix_view(st, first_position + i + 1), scale) for i in range(q.shape[2])]
            return torch.stack(views, dim=2)
        return _attn.causal_attention(q, st, first_position, scale, exact=exact, **masking)

    def masked_reason(self) -> str | None:
        """Why this layer's state cannot attend under a per-token mask or soft-capping (None: it
        can, by :func:`~subspace_ref.hf.attention.causal_attention`)."""
        st = self.state
        if st.kind == "rotating":
            return "a rotating state rewrites past coefficients at each refresh"
        if getattr(st.policy, "rope", None) is not None:
            return "a pre-RoPE state rotates keys by their cache index, which is not the position of a padded sequence"
        return None

    def _segments(self, n: int) -> list[tuple[int, int]]:
        """The pending block's queries cut into runs [a, b) that one causal evaluation covers:
        the whole block, except that a rotating state's query whose append runs a refresh
        (spec A8: all stored coefficients rewritten) stands alone; an int4/int2 state's query
        whose append finishes a key group (spec/quantization.md Q2: the group's tokens leave the
        float tail for their quantised reading) starts a run, so that no query sees a group that
        a later token of its run finished (nor scales that depend on tokens after it); and
        ``prefill="attend"`` on a windowed state (whose prefix views would need the evicted
        exact tokens) goes token by token."""
        st = self.state
        if st.window is not None and self.cache.prefill == "attend":
            return [(i, i + 1) for i in range(n)]
        if st.kind != "rotating" and not st.layout.low_bits:
            return [(0, n)]
        T0 = st.num_tokens
        compressed, _ = _attn.compressed_visible(st, np.arange(T0, T0 + n + 1))  # before and after each query's append
        cuts = {0, n}
        if st.layout.low_bits:
            G = st.layout.group
            cuts.update(np.flatnonzero(compressed[1:] // G > compressed[:-1] // G).tolist())
        if st.kind == "rotating":
            m, W = st.policy.refresh_every, st.policy.warmup
            t = np.arange(int(compressed[-1]))
            refreshed = np.concatenate([[0], np.cumsum((t >= W) & ((t + 1 - W) % m == 0))])  # refreshes among the first k compressed
            alone = np.flatnonzero(refreshed[compressed[1:]] > refreshed[compressed[:-1]])
            cuts.update(alone.tolist() + (alone + 1).tolist())
        cuts = sorted(cuts)
        return list(zip(cuts[:-1], cuts[1:]))

    def attend_pending(self, query: torch.Tensor, scale: float, *, mask: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
        """Append the pending tokens and attend ``query`` (B, H_q, n, d) -> (B, H_q, n, d_v), each
        query position p seeing the state exactly as token-by-token decoding would at step p.

        One append of the n tokens (one call to the backend, which moves a block whole), then
        :func:`causal_attention` (or one ``attend`` call when n = 1), whatever the state kind
        but rotating: a refresh rewrites all stored coefficients, so a query whose append
        runs one is appended and attended alone (``attend`` on the refreshed state), the runs
        between them in one block each; int4/int2 states start a run at each query whose append
        finishes a key group (:meth:`_segments`). A windowed state's queries see its compressed part as
        it was at their step and every other token of theirs exactly (spec/window.md W2, W3;
        :func:`~subspace_ref.hf.attention.exact_part`). A ``mask`` that is not the plain causal
        one (left padding, a sliding window) or ``softcap`` is applied to the logits by
        :func:`causal_attention` (refused for rotating and pre-RoPE states).
        """
        keys, values = self.pending_keys, self.pending_values
        st = self.state
        T0 = st.num_tokens
        n = keys.shape[2]
        if query.shape[2] != n:
            raise ValueError(f"layer {self.layer_idx}: {query.shape[2]} queries for {n} new tokens")
        if mask is not None or softcap is not None:
            what = "soft-capping" if mask is None else "a padding or sliding-window mask"
            require([self.masked_reason()] if self.masked_reason() else [], f"layer {self.layer_idx}: {what}")
        self._clear_pending()
        if self._restore_point is not None and n <= self.cache.max_crop_block:
            self._forward_tokens = (keys, values)
        outs = []
        for a, b in self._segments(n):
            exact = _attn.exact_part(st, keys[:, :, a:b], values[:, :, a:b])
            self._append(keys[:, :, a:b], values[:, :, a:b])
            part_mask = None if mask is None else mask[:, :, a:b, : T0 + b]
            outs.append(self._attend_block(query[:, :, a:b], T0 + a, scale, exact, mask=part_mask, softcap=softcap))
        return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


def _to_numpy(x: torch.Tensor, dtype) -> np.ndarray:
    x = x.detach()
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    return x.cpu().numpy().astype(dtype, copy=False)


class SubspaceCache(Cache):
    """A transformers ``Cache`` whose layers each hold a :class:`SubspaceState` (spec/models.md).

    ``config``: the model's config (its layers and their types; and the cache checks that the
    model selected the subspace attention, see :func:`~subspace_ref.hf.use_subspace_attention`).
    ``states``: a state factory (``factory(StateSpec) -> SubspaceState``, called on a layer's
    first update) or one ready state per layer. ``backend``: the registered backend
    ``subspace_ref.attend`` uses; states are converted to its array family (``state.to(...)``)
    on the keys' device, and on a torch-family backend to the model's dtype when the model
    computes in float16/bfloat16 (the backend accumulates in float32). ``prefill``:
    ``"coefficient"`` (vectorised causal coefficient-space attention, default) or ``"attend"``
    (one ``subspace_ref.attend`` call per prompt position; slow, for cross-checks).
    ``sliding``: the layers a config marks as sliding-window (Mistral, Gemma2): ``"stock"``
    keeps transformers' own sliding cache layer for them (only full-attention layers are
    compressed), ``"compress"`` compresses them too (the model's sliding mask then restricts
    each query to its window in coefficient space; the compressed tokens stay stored).
    ``max_crop_block``: windowed, adaptive and rotating layers keep a restore point at the start
    of each forward (a failed forward goes back to it) and, for forwards of at most this many
    tokens, the forward's keys and values, so ``crop`` (assisted and prompt-lookup decoding) can
    take back that forward's tokens exactly (:meth:`SubspaceLayer.crop`).
    """

    def __init__(
        self,
        config,
        states: StateFactory | Sequence[SubspaceState],
        *,
        backend: str = "torch",
        prefill: str = "coefficient",
        sliding: str = "stock",
        max_crop_block: int = 64,
    ):
        from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, get_layer_types_and_kwargs

        if prefill not in ("coefficient", "attend"):
            raise ValueError(f'prefill must be "coefficient" or "attend", got {prefill!r}')
        if sliding not in ("stock", "compress"):
            raise ValueError(f'sliding must be "stock" or "compress", got {sliding!r}')
        self.config = config
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        num_layers = text.num_hidden_layers
        if callable(states):
            self.factory, given = states, [None] * num_layers
        else:
            given = list(states)
            if len(given) != num_layers:
                raise ValueError(f"{len(given)} states given for a model of {num_layers} layers")
            self.factory = None
        impl = get_backend(backend)  # ValueError naming the registered backends
        available = impl.availability()
        if not available:
            raise RuntimeError(f"backend {backend!r} is not available on this machine: {available.reason}")
        self.backend = backend
        self.family = impl.array_family
        self.prefill = prefill
        self.sliding = sliding
        if isinstance(max_crop_block, bool) or not isinstance(max_crop_block, int) or max_crop_block < 0:
            raise ValueError(f"max_crop_block must be an int >= 0, got {max_crop_block!r}")
        self.max_crop_block = max_crop_block
        compressed = ("full_attention", "sliding_attention") if sliding == "compress" else ("full_attention",)
        types, kwargs = get_layer_types_and_kwargs(text)
        layers = [
            SubspaceLayer(self, i, given[i]) if kind in compressed else DYNAMIC_LAYER_TYPE_MAPPING[kind](**kw)
            for i, (kind, kw) in enumerate(zip(types, kwargs))
        ]
        super().__init__(layers=layers)

    @classmethod
    def for_model(cls, model, states: StateFactory | Sequence[SubspaceState], **kwargs: Any) -> "SubspaceCache":
        """Select the subspace attention implementation for ``model`` and return a cache for it."""
        _attn.use_subspace_attention(model)
        return cls(model.config, states, **kwargs)

    def check_model_attention(self) -> None:
        impl = getattr(self.config, "_attn_implementation", _attn.ATTN_IMPLEMENTATION)
        if not _attn.is_subspace(impl):
            raise RuntimeError(
                f"the model uses attn_implementation={impl!r}, which would attend only the new tokens of a SubspaceCache; "
                "open subspace_ref.hf.compress(model, ...) or call subspace_ref.hf.use_subspace_attention(model) first"
            )

    @property
    def subspace_layers(self) -> list[SubspaceLayer]:
        return [layer for layer in self.layers if isinstance(layer, SubspaceLayer)]

    def begin_forward(self, layer_idx: int) -> None:
        """Called by each layer's update: the first compressed layer's update starts a forward,
        whose tokens :meth:`rollback_forward` can give back."""
        layers = self.subspace_layers
        if layers and layers[0].layer_idx == layer_idx:
            for layer in layers:
                layer._forward_start = layer.get_seq_length()
                layer.keep_restore_point()

    def rollback_forward(self) -> None:
        """Give back the tokens the current forward appended (static states by truncation, the
        others through their restore point when the forward kept one)."""
        for layer in self.subspace_layers:
            layer._clear_pending()
            if layer.state is None:
                continue
            if layer.truncate_reason() is None:
                layer.truncate(layer._forward_start)
            elif layer._restore_point is not None:
                layer.restore()

    def adopt(self, state: SubspaceState, spec: StateSpec) -> SubspaceState:
        """``state`` checked against the layer's shapes and moved to the backend's array family,
        the keys' device and (torch family, half-precision model) the model's dtype; ValueError
        with the backend's reasons if it refuses the state."""
        if state.batch != spec.batch or state.kv_heads != spec.heads or state.d != spec.head_dim or state.d_v != spec.value_dim:
            raise ValueError(
                f"layer {spec.layer_idx}: state {state!r} (batch {state.batch}) does not fit the model's "
                f"batch {spec.batch}, {spec.heads} KV heads of size {spec.head_dim}/{spec.value_dim}"
            )
        if not state.batched:
            raise ValueError(f"layer {spec.layer_idx}: the cache needs batched states (built with batch=N); the factories here do so")
        if state.num_tokens:
            raise ValueError(f"layer {spec.layer_idx}: the state already holds {state.num_tokens} tokens; give empty states")
        held_family = "numpy" if isinstance(state.layout.key_coef, np.ndarray) else type(state.layout.key_coef).__module__.split(".")[0]
        half = self.family == "torch" and spec.dtype in (torch.float16, torch.bfloat16) and str(state.dtype).endswith("float32")
        if half or held_family != self.family or state.engine != self.backend or (self.family == "torch" and state.layout.key_coef.device != spec.device):
            # appends then run on the chosen backend itself (e.g. triton's projection kernel)
            state = state.to(self.backend, device=spec.device if self.family == "torch" else None, dtype=spec.dtype if half else None)
        require(state_reasons(self.backend, get_backend(self.backend), state), f"layer {spec.layer_idx}: backend {self.backend!r} refuses this state")
        return state

    # -- facts
    @property
    def states(self) -> list[SubspaceState | None]:
        return [layer.state if isinstance(layer, SubspaceLayer) else None for layer in self.layers]

    @property
    def nbytes(self) -> int:
        """Bytes the cache really holds: the states' (coefficients, bases in use, sketches) plus
        the keys and values of layers kept stock (sliding windows)."""
        held = sum(s.nbytes for s in self.states if s is not None)
        return held + sum(_stock_nbytes(layer) for layer in self.layers if not isinstance(layer, SubspaceLayer))

    @property
    def full_cache_nbytes(self) -> int:
        """Bytes the stock ``DynamicCache`` takes for the same tokens in the model's dtype (for a
        bfloat16 model, 2 bytes per key and value entry): every ratio is against this."""
        total = 0
        for layer in self.layers:
            if not isinstance(layer, SubspaceLayer):
                total += _stock_nbytes(layer)
            elif layer.state is not None:
                st = layer.state
                total += st.batch * st.kv_heads * st.num_tokens * (st.d + st.d_v) * layer.dtype.itemsize
        return total


def _stock_nbytes(layer) -> int:
    return sum(x.nbytes for x in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(x, torch.Tensor))


__all__ = [
    "StateFactory",
    "StateSpec",
    "SubspaceCache",
    "SubspaceLayer",
    "adaptive_states",
    "full_rank_states",
    "identity_bases",
    "per_layer",
    "rotating_states",
    "static_states",
]
