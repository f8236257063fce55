"""The compressed KV cache of one layer (spec A6-A9)."""

from __future__ import annotations

from typing import Any

import numpy as np

from subspace_ref import _checks, operations, persistence
from subspace_ref import window as _window
from subspace_ref.arrays import itemsize, to_numpy
from subspace_ref.basis_storage import NATIVE, check_format, has_row_scales, stored_dtype
from subspace_ref.calibration import StaticBasis, resolve_gamma
from subspace_ref.layout import (
    PackedLayout,
    SketchBuffers,
    allocated_nbytes,
    counted_nbytes,
)
from subspace_ref.policies import AdaptivePolicy, RotatingPolicy, StaticPolicy
from subspace_ref.policies._online import per_head_ranks, sketch_size, warmup_length
from subspace_ref.policies.adaptive import sketch_options, track_option, trigger_order
from subspace_ref.policies.byte_ceiling import ceiling_option, check_ceiling
from subspace_ref.formats import FLOAT, side_formats
from subspace_ref.quantization import DEFAULT_GROUP, packed_width
from subspace_ref.rope import RopeParams

Policy = StaticPolicy | AdaptivePolicy | RotatingPolicy


class SubspaceState:
    """Coefficients and per-chunk bases of one layer's KV cache (spec A9), built by
    :meth:`static`, :meth:`adaptive` or :meth:`rotating`.

    Unbatched (the default): ``append`` takes (H, d) or (H, n, d). Built with ``batch=N``:
    (N, H, d) or (N, H, n, d). The arrays live in one family (numpy, torch or cupy; see
    :meth:`to`), and appends run on the backend of that family, in place on its device.

    Parameters
    ----------
    policy, layout, sketches, batched, engine, window
        The parts :meth:`static`, :meth:`adaptive`, :meth:`rotating` and :meth:`load` assemble;
        build states with those, not by hand.

    Examples
    --------
    >>> import numpy as np, subspace_ref as sr
    >>> K, V = np.random.default_rng(0).standard_normal((2, 2, 64, 16))
    >>> state = sr.SubspaceState.static(sr.calibrate(K, V, rank_k=8, rank_v=8), coefficients="int8")
    >>> state.append(K, V)
    SubspaceState(static, heads=2, d=16, d_v=16, tokens=64, chunks=[1, 1], engine=numpy)
    """

    def __init__(
        self, policy: Policy, layout: PackedLayout, sketches: SketchBuffers | None, batched: bool, engine: str, window: _window.ExactWindow | None = None
    ):
        self.policy = policy
        self.layout = layout
        self.sketches = sketches
        self.batched = batched
        self.engine = engine
        # the exact recent tokens (spec/window.md); None: every token is in ``layout``
        self.window = window
        # the (backend, query kind) pairs whose attend calls passed every check that reads only
        # metadata (subspace_ref.operations.attend), none of which changes over the state's
        # life, each with the backend's route for such calls (Backend.attend_route) or None
        self.admitted: dict = {}

    # ----------------------------------------------------------------- construction
    @classmethod
    def static(
        cls,
        basis: StaticBasis,
        *,
        batch: int | None = None,
        dtype: Any = None,
        coefficients: str = FLOAT,
        rope: Any = None,
        bases: str = NATIVE,
        window: int = 0,
        min_tokens: int = 0,
        query_group: int = 1,
        group_size: int = DEFAULT_GROUP,
        sinks: int = 0,
    ) -> "SubspaceState":
        """A state over a calibrated basis (spec A6): one chunk per head, nothing else kept.

        ``coefficients="int8"`` stores coefficients as int8 with one float32 scale per token and
        head (spec A10); "int4" and "int2" store packed codes with float16 scales and zero points,
        keys per channel over groups of ``group_size`` tokens (the unfinished last group in float),
        values per token (KIVI's choice; spec/quantization.md Q1-Q3). ``bases`` is how the bases are stored (spec/storage.md S1): "native"
        (in ``dtype``, the default: a float64 state stays the exact oracle), "float16",
        "float8_e4m3" or "int8" (one float32 scale per basis row); attention and appends use the
        decoded stored bases. Bytes: :attr:`basis_nbytes` (spec/storage.md S4).

        ``rope``: a :class:`~subspace_ref.rope.RopeParams` when ``basis.B`` was calibrated on
        un-rotated (pre-RoPE) keys (spec/rope.md P2-P3, seed 003 RoPE ablation). Appended keys
        are post-RoPE (as a transformers cache receives them); the t-th token appended (t =
        0, 1, ..., its position) is stored as c_t = B R_t^{-1} k_t and attention rebuilds
        R_t B^T c_t. Same bytes as without, but attention costs O(r d) per token instead of
        O(r); only the numpy backend implements it; such a state cannot be saved.

        ``window=W`` keeps the last W tokens exact (keys and values in ``dtype``, (d + d_v)
        numbers per token and head) and ``min_tokens=M`` compresses nothing while the state holds
        fewer than M tokens (seed 003 "Limitations": short sequences); tokens leaving the exact
        part are appended to the compressed part in order, and attention merges both in one
        blockwise softmax (spec/window.md W1-W3; the same keywords on :meth:`adaptive` and
        :meth:`rotating`). W = M = 0 is the plain state. ``sinks=S`` also keeps the first S tokens
        exact (attention sinks, StreamingLLM), merged in the same softmax (spec/window.md W7-W9).

        ``query_group=g`` (spec/sharing.md A3, seed 001 §11): ``basis`` has one head per QUERY
        head (H_q = g H, e.g. from :func:`subspace_ref.sharing.calibrate_query_heads`); appends
        take keys/values of the H KV heads and repeat KV head h for query heads g h .. g h + g - 1,
        so each query head projects with its own key basis and attention maps query head i to
        state head i (group 1). Values are stored per query head too (the layout has one head
        count): g times the coefficient and basis bytes of a plain state at the same ranks
        (spec/sharing.md B1). Every backend runs it (the repeat happens before the backend);
        such a state cannot be saved (spec/sharing.md §6)."""
        if not isinstance(basis, StaticBasis):
            raise TypeError(f"basis must be a StaticBasis (see calibrate or StaticBasis.from_bases), got {type(basis).__name__}")
        if rope is not None:
            if not isinstance(rope, RopeParams):
                raise TypeError(f"rope must be a subspace_ref.rope.RopeParams (e.g. RopeParams.from_config(model.config)) or None, got {type(rope).__name__}")
            rope.planes(basis.B.shape[2])  # ValueError unless its rotary dims fit the head size
        W, M, _ = _window.options(window, min_tokens, 0, "static")
        S = _window.sink_option(sinks, rope)
        dtype = _checks.numpy_float_dtype("dtype", basis.B.dtype if dtype is None else dtype)
        n = _batch_size(batch)
        H, r, d = basis.B.shape
        r_v, d_v = basis.E.shape[1:]
        query_group = _checks.positive_int("query_group", query_group)
        if H % query_group:
            raise ValueError(f"query_group = {query_group} must divide the basis's {H} heads (one per query head, H_q = query_group x KV heads)")
        layout = _empty_layout(n, H, r, d, r_v, d_v, dtype, coefficients, bases, group_size)
        every = (slice(None), slice(None), 0)
        layout.store_basis("key", every, np.broadcast_to(basis.B.astype(dtype), (n, H, r, d)))
        layout.store_basis("value", every, np.broadcast_to(basis.E.astype(dtype), (n, H, r_v, d_v)))
        layout.gamma[:] = basis.gamma
        layout.num_chunks[:] = 1
        exact = _window.empty(W, M, 0, n, H, d, d_v, dtype, S)
        policy = StaticPolicy(basis.rank_k, basis.rank_v, rope, None if query_group == 1 else query_group)
        return cls(policy, layout, None, batch is not None, "numpy", exact)

    @classmethod
    def adaptive(
        cls,
        heads: int,
        d: int,
        d_v: int | None = None,
        *,
        rank_k: int | tuple[int, ...],
        rank_v: int | tuple[int, ...],
        ell_k: int | None = None,
        ell_v: int | None = None,
        tau_k: float = 0.2,
        tau_v: float = 0.2,
        max_chunk: int = 256,
        warmup: int | None = None,
        sketch_reset: bool = False,
        gamma: Any = "unit",
        batch: int | None = None,
        dtype: Any = np.float64,
        coefficients: str = FLOAT,
        bases: str = NATIVE,
        group_size: int = DEFAULT_GROUP,
        window: int = 0,
        min_tokens: int = 0,
        lookahead: int = 0,
        ring_warm_start: int = 0,
        fd_stride: int = 1,
        reuse_angle: float | None = None,
        trigger: str = "reproject",
        sinks: int = 0,
        byte_ceiling: float = 1.0,
        track: bool | None = None,
    ) -> "SubspaceState":
        """Online bases from FD sketches with residual-triggered chunking (spec A7, seed 001 §5).

        ``ell_*`` default to 2 x rank; the first min(``warmup``, rank) tokens of each side are
        stored exactly in chunk 0 (spec A7 step 0; default: the largest rank without tracking;
        with it, the largest rank of a side kept at full rank, else 0, since growth fills the
        bases with the tokens that need a row); ``warmup=0`` with ``trigger="paper"`` is the
        paper verbatim.

        ``track`` (spec A7.4; default None: True under ``trigger="reproject"``, False under
        "paper"): drift tracking. A side whose token is over tau / 2 and whose open basis has a free
        (zero) row takes the token's residual as that row, without a new chunk; a chunk that opens
        keeps the sketch's snapshot on a side only if it holds the firing token within tau, else
        starts from the token's direction with free rows; and the sketches restart at every
        opening, so they summarise the open chunk. Every stored token is then within tau, the
        first of each chunk included (statement A7.4.1), and a switch of the stream's subspace
        costs at most two chunks (A7.4.2; issue 40's three-subspace stream: 3 chunks, where the
        paper's sketches opened 112). The exceptions are counted in :attr:`tokens_over_tau`.
        ``trigger="reproject"`` (the default) stores the token that fires the trigger in the new
        chunk, with bases that include it (spec A7.2: every stored token within tau, full rank
        exact); "paper" keeps seed 001's order, where that token stays in the old chunk with its
        residual (and the cap leaves an empty open chunk after a capped chunk). Under both, a
        chunk closed by ``max_chunk`` holds max_chunk tokens.
        ``sketch_reset=True`` (without tracking, which restarts at every boundary anyway)
        restarts the sketches at the boundaries of long chunks (spec A7 step 3b): the paper's
        sketches never forget, and under drift they keep returning the old subspace, so the
        trigger fires on nearly every token (spec A7.1, tests/test_adaptive_state.py).
        ``bases``: as in :meth:`static`; each snapshot is encoded when stored and the open chunk
        projects with the decoded stored basis (spec/storage.md S3).

        ``window``, ``min_tokens``: an exact recent window and a length threshold, as in
        :meth:`static` (spec/window.md W1-W3). ``lookahead=L_h`` (at most ``window``; seed 001
        §7's added-latency mode, e.g. W/2): a chunk opened when a token leaves the window takes
        its bases from the sketches after also inserting, in copies, the next L_h tokens, which
        are still exact in the window (spec/window.md W4; one extra FD insertion of L_h rows per
        trigger). 0 is the streaming default. Appends with lookahead run on the numpy backend.
        ``sinks``: the first S tokens kept exact, as in :meth:`static` (spec/window.md W7).

        Online-sketch variants (spec/sketch_variants.md; neutral defaults give the plain state):
        ``ring_warm_start=W`` keeps the last W sketch rows per head in ring buffers (W (d + d_v)
        numbers per head instead of the 2 (ell_k d + ell_v d_v) of the running sketches, which
        are then not kept) and takes each trigger's snapshot from FD of them (S1, seed 001 §7;
        cost: one FD of W rows per firing head); ``fd_stride=m`` feeds only tokens t with
        t mod m = 0 to the sketches (S2, seed 001 §9/§14: m times fewer FD rows and
        compactions); ``reuse_angle=a`` (radians in (0, pi/2)) lets a head keep its open chunk
        and bases when the snapshot's largest principal angle to them is below ``a`` on keys
        and values (S3, seed 001 §14: fewer chunks and basis bytes; costs the snapshot SVDs of
        triggers that no longer open chunks). ``ring_warm_start`` and ``lookahead`` do not
        combine (the ring replaces the sketches that lookahead would extend).

        ``byte_ceiling`` (spec A7.3, default 1.0): a trigger opens a chunk only if the state with
        it, sketches included, stays within ``byte_ceiling`` times the full cache's bytes in its
        dtype. So after every append ``nbytes <= max(byte_ceiling * full_cache_nbytes, the bytes
        of a one-chunk state of the same length)`` (statement A7.3.1): the only overshoot is
        that of the smallest state the policy can hold (its sketches and one chunk of bases),
        and it is gone after t_0 = (F + B_c) / (beta - T_c) tokens, e.g. 54 tokens at d = 32,
        r = 8 in float64 (``docs/adaptive_policy.md``). An exact window or sinks add their own
        bytes, exactly their share of the full cache. A trigger it refuses leaves the token in
        the open chunk: its residual may then be above tau (counted in :attr:`tokens_over_tau`),
        and a chunk may outlive ``max_chunk``. ``math.inf`` is seed 001's policy, with no
        ceiling: on data that is not low-rank at the chosen ranks it can hold several times the
        full cache. ``trigger="paper", byte_ceiling=math.inf`` is spec A7 verbatim (and what a
        file saved before these options loads as).
        """
        window, min_tokens, lookahead = _window.options(window, min_tokens, lookahead, "adaptive")
        sinks = _window.sink_option(sinks)
        trigger, track = trigger_order(trigger), track_option(track, trigger_order(trigger))
        heads, d, d_v, rk, rv, ek, ev, w = _online_args(heads, d, d_v, rank_k, rank_v, ell_k, ell_v, warmup)
        if warmup is None and track:  # spec A7.4: growth fills the bases; only a side kept at full rank warms up
            w = max([r for r in rk if r == d] + [r for r in rv if r == d_v] + [0])
        ring, stride, reuse = sketch_options(ring_warm_start, fd_stride, reuse_angle, bool(sketch_reset))
        if ring and lookahead:
            raise ValueError(
                f"ring_warm_start={ring} and lookahead={lookahead} cannot be combined: the ring replaces the sketches that lookahead extends; set one of them to 0"
            )
        policy = AdaptivePolicy(
            rk,
            rv,
            ek,
            ev,
            _checks.open_unit_interval("tau_k", tau_k),
            _checks.open_unit_interval("tau_v", tau_v),
            _checks.positive_int("max_chunk", max_chunk),
            w,
            bool(sketch_reset),
            ring,
            stride,
            reuse,
            trigger,
            ceiling_option(byte_ceiling),
            track,
        )
        state = cls._online(policy, heads, d, d_v, gamma, batch, dtype, coefficients, bases, (window, min_tokens, lookahead, sinks), group_size)
        check_ceiling(state)
        return state

    @classmethod
    def rotating(
        cls,
        heads: int,
        d: int,
        d_v: int | None = None,
        *,
        rank_k: int | tuple[int, ...],
        rank_v: int | tuple[int, ...],
        ell_k: int | None = None,
        ell_v: int | None = None,
        refresh_every: int = 64,
        warmup: int | None = None,
        gamma: Any = "unit",
        batch: int | None = None,
        dtype: Any = np.float64,
        coefficients: str = FLOAT,
        bases: str = NATIVE,
        group_size: int = DEFAULT_GROUP,
        window: int = 0,
        min_tokens: int = 0,
        sinks: int = 0,
    ) -> "SubspaceState":
        """One basis per head, refreshed from FD every ``refresh_every`` tokens with the stored
        coefficients rotated by the r x r change of basis (spec A8, seed 003 SubSpace-A).
        ``bases``: as in :meth:`adaptive`; the change of basis is taken between the decoded
        stored bases (spec/storage.md S3). ``window``, ``min_tokens``: as in :meth:`static`
        (spec/window.md W1-W3); refreshes see (and rotate) only the tokens that have left the window.
        ``sinks``: as in :meth:`static` (spec/window.md W7)."""
        window, min_tokens, _ = _window.options(window, min_tokens, 0, "rotating")
        sinks = _window.sink_option(sinks)
        heads, d, d_v, rk, rv, ek, ev, w = _online_args(heads, d, d_v, rank_k, rank_v, ell_k, ell_v, warmup)
        policy = RotatingPolicy(rk, rv, ek, ev, _checks.positive_int("refresh_every", refresh_every), w)
        return cls._online(policy, heads, d, d_v, gamma, batch, dtype, coefficients, bases, (window, min_tokens, 0, sinks), group_size)

    @classmethod
    def _online(cls, policy, heads, d, d_v, gamma, batch, dtype, coefficients, bases=NATIVE, exact=(0, 0, 0, 0), group_size=None) -> "SubspaceState":
        if np.dtype(dtype) not in (np.float32, np.float64):
            raise TypeError(
                f"dtype must be float32 or float64 for an online NumPy state (its SVDs need them), got {dtype!r}; convert with state.to(...) for half precision"
            )
        dtype = np.dtype(dtype)
        n = _batch_size(batch)
        layout = _empty_layout(n, heads, max(policy.rank_k), d, max(policy.rank_v), d_v, dtype, coefficients, bases, group_size)
        layout.gamma[:] = resolve_gamma(gamma, policy.rank_k, d, dtype)
        layout.num_chunks[:] = 1
        ring = getattr(policy, "ring_warm_start", 0)
        # with a ring (spec/sketch_variants.md S1) the sketches are rebuilt at each trigger and
        # nothing reads them in between, so none are kept: zero-row buffers
        sketch_rows = (0, 0) if ring else (2 * policy.ell_k, 2 * policy.ell_v)
        sketches = SketchBuffers(
            keys=np.zeros((n, heads, sketch_rows[0], d), dtype=dtype),
            values=np.zeros((n, heads, sketch_rows[1], d_v), dtype=dtype),
            filled_k=0,
            filled_v=0,
            rows_seen=0,
            ring_keys=np.zeros((n, heads, ring, d), dtype=dtype) if ring else None,
            ring_values=np.zeros((n, heads, ring, d_v), dtype=dtype) if ring else None,
        )
        return cls(policy, layout, sketches, batch is not None, "numpy", _window.empty(*exact[:3], n, heads, d, d_v, dtype, sinks=exact[3]))

    # ----------------------------------------------------------------- shape facts
    @property
    def kind(self) -> str:
        return self.policy.kind

    @property
    def batch(self) -> int:
        return self.layout.key_coef.shape[0]

    @property
    def heads(self) -> int:
        return self.layout.key_coef.shape[1]

    @property
    def kv_heads(self) -> int:
        """Heads of the keys/values :meth:`append` takes: :attr:`heads`, or heads / g for a
        per-query-head state (``query_group=g``, spec/sharing.md A3)."""
        return self.heads // (getattr(self.policy, "query_group", None) or 1)

    @property
    def d(self) -> int:
        return self.layout.key_bases.shape[-1]

    @property
    def d_v(self) -> int:
        return self.layout.value_bases.shape[-1]

    @property
    def dtype(self):
        """The floating dtype of keys and values appended (coefficients may be int8, bases may be
        stored in another format: spec/storage.md S1)."""
        return self.layout.dtype

    @property
    def basis_format(self) -> str:
        """How the bases are stored: "native", "float16", "float8_e4m3" or "int8" (spec/storage.md S1)."""
        return self.layout.basis_format

    @property
    def num_tokens(self) -> int:
        """T: compressed tokens (``layout.num_tokens``) plus exact ones (spec/window.md W1)."""
        return self.layout.num_tokens + (0 if self.window is None else self.window.count)

    @property
    def num_chunks(self) -> np.ndarray:
        """Chunks per head, the open one included: (H,), or (N, H) for a batched state."""
        counts = to_numpy(self.layout.num_chunks).astype(np.int64)
        return counts if self.batched else counts[0]

    @property
    def nbytes(self) -> int:
        """Bytes the cache really holds: coefficients of the tokens, bases of the chunks in use,
        gamma, and for online states the FD sketches (and ring buffers) and, adaptive, the chunk
        offsets; the exact window. Spare capacity is not counted (see :attr:`allocated_nbytes`).
        Every array of :data:`subspace_ref.layout.STATE_ARRAYS` with its counting rule."""
        return counted_nbytes(self)

    @property
    def tokens_over_tau(self) -> int:
        """Adaptive states: how many (token, head) pairs, summed over sequences and heads, the
        byte ceiling refused a chunk for and which are therefore stored with a relative residual
        above tau on keys or values (spec A7.3, A7.4): the fidelity the state gave up for bytes.
        Under tracking (the default, without ``reuse_angle``) these are all the tokens stored
        above tau (statement A7.4.1); 0 without a ceiling. Saved with the state; copies and
        ``select_sequences`` keep the total. 0 for static and rotating states."""
        return int(getattr(self.sketches, "tokens_over_tau", 0)) if self.kind == "adaptive" else 0

    @property
    def allocated_nbytes(self) -> int:
        """Bytes of every array the state holds, spare capacity included (>= :attr:`nbytes`)."""
        return allocated_nbytes(self)

    @property
    def basis_nbytes(self) -> int:
        """Bytes of the bases of the chunks in use, in their stored format (plus one float32
        scale per basis row for int8 bases), plus gamma (spec/storage.md S4)."""
        return counted_nbytes(self, ("key_bases", "value_bases", "key_basis_scale", "value_basis_scale", "gamma"))

    @property
    def full_cache_nbytes(self) -> int:
        """Bytes of the uncompressed K and V these tokens stand for, in the state's dtype."""
        return self.batch * self.heads * self.num_tokens * (self.d + self.d_v) * itemsize(self.layout.gamma)

    def chunk_bounds(self, head: int, seq: int = 0) -> list[tuple[int, int]]:
        """[start, end) token ranges of the chunks of one head (the last may be empty); exact
        window tokens (spec/window.md) are in no chunk."""
        starts = to_numpy(self.layout.chunk_starts[seq, head]).tolist()
        j = int(to_numpy(self.layout.num_chunks)[seq, head])
        ends = starts[1:j] + [self.layout.num_tokens]
        return list(zip(starts[:j], ends))

    # ----------------------------------------------------------------- operations
    def append(self, keys: Any, values: Any) -> "SubspaceState":
        """Append one token (H, d) or a block (H, n, d) of keys and values (a leading batch axis
        for batched states): :func:`subspace_ref.operations.append`. Checked before anything
        changes: bad input raises and leaves the state as it was."""
        return operations.append(self, keys, values)

    def reconstruct(self) -> tuple[np.ndarray, np.ndarray]:
        """(K_hat, V_hat) the state stands for: each token's coefficients mapped through its
        chunk's bases, between the sink and the recent exact tokens (spec/window.md W1, W7). (H, T, d) and
        (H, T, d_v), with a leading N for batched states; NumPy."""
        lay = self.layout.map_arrays(lambda _, x: to_numpy(x))
        n, h = lay.key_coef.shape[:2]
        dtype = lay.dtype
        K = np.zeros((n, h, lay.num_tokens, self.d), dtype=dtype)
        V = np.zeros((n, h, lay.num_tokens, self.d_v), dtype=dtype)
        for s in range(n):
            for head in range(h):
                for j, (a, b) in enumerate(self.chunk_bounds(head, s)):
                    K[s, head, a:b] = lay.coefficient_rows("key", s, head, a, b, dtype) @ lay.basis("key", (s, head, j), dtype)
                    V[s, head, a:b] = lay.coefficient_rows("value", s, head, a, b, dtype) @ lay.basis("value", (s, head, j), dtype)
        if self.window is not None:  # sinks first, then the compressed tokens, then the recent ones
            win = self.window
            sink_k, sink_v = (win.sink_keys, win.sink_values) if win.sink_keys is not None else (K[:, :, :0], V[:, :, :0])
            K = np.concatenate([to_numpy(sink_k).astype(dtype), K, to_numpy(win.keys).astype(dtype)], axis=2)
            V = np.concatenate([to_numpy(sink_v).astype(dtype), V, to_numpy(win.values).astype(dtype)], axis=2)
        return (K, V) if self.batched else (K[0], V[0])

    def save(self, path) -> None:
        """Write the state to ``path`` (safetensors, versioned schema, checksummed, atomic):
        :func:`subspace_ref.persistence.save_state`."""
        persistence.save_state(self, path)

    @classmethod
    def load(cls, path) -> "SubspaceState":
        """Read a state written by :meth:`save` (NumPy arrays); clear errors for bad files."""
        return cls(*persistence.load_parts(path))

    def copy(self) -> "SubspaceState":
        """An independent copy (arrays copied, spare capacity dropped)."""
        return operations.copy(self)

    def to(self, backend: str, device: Any = None, dtype: Any = None) -> "SubspaceState":
        """A copy whose arrays belong to ``backend``'s array family (e.g. "torch" for the torch and
        triton backends), on ``device``, with floating arrays cast to ``dtype``. Appends to the
        copy then run on ``backend``; any backend of the same family can attend to it
        (:func:`subspace_ref.operations.convert`)."""
        return operations.convert(self, backend, device, dtype)

    def __repr__(self) -> str:
        return (
            f"SubspaceState({self.kind}, heads={self.heads}, d={self.d}, d_v={self.d_v}, "
            f"tokens={self.num_tokens}, chunks={self.num_chunks.tolist()}, engine={self.engine})"
        )


