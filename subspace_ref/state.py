"""The compressed KV cache of one layer (spec A6-A9)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from subspace_ref import _checks
from subspace_ref.arrays import array_family, clone, itemsize, numel, to_numpy
from subspace_ref.calibration import StaticBasis, resolve_gamma
from subspace_ref.layout import PackedLayout
from subspace_ref.policies import AdaptivePolicy, RotatingPolicy, StaticPolicy
from subspace_ref.policies._online import per_head_ranks, sketch_size, warmup_length
from subspace_ref.policies.adaptive import sketch_options

Policy = StaticPolicy | AdaptivePolicy | RotatingPolicy


@dataclass
class SketchBuffers:
    """FD buffers (spec A4) of every head: keys (N, H, 2 ell_k, d), values (N, H, 2 ell_v, d_v).

    All heads see the same number of rows, so one fill count serves them all.
    """

    keys: Any
    values: Any
    filled_k: int
    filled_v: int
    rows_seen: int
    # spec/sketch_variants.md: ring buffers (N, H, W, d) / (N, H, W, d_v) of the last W sketch
    # rows when ring_warm_start = W > 0 (S1), and two diagnostic counters (S2.3): rows each
    # head's key sketch received, and SVDs run (compactions and snapshots, summed over sequences,
    # heads, keys and values). The counters are not saved.
    ring_keys: Any = None
    ring_values: Any = None
    rows_inserted: int = 0
    svds: int = 0


class SubspaceState:
    """Coefficients and per-chunk bases of one layer's KV cache (spec A9), built by
    :meth:`static`, :meth:`adaptive` or :meth:`rotating`.

    Unbatched (the default): ``append`` takes (H, d) or (H, n, d). Built with ``batch=N``:
    (N, H, d) or (N, H, n, d). The arrays live in one family (numpy, torch or cupy; see
    :meth:`to`), and appends run on the backend of that family, in place on its device.
    """

    def __init__(self, policy: Policy, layout: PackedLayout, sketches: SketchBuffers | None, batched: bool, engine: str):
        self.policy = policy
        self.layout = layout
        self.sketches = sketches
        self.batched = batched
        self.engine = engine

    # ----------------------------------------------------------------- construction
    @classmethod
    def static(cls, basis: StaticBasis, *, batch: int | None = None, dtype: Any = None, coefficients: str = "float") -> "SubspaceState":
        """A state over a calibrated basis (spec A6): one chunk per head, nothing else kept.

        ``coefficients="int8"`` stores coefficients as int8 with one float32 scale per token and
        head (spec A10); bases stay in ``dtype``."""
        if not isinstance(basis, StaticBasis):
            raise TypeError(f"basis must be a StaticBasis (see calibrate or StaticBasis.from_bases), got {type(basis).__name__}")
        dtype = _checks.numpy_float_dtype("dtype", basis.B.dtype if dtype is None else dtype)
        n = _batch_size(batch)
        H, r, d = basis.B.shape
        r_v, d_v = basis.E.shape[1:]
        layout = _empty_layout(n, H, r, d, r_v, d_v, dtype, coefficients)
        layout.key_bases[:, :, 0] = basis.B
        layout.value_bases[:, :, 0] = basis.E
        layout.gamma[:] = basis.gamma
        layout.num_chunks[:] = 1
        return cls(StaticPolicy(basis.rank_k, basis.rank_v), layout, None, batch is not None, "numpy")

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
        coefficients: str = "float",
        ring_warm_start: int = 0,
        fd_stride: int = 1,
        reuse_angle: float | None = None,
    ) -> "SubspaceState":
        """Online bases from FD sketches with residual-triggered chunking (spec A7, seed 001 §5).

        ``ell_*`` default to 2 x rank; ``warmup`` (default: the smallest rank) tokens are stored
        exactly before the first trigger can fire; ``warmup=0`` is the paper verbatim.
        ``sketch_reset=True`` restarts the sketches at each chunk boundary (spec A7 step 3b): the
        paper's sketches never forget, and under drift they keep returning the old subspace, so
        the trigger fires on nearly every token (see tests/test_adaptive_state.py).

        Online-sketch variants (spec/sketch_variants.md; neutral defaults give the plain state):
        ``ring_warm_start=W`` keeps the last W sketch rows per head in ring buffers (W (d + d_v)
        numbers per head instead of the 2 (ell_k d + ell_v d_v) of the running sketches, which
        are then not kept) and takes each trigger's snapshot from FD of them (S1, seed 001 §7;
        cost: one FD of W rows per firing head); ``fd_stride=m`` feeds only tokens t with
        t mod m = 0 to the sketches (S2, seed 001 §9/§14: m times fewer FD rows and
        compactions); ``reuse_angle=a`` (radians in (0, pi/2)) lets a head keep its open chunk
        and bases when the snapshot's largest principal angle to them is below ``a`` on keys
        and values (S3, seed 001 §14: fewer chunks and basis bytes; costs the snapshot SVDs of
        triggers that no longer open chunks).
        """
        heads, d, d_v, rk, rv, ek, ev, w = _online_args(heads, d, d_v, rank_k, rank_v, ell_k, ell_v, warmup)
        ring, stride, reuse = sketch_options(ring_warm_start, fd_stride, reuse_angle, bool(sketch_reset))
        policy = AdaptivePolicy(
            rk, rv, ek, ev,
            _checks.open_unit_interval("tau_k", tau_k),
            _checks.open_unit_interval("tau_v", tau_v),
            _checks.positive_int("max_chunk", max_chunk),
            w,
            bool(sketch_reset),
            ring,
            stride,
            reuse,
        )
        return cls._online(policy, heads, d, d_v, gamma, batch, dtype, coefficients)

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
        coefficients: str = "float",
    ) -> "SubspaceState":
        """One basis per head, refreshed from FD every ``refresh_every`` tokens with the stored
        coefficients rotated by the r x r change of basis (spec A8, seed 003 SubSpace-A)."""
        heads, d, d_v, rk, rv, ek, ev, w = _online_args(heads, d, d_v, rank_k, rank_v, ell_k, ell_v, warmup)
        policy = RotatingPolicy(rk, rv, ek, ev, _checks.positive_int("refresh_every", refresh_every), w)
        return cls._online(policy, heads, d, d_v, gamma, batch, dtype, coefficients)

    @classmethod
    def _online(cls, policy, heads, d, d_v, gamma, batch, dtype, coefficients) -> "SubspaceState":
        if np.dtype(dtype) not in (np.float32, np.float64):
            raise TypeError(f"dtype must be float32 or float64 for an online NumPy state (its SVDs need them), got {dtype!r}; convert with state.to(...) for half precision")
        dtype = np.dtype(dtype)
        n = _batch_size(batch)
        layout = _empty_layout(n, heads, max(policy.rank_k), d, max(policy.rank_v), d_v, dtype, coefficients)
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
        return cls(policy, layout, sketches, batch is not None, "numpy")

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
    def d(self) -> int:
        return self.layout.key_bases.shape[-1]

    @property
    def d_v(self) -> int:
        return self.layout.value_bases.shape[-1]

    @property
    def dtype(self):
        """The floating dtype of bases and of keys and values appended (coefficients may be int8)."""
        return self.layout.key_bases.dtype

    @property
    def num_tokens(self) -> int:
        return self.layout.num_tokens

    @property
    def num_chunks(self) -> np.ndarray:
        """Chunks per head, the open one included: (H,), or (N, H) for a batched state."""
        counts = to_numpy(self.layout.num_chunks).astype(np.int64)
        return counts if self.batched else counts[0]

    @property
    def nbytes(self) -> int:
        """Bytes the cache really holds: coefficients of the tokens, bases of the chunks in use,
        gamma, and for online states the FD sketches and chunk offsets. Spare capacity is not
        counted (see :attr:`allocated_nbytes`)."""
        lay = self.layout
        n, h = lay.key_coef.shape[:2]
        per_token = (lay.key_coef.shape[3] + lay.value_coef.shape[3]) * itemsize(lay.key_coef)
        if lay.quantized:
            per_token += itemsize(lay.key_scale) + itemsize(lay.value_scale)
        total = n * h * lay.num_tokens * per_token + self.basis_nbytes
        chunks = int(to_numpy(lay.num_chunks).sum())
        if self.sketches is not None:
            total += (numel(self.sketches.keys) + numel(self.sketches.values)) * itemsize(self.sketches.keys)
            if self.sketches.ring_keys is not None:  # spec/sketch_variants.md S1.5
                total += (numel(self.sketches.ring_keys) + numel(self.sketches.ring_values)) * itemsize(self.sketches.ring_keys)
        if self.kind == "adaptive":
            total += chunks * 8
        return total

    @property
    def allocated_nbytes(self) -> int:
        """Bytes of every array the state holds, spare capacity included."""
        arrays = list(self.layout.arrays().values())
        if self.sketches is not None:
            arrays += [self.sketches.keys, self.sketches.values]
            if self.sketches.ring_keys is not None:
                arrays += [self.sketches.ring_keys, self.sketches.ring_values]
        return sum(numel(x) * itemsize(x) for x in arrays)

    @property
    def basis_nbytes(self) -> int:
        """Bytes of the bases of the chunks in use plus gamma."""
        lay = self.layout
        chunks = int(to_numpy(lay.num_chunks).sum())
        per_chunk = lay.key_bases.shape[3] * lay.key_bases.shape[4] + lay.value_bases.shape[3] * lay.value_bases.shape[4]
        return chunks * per_chunk * itemsize(lay.key_bases) + self.heads * itemsize(lay.gamma)

    @property
    def full_cache_nbytes(self) -> int:
        """Bytes of the uncompressed K and V these tokens stand for, in the state's dtype."""
        return self.batch * self.heads * self.num_tokens * (self.d + self.d_v) * itemsize(self.layout.key_bases)

    def chunk_bounds(self, head: int, seq: int = 0) -> list[tuple[int, int]]:
        """[start, end) token ranges of the chunks of one head (the last may be empty)."""
        starts = to_numpy(self.layout.chunk_starts[seq, head]).tolist()
        j = int(to_numpy(self.layout.num_chunks)[seq, head])
        ends = starts[1:j] + [self.num_tokens]
        return list(zip(starts[:j], ends))

    # ----------------------------------------------------------------- operations
    def append(self, keys: Any, values: Any) -> "SubspaceState":
        """Append one token (H, d) or a block (H, n, d) of keys and values (a leading batch axis
        for batched states). Checked before anything changes: bad input raises and leaves the
        state as it was."""
        k = self._tokens("keys", keys, self.d)
        v = self._tokens("values", values, self.d_v)
        if k.shape[2] != v.shape[2]:
            raise ValueError(f"keys has {k.shape[2]} tokens but values has {v.shape[2]}; expected the same number")
        if k.shape[2] == 0:
            return self
        from subspace_ref.registry import get_backend

        get_backend(self.engine).append(self, k, v)
        return self

    def reconstruct(self) -> tuple[np.ndarray, np.ndarray]:
        """(K_hat, V_hat) the state stands for: each token's coefficients mapped through its
        chunk's bases. (H, T, d) and (H, T, d_v), with a leading N for batched states; NumPy."""
        lay = self.layout.map_arrays(lambda _, x: to_numpy(x))
        n, h = lay.key_coef.shape[:2]
        dtype = lay.key_bases.dtype
        K = np.zeros((n, h, lay.num_tokens, self.d), dtype=dtype)
        V = np.zeros((n, h, lay.num_tokens, self.d_v), dtype=dtype)
        for s in range(n):
            for head in range(h):
                for j, (a, b) in enumerate(self.chunk_bounds(head, s)):
                    K[s, head, a:b] = lay.coefficient_rows("key", s, head, a, b, dtype) @ lay.key_bases[s, head, j]
                    V[s, head, a:b] = lay.coefficient_rows("value", s, head, a, b, dtype) @ lay.value_bases[s, head, j]
        return (K, V) if self.batched else (K[0], V[0])

    def save(self, path) -> None:
        """Write the state to ``path`` (safetensors, versioned schema, checksummed, atomic)."""
        from subspace_ref.persistence import save_state

        save_state(self, path)

    @classmethod
    def load(cls, path) -> "SubspaceState":
        """Read a state written by :meth:`save` (NumPy arrays); clear errors for bad files."""
        from subspace_ref.persistence import load_state

        return load_state(path)

    def copy(self) -> "SubspaceState":
        """An independent copy (arrays copied, spare capacity dropped)."""
        layout = replace(self.layout, **{name: clone(x) for name, x in self.layout.live_arrays().items()})
        sketches = None
        if self.sketches is not None:
            sketches = replace(self.sketches, keys=clone(self.sketches.keys), values=clone(self.sketches.values))
            if sketches.ring_keys is not None:
                sketches = replace(sketches, ring_keys=clone(sketches.ring_keys), ring_values=clone(sketches.ring_values))
        return SubspaceState(self.policy, layout, sketches, self.batched, self.engine)

    def to(self, backend: str, device: Any = None, dtype: Any = None) -> "SubspaceState":
        """A copy whose arrays belong to ``backend``'s array family (e.g. "torch" for the torch and
        triton backends), on ``device``, with floating arrays cast to ``dtype``. Appends to the
        copy then run on ``backend``; any backend of the same family can attend to it."""
        from subspace_ref.registry import get_backend

        target = get_backend(backend)
        available = target.availability()
        if not available:
            raise RuntimeError(f"backend {backend!r} is not available on this machine: {available.reason}")
        if dtype is not None and not any(f in str(dtype) for f in ("float16", "float32", "float64", "bfloat16")):
            raise TypeError(f"dtype must be one of float16, bfloat16, float32, float64; got {dtype!r}")
        convert = target.converter(device=device, dtype=dtype)
        keep_dtype = target.converter(device=device)
        state = self.copy()
        # int8 coefficients and their float32 scales keep their dtypes (spec A10)
        fixed = ("key_scale", "value_scale", "key_coef", "value_coef") if self.layout.quantized else ()
        state.layout = state.layout.map_arrays(lambda name, x: keep_dtype(x) if name in fixed else convert(x))
        if state.sketches is not None:
            state.sketches = replace(state.sketches, keys=convert(state.sketches.keys), values=convert(state.sketches.values))
            if state.sketches.ring_keys is not None:
                state.sketches = replace(state.sketches, ring_keys=convert(state.sketches.ring_keys), ring_values=convert(state.sketches.ring_values))
        # appends then run on the named backend (e.g. "triton" uses its projection kernel)
        state.engine = backend
        return state

    # ----------------------------------------------------------------- helpers
    def _tokens(self, name: str, x: Any, dim: int) -> Any:
        """x as (N, H, n, dim) in the state's family, dtype and device, after every check."""
        x = _checks.as_array(name, x)
        family = array_family(x)
        if family != array_family(self.layout.key_coef):
            raise TypeError(f"{name} is a {family} array but the state holds {array_family(self.layout.key_coef)} arrays; convert one of them (state.to(...))")
        _checks.float_dtype(name, x)
        lead = (self.batch, self.heads) if self.batched else (self.heads,)
        if x.ndim == len(lead) + 1:
            x = x[..., None, :]
        if self.batched:
            _checks.shape(name, x, (self.batch, self.heads, None, dim))
        else:
            _checks.shape(name, x, (self.heads, None, dim))
            x = x[None]
        if family == "torch" and x.device != self.layout.key_coef.device:
            raise ValueError(f"{name} is on {x.device} but the state is on {self.layout.key_coef.device}")
        _checks.finite(name, x)
        x = x.astype(self.dtype) if family != "torch" else x.detach().to(self.dtype)
        _checks.finite_norms(name, x)
        return x

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


def _empty_layout(n: int, H: int, r: int, d: int, r_v: int, d_v: int, dtype, coefficients: str) -> PackedLayout:
    if coefficients not in ("float", "int8"):
        raise ValueError(f'coefficients must be "float" or "int8", got {coefficients!r}')
    quantized = coefficients == "int8"
    coef_dtype = np.int8 if quantized else dtype
    return PackedLayout(
        key_coef=np.zeros((n, H, 0, r), dtype=coef_dtype),
        value_coef=np.zeros((n, H, 0, r_v), dtype=coef_dtype),
        key_scale=np.zeros((n, H, 0), dtype=np.float32) if quantized else None,
        value_scale=np.zeros((n, H, 0), dtype=np.float32) if quantized else None,
        key_bases=np.zeros((n, H, 1, r, d), dtype=dtype),
        value_bases=np.zeros((n, H, 1, r_v, d_v), dtype=dtype),
        chunk_starts=np.zeros((n, H, 1), dtype=np.int64),
        num_chunks=np.zeros((n, H), dtype=np.int64),
        gamma=np.zeros(H, dtype=dtype),
        num_tokens=0,
    )