def _batch_size(batch: int | None) -> int:
    return 1 if batch is None else _checks.positive_int("batch", batch)


def _online_args(heads, d, d_v, rank_k, rank_v, ell_k, ell_v, warmup):
    heads = _checks.positive_int("heads", heads)
    d = _checks.positive_int("d", d)
    d_v = d if d_v is None else _checks.positive_int("d_v", d_v)
    rk = per_head_ranks("rank_k", rank_k, heads, d)
    rv = per_head_ranks("rank_v", rank_v, heads, d_v)
    ek = sketch_size("ell_k", ell_k, rk, "rank_k")
    ev = sketch_size("ell_v", ell_v, rv, "rank_v")
    return heads, d, d_v, rk, rv, ek, ev, warmup_length(warmup, rk, rv)


def _empty_layout(
    n: int, H: int, r: int, d: int, r_v: int, d_v: int, dtype, coefficients: Any, bases: str = NATIVE, group_size: int | None = DEFAULT_GROUP
) -> PackedLayout:
    """An empty layout whose sides store coefficients as ``coefficients`` says: one format name
    for both, or a (key, value) pair of names (spec/quantization.md Q0)."""
    key_format, value_format = side_formats(coefficients)
    group = _checks.positive_int("group_size", DEFAULT_GROUP if group_size is None else group_size) if key_format.low_bits else 0
    bases = check_format("bases", bases)
    basis_dtype = stored_dtype(bases, dtype)
    side_arrays = {}
    for which, fmt, rank in (("key", key_format, r), ("value", value_format, r_v)):
        side_arrays[f"{which}_coef"] = np.zeros((n, H, 0, packed_width(rank, fmt.low_bits) if fmt.low_bits else rank), dtype=_coefficient_dtype(fmt, dtype))
        for name in fmt.arrays(which):
            side_arrays[name] = _side_array(name, n, H, rank, group, dtype)
    return PackedLayout(
        **side_arrays,
        key_bases=np.zeros((n, H, 1, r, d), dtype=basis_dtype),
        value_bases=np.zeros((n, H, 1, r_v, d_v), dtype=basis_dtype),
        chunk_starts=np.zeros((n, H, 1), dtype=np.int64),
        num_chunks=np.zeros((n, H), dtype=np.int64),
        gamma=np.zeros(H, dtype=dtype),
        num_tokens=0,
        key_basis_scale=np.zeros((n, H, 1, r), dtype=np.float32) if has_row_scales(bases) else None,
        value_basis_scale=np.zeros((n, H, 1, r_v), dtype=np.float32) if has_row_scales(bases) else None,
        basis_format=bases,
        key_format=key_format.name,
        value_format=value_format.name,
        group=group,
    )


def _coefficient_dtype(fmt, dtype) -> Any:
    """Spec A10: int8 codes; spec/quantization.md Q1: packed uint8 codes; float: the state's dtype."""
    return dtype if fmt.code_dtype is None else np.dtype(fmt.code_dtype)


def _side_array(name: str, n: int, H: int, rank: int, group: int, dtype) -> Any:
    """An empty array a side's format adds (spec A10, spec/quantization.md Q2)."""
    if name in ("key_scale", "value_scale"):
        return np.zeros((n, H, 0), dtype=np.float32)
    if name == "key_tail":
        return np.zeros((n, H, group, rank), dtype=dtype)
    if name in ("key_group_scale", "key_group_zero"):
        return np.zeros((n, H, 0, rank), dtype=np.float16)
    return np.zeros((n, H, 0), dtype=np.float16)  # value_token_scale, value_token_zero
