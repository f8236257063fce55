"""Roofline cost model of one decode step, per KV head (spec R1-R12; seed 001 §4, §5, §9).

Counts FLOPs and bytes moved for exact attention (spec A1) and for coefficient-space attention
(spec A2, A3) with its append (A6, A7) and Frequent Directions upkeep (A4), turns them into a
predicted time on a :class:`Machine` (spec R10) and finds the context length at which the
subspace method starts to win (spec R11). Every count is a plain formula of the shapes; the
rules are stated in ``spec/roofline.md`` and each function cites the items it implements.

All counts accept an integer context length ``T`` or a NumPy array of them (vectorised).
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

import numpy as np

from subspace_ref.formats import FLOAT, FORMATS, CoefficientFormat, coefficient_format

#: spec R1.4: FLOPs charged per logit for the softmax (scale, running max, subtract, exp, sum).
SOFTMAX_FLOPS_PER_LOGIT = 5
#: spec R4.1, R4.3: the coefficient formats the model counts, those stored as whole rows per token
#: (float, and int8 with one float32 scale per token); the low-bit formats' per-group key scales
#: and float tail are not in spec/roofline.md.
ROOFLINE_FORMATS = tuple(name for name, f in FORMATS.items() if not f.low_bits)
#: spec R13.2-R13.3: FLOPs per key dimension and token to generate cos/sin by angle addition
#: (3 per dimension: two products and a sum for each of cos, sin of a plane) and to rotate
#: (3 per dimension: four products and two sums per plane).
ROPE_FLOPS_PER_DIM = 6
#: spec R13.6: NVIDIA H100 SXM5 datasheet peaks (HBM3 3.35 TB/s; 67 TFLOP/s float32 on CUDA
#: cores; 989 TFLOP/s dense bf16/fp16 on tensor cores). A model, not a measurement.
H100_BANDWIDTH = 3.35e12
H100_FP32_FLOPS = 67e12
H100_TENSOR_FLOPS = 989e12
#: spec R1.5: the phases of one decode step.
PHASES = ("attend", "append", "fd")


# --------------------------------------------------------------------------- cost containers
@dataclass(frozen=True)
class Term:
    """One counted piece of work (spec R1): its name, the decode phase it belongs to, FLOPs and
    bytes (floats, or arrays when ``T`` was an array)."""

    name: str
    phase: str
    flops: Any
    bytes: Any


@dataclass(frozen=True)
class Cost:
    """A sum of :class:`Term` s (spec R1). ``flops`` and ``bytes`` are the totals."""

    terms: tuple[Term, ...]

    @property
    def flops(self) -> Any:
        return sum((t.flops for t in self.terms), 0.0)

    @property
    def bytes(self) -> Any:
        return sum((t.bytes for t in self.terms), 0.0)

    @property
    def intensity(self) -> Any:
        """Arithmetic intensity, FLOPs per byte."""
        return self.flops / self.bytes

    def term(self, name: str) -> Term:
        for t in self.terms:
            if t.name == name:
                return t
        raise KeyError(f"no term {name!r}; terms: {', '.join(t.name for t in self.terms)}")

    def names(self) -> list[str]:
        return [t.name for t in self.terms]

    def phase(self, *phases: str) -> "Cost":
        """Only the terms of the given phases (spec R1.5), e.g. ``cost.phase("attend")``."""
        unknown = set(phases) - set(PHASES)
        if unknown:
            raise ValueError(f"unknown phase(s) {sorted(unknown)}; phases are {PHASES}")
        return Cost(tuple(t for t in self.terms if t.phase in phases))

    def scaled(self, factor: float) -> "Cost":
        """Every term times ``factor``: heads x batch of a layer (spec R10.3)."""
        return Cost(tuple(replace(t, flops=t.flops * factor, bytes=t.bytes * factor) for t in self.terms))

    def __add__(self, other: "Cost") -> "Cost":
        """Terms of the same name and phase are summed (e.g. heads of different rank)."""
        out: dict[tuple[str, str], Term] = {}
        for t in self.terms + other.terms:
            key = (t.name, t.phase)
            out[key] = replace(out[key], flops=out[key].flops + t.flops, bytes=out[key].bytes + t.bytes) if key in out else t
        return Cost(tuple(out.values()))

    def time(self, machine: "Machine") -> Any:
        """Spec R10.1: the roofline time max(FLOPs / flop rate, bytes / bandwidth), seconds."""
        return np.maximum(self.flops / machine.flops, self.bytes / machine.bandwidth)

    def bound(self, machine: "Machine") -> Any:
        """Spec R10.2: "memory" when the byte term is the larger one, else "compute"."""
        mem = self.bytes / machine.bandwidth >= self.flops / machine.flops
        return np.where(mem, "memory", "compute") if np.ndim(mem) else ("memory" if mem else "compute")

    def table(self) -> str:
        """The terms as aligned text (scalars only)."""
        rows = [f"{'term':<16}{'phase':<8}{'FLOPs':>14}{'bytes':>14}"]
        rows += [f"{t.name:<16}{t.phase:<8}{float(t.flops):>14.6g}{float(t.bytes):>14.6g}" for t in self.terms]
        rows.append(f"{'total':<24}{float(self.flops):>14.6g}{float(self.bytes):>14.6g}")
        return "\n".join(rows)


# --------------------------------------------------------------------------- configurations
@dataclass(frozen=True)
class Shape:
    """One KV head (spec R1.1): key size ``d``, value size ``d_v`` (default ``d``), ``group``
    query heads reading it (grouped-query attention), and ``elem_bytes`` per stored element of
    the uncompressed cache, the bases, queries and outputs (2 for bf16/fp16, 4 for fp32)."""

    d: int
    d_v: int | None = None
    group: int = 1
    elem_bytes: float = 2.0

    def __post_init__(self):
        if self.d_v is None:
            object.__setattr__(self, "d_v", self.d)
        for name in ("d", "d_v", "group"):
            if not isinstance(getattr(self, name), (int, np.integer)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if not self.elem_bytes > 0:
            raise ValueError(f"elem_bytes must be positive, got {self.elem_bytes!r}")


@dataclass(frozen=True)
class Subspace:
    """Hyper-parameters of the coefficient-space method that the cost depends on (spec R3-R9).

    ``chunks`` fixes J; otherwise ``max_chunk`` = L gives J = ceil(T / L) (spec R3.1); with
    neither J = 1. ``ell_k``/``ell_v`` are the FD sketch sizes of an online state (None: static,
    no sketches). ``refresh_every`` marks the rotating state of spec A8. ``coef`` names a format of
    :data:`ROOFLINE_FORMATS` (or is its :class:`~subspace_ref.formats.CoefficientFormat`): float
    coefficients are stored like the cache, ``elem_bytes`` each (spec R4.1), the others as their
    record's byte rule says (int8: spec R4.3). ``rope``
    marks a pre-RoPE static state, whose attend rebuilds and rotates every key (spec R13).
    """

    r: int
    r_v: int
    chunks: int | None = None
    max_chunk: int | None = None
    ell_k: int | None = None
    ell_v: int | None = None
    refresh_every: int | None = None
    coef: str = FLOAT
    rope: bool = False  # a pre-RoPE static state (spec/rope.md P3): the attend of spec R13

    def __post_init__(self):
        fmt = coefficient_format(self.coef, "coef")
        if fmt.name not in ROOFLINE_FORMATS:
            raise ValueError(f"coef must be one of {', '.join(map(repr, ROOFLINE_FORMATS))} (spec R4), got {fmt.name!r}")
        object.__setattr__(self, "coef", fmt.name)
        if (self.ell_k is None) != (self.ell_v is None):
            raise ValueError("give both ell_k and ell_v (an online state) or neither (static)")
        if self.chunks is not None and self.max_chunk is not None:
            raise ValueError("give chunks (fixed J) or max_chunk (J = ceil(T/L)), not both")
        if self.rope and (self.online or self.max_chunk is not None or self.chunks not in (None, 1)):
            raise ValueError("rope=True describes a static state (one chunk, no sketches): spec/rope.md P2")

    @classmethod
    def static(cls, r: int, r_v: int | None = None, coef: str = FLOAT, rope: bool = False) -> "Subspace":
        """Spec A6: one basis, no sketches (``rope``: pre-RoPE, spec/rope.md P2-P3)."""
        return cls(r, r if r_v is None else r_v, chunks=1, coef=coef, rope=rope)

    @classmethod
    def adaptive(cls, r: int, r_v: int | None = None, *, max_chunk: int = 256, chunks: int | None = None,
                 ell_k: int | None = None, ell_v: int | None = None, coef: str = FLOAT) -> "Subspace":
        """Spec A7 with chunks closing every ``max_chunk`` tokens (or a fixed ``chunks``);
        sketch sizes default to twice the ranks, as :meth:`SubspaceState.adaptive` does."""
        r_v = r if r_v is None else r_v
        return cls(r, r_v, chunks=chunks, max_chunk=None if chunks is not None else max_chunk,
                   ell_k=2 * r if ell_k is None else ell_k, ell_v=2 * r_v if ell_v is None else ell_v, coef=coef)

    @property
    def online(self) -> bool:
        return self.ell_k is not None

    @property
    def coefficient_format(self) -> CoefficientFormat:
        """The record of :attr:`coef` (:mod:`subspace_ref.formats`)."""
        return FORMATS[self.coef]

    def token_bytes(self, e: float) -> tuple[float, float]:
        """Spec R4.1, R4.3: bytes of one token's key and value coefficients (codes and scales),
        from the format record's byte rule with float coefficients of ``e`` bytes."""
        fmt = self.coefficient_format
        return tuple(float(sum(fmt.stored_bytes(side, rank, 1, 1, e).values())) for side, rank in (("key", self.r), ("value", self.r_v)))

    def num_chunks(self, T: Any) -> Any:
        """Spec R3.1: J for context length T."""
        if self.chunks is not None:
            return self.chunks if np.ndim(T) == 0 else np.full(np.shape(T), self.chunks, dtype=float)
        if self.max_chunk is not None:
            return np.maximum(np.ceil(np.asarray(T, dtype=float) / self.max_chunk), 1.0)
        return 1 if np.ndim(T) == 0 else np.ones(np.shape(T))


# --------------------------------------------------------------------------- counting rules
def svd_flops(m: int, n: int) -> float:
    """Spec R8: thin SVD of an m x n matrix computing the singular values and both thin factors,
    6 q p^2 + 20 p^3 with p = min(m, n), q = max(m, n) (R-SVD; Golub & Van Loan, Matrix
    Computations, 4th ed., §8.6.3)."""
    p, q = min(m, n), max(m, n)
    return 6.0 * q * p * p + 20.0 * p**3


def exact_cost(T: Any, shape: Shape) -> Cost:
    """Exact attention (spec A1) for one decode token over T cached tokens of one KV head
    (spec R2): its ``group`` query heads read K and V once."""
    T = _as_T(T)
    d, dv, g, e = shape.d, shape.d_v, shape.group, shape.elem_bytes
    return Cost((
        Term("logits", "attend", 2.0 * g * T * d, T * d * e),  # R2.1, R2.5
        Term("softmax", "attend", SOFTMAX_FLOPS_PER_LOGIT * g * T, 0.0 * T),  # R2.2
        Term("aggregate", "attend", 2.0 * g * T * dv, T * dv * e),  # R2.3, R2.5
        Term("normalise", "attend", float(g * dv), 0.0),  # R2.4
        Term("query_io", "attend", 0.0, g * (d + dv) * e),  # R2.6
        Term("append", "append", 0.0, 2.0 * (d + dv) * e),  # R5.1
    ))


def subspace_cost(T: Any, shape: Shape, sub: Subspace) -> Cost:
    """Coefficient-space attention (spec A2, A3) for one decode token over T cached tokens of one
    KV head, with its append (A6/A7) and, for online states, FD upkeep and basis snapshots
    (A4, A7) amortised per token (spec R3-R9)."""
    T = _as_T(T)
    d, dv, g, e = shape.d, shape.d_v, shape.group, shape.elem_bytes
    r, rv = sub.r, sub.r_v
    J = sub.num_chunks(T)
    ck, cv = sub.token_bytes(e)  # R4.1, R4.3
    quant = 2.0 * (r + rv) if sub.coefficient_format.per_token_scale else 0.0  # R5.2
    if sub.rope:
        key_terms = [
            Term("rebuild", "attend", 2.0 * T * r * d, r * d * e),  # R13.1 (B read once, R4.2)
            Term("rope", "attend", ROPE_FLOPS_PER_DIM * T * d, 0.0 * T),  # R13.2, R13.3
            Term("logits", "attend", 2.0 * g * T * d, T * ck),  # R13.4, R4.1
        ]
    else:
        key_terms = [
            Term("query_proj", "attend", 2.0 * g * J * r * d, J * r * d * e),  # R3.2, R4.2
            Term("logits", "attend", 2.0 * g * T * r, T * ck),  # R3.3, R4.1
        ]
    terms = key_terms + [
        Term("softmax", "attend", SOFTMAX_FLOPS_PER_LOGIT * g * T, 0.0 * T),  # R3.4
        Term("aggregate", "attend", 2.0 * g * T * rv, T * cv),  # R3.5, R4.1
        Term("reconstruct", "attend", 2.0 * g * J * rv * dv, J * rv * dv * e),  # R3.6, R4.2
        Term("merge", "attend", g * ((J - 1) * (dv + 3) + dv), 0.0 * J),  # R3.7
        Term("query_io", "attend", 0.0, g * (d + dv) * e),  # R4.4
        # R5.2: read k_t, v_t and the open chunk's bases, project, write the coefficients
        # (R13.5: a pre-RoPE state also un-rotates k_t)
        Term("append", "append", 2.0 * (r * d + rv * dv) + quant + (ROPE_FLOPS_PER_DIM * d if sub.rope else 0.0),
             (d + dv) * e + (r * d + rv * dv) * e + ck + cv),
    ]
    if sub.online:
        terms += _online_terms(T, J, shape, sub)
    return Cost(tuple(terms))


def _online_terms(T, J, shape: Shape, sub: Subspace) -> list[Term]:
    d, dv, e = shape.d, shape.d_v, shape.elem_bytes
    r, rv, lk, lv = sub.r, sub.r_v, sub.ell_k, sub.ell_v
    terms = []
    if sub.refresh_every is None:
        # R6: the four squared norms of the residual test (A7 step 2)
        terms.append(Term("residual", "append", 2.0 * (d + r + dv + rv), 0.0))
    terms.append(Term("fd_row", "fd", 0.0, (d + dv) * e))  # R7.1: write the row into each buffer
    per_compaction = _compaction(lk, d, e), _compaction(lv, dv, e)  # R7.2
    terms.append(Term(
        "fd_compact", "fd",
        per_compaction[0][0] / (lk + 1) + per_compaction[1][0] / (lv + 1),  # R7.3: once per ell + 1 rows
        per_compaction[0][1] / (lk + 1) + per_compaction[1][1] / (lv + 1),
    ))
    snap_f = svd_flops(2 * lk, d) + svd_flops(2 * lv, dv)  # R9.1
    snap_b = (2 * lk * d + 2 * lv * dv + r * d + rv * dv) * e
    if sub.refresh_every is None:
        per_token = (J - 1) / T  # R9.2: J - 1 snapshots over T tokens
        terms.append(Term("snapshot", "fd", snap_f * per_token, snap_b * per_token))
    else:
        m = sub.refresh_every  # R9.3: rotating state, a snapshot and a rotation of all T rows every m tokens
        ck, cv = sub.token_bytes(e)
        terms.append(Term("snapshot", "fd", snap_f / m + 0.0 * T, snap_b / m + 0.0 * T))
        terms.append(Term("rotate", "fd", (2.0 * T * (r * r + rv * rv) + 2.0 * (r * r * d + rv * rv * dv)) / m,
                          2.0 * T * (ck + cv) / m))
    return terms


def _compaction(ell: int, d: int, e: float) -> tuple[float, float]:
    """Spec R7.2: one compaction of a 2 ell x d buffer: SVD, shrink (3 per singular value),
    rebuild diag(sigma') W^T (p x d multiplies); the buffer is read and written once."""
    p = min(2 * ell, d)
    return svd_flops(2 * ell, d) + 3.0 * p + p * d, 2.0 * (2 * ell * d) * e


def _as_T(T: Any) -> Any:
    arr = np.asarray(T)
    if np.any(arr < 1):
        raise ValueError(f"T must be >= 1, got {T!r}")
    return float(T) if arr.ndim == 0 else arr.astype(float)


# --------------------------------------------------------------------------- states
def subspace_for_state(state, head: int = 0, seq: int = 0) -> Subspace:
    """The :class:`Subspace` of one head of a :class:`~subspace_ref.SubspaceState`, with J fixed
    to that head's current chunk count (spec R3.1) and the state's coefficient format when the
    model counts it (:data:`ROOFLINE_FORMATS`, spec R4.3); other formats count as float."""
    p = state.policy
    coef = getattr(state.layout, "coefficients", FLOAT)
    coef = coef if coef in ROOFLINE_FORMATS else FLOAT
    J = int(np.asarray(state.num_chunks).reshape(-1, state.heads)[seq, head])
    rope = getattr(p, "rope", None) is not None
    online = getattr(p, "ell_k", None)
    return Subspace(
        r=p.rank_k[head], r_v=p.rank_v[head], chunks=J,
        ell_k=p.ell_k if online else None, ell_v=p.ell_v if online else None,
        refresh_every=getattr(p, "refresh_every", None), coef=coef, rope=rope,
    )


def state_cost(state, group: int = 1, elem_bytes: float | None = None, T: int | None = None) -> Cost:
    """Cost of one decode token over a whole state (spec R10.3): the sum over its sequences and
    heads of :func:`subspace_cost` with each head's rank and chunk count. ``elem_bytes``
    defaults to the itemsize of the state's floating dtype (its bases); ``T`` to its token count."""
    e = float(state.dtype.itemsize) if elem_bytes is None else elem_bytes  # numpy, cupy and torch dtypes
    shape = Shape(state.d, state.d_v, group, e)
    T = state.num_tokens if T is None else T
    total = None
    for n in range(state.batch):
        for h in range(state.heads):
            c = subspace_cost(T, shape, subspace_for_state(state, h, n))
            total = c if total is None else total + c
    return total


def exact_layer_cost(T: Any, shape: Shape, heads: int, batch: int = 1) -> Cost:
    """Spec R10.3: exact attention over a layer of ``heads`` KV heads and ``batch`` sequences."""
    return exact_cost(T, shape).scaled(heads * batch)


# --------------------------------------------------------------------------- machine
@dataclass(frozen=True)
class Machine:
    """A roofline (spec R10): sustained memory ``bandwidth`` (bytes/s) and ``flops`` (FLOP/s).
    ``math.inf`` for either removes that roof."""

    name: str
    bandwidth: float
    flops: float
    details: dict = field(default_factory=dict, compare=False)

    @property
    def ridge(self) -> float:
        """FLOPs per byte above which work is compute-bound."""
        return self.flops / self.bandwidth

    def __str__(self) -> str:
        return f"{self.name}: {self.bandwidth / 1e9:.3g} GB/s, {self.flops / 1e9:.3g} GFLOP/s"


def h100(tensor_cores: bool = False) -> Machine:
    """The H100 SXM5 roofline from its datasheet (spec R13.6): float32 CUDA cores, or the dense
    16-bit tensor-core rate for kernels whose O(r d) products run on tensor cores."""
    return Machine("H100 SXM5 (datasheet, " + ("bf16 tensor cores)" if tensor_cores else "fp32 CUDA cores)"),
                   H100_BANDWIDTH, H100_TENSOR_FLOPS if tensor_cores else H100_FP32_FLOPS)


def binding_roofs(T: int, shape: Shape, subs: dict[str, Subspace], machines: Iterable[Machine]) -> list[dict]:
    """Spec R13.7: for each configuration and machine, the attend phase's FLOPs per byte, the
    roof that binds (R10.2) and the predicted time over exact attention's on that machine."""
    exact = exact_cost(T, shape).phase("attend")
    rows = []
    for name, sub in subs.items():
        cost = subspace_cost(T, shape, sub).phase("attend")
        for m in machines:
            rows.append(dict(config=name, machine=m.name, intensity=float(cost.intensity), bound=cost.bound(m),
                             ratio_to_exact=float(cost.time(m) / exact.time(m))))
    return rows


def _median_time(fn: Callable[[], Any], repeats: int, sync: Callable[[], Any] = lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_cpu(copy_bytes: int = 64 << 20, matmul_n: int = 1024, repeats: int = 7, dtype: Any = np.float32,
                name: str | None = None) -> Machine:
    """This machine's roofline (spec R12): copy bandwidth from a ``copy_bytes`` NumPy copy
    (counted as read + write, 2 x ``copy_bytes`` moved, STREAM's convention) and the matmul FLOP
    rate of ``matmul_n`` x ``matmul_n`` ``dtype`` products (2 n^3 each); medians of ``repeats``."""
    n = max(1, int(copy_bytes) // 8)
    src = np.ones(n, dtype=np.float64)
    dst = np.empty_like(src)
    t_copy = _median_time(lambda: np.copyto(dst, src), repeats)
    a = np.random.default_rng(0).standard_normal((matmul_n, matmul_n)).astype(dtype)
    b = a.T.copy()
    out = np.empty_like(a)
    t_mm = _median_time(lambda: np.matmul(a, b, out=out), repeats)
    return Machine(
        name=name or f"cpu {platform.machine()} ({_cpu_count()} cores)",
        bandwidth=2.0 * n * 8 / t_copy,
        flops=2.0 * matmul_n**3 / t_mm,
        details={"copy_bytes": n * 8, "copy_s": t_copy, "matmul_n": matmul_n, "matmul_s": t_mm,
                 "dtype": np.dtype(dtype).name, "repeats": repeats},
    )


def measure_torch(device: str = "cuda", copy_bytes: int = 256 << 20, matmul_n: int = 4096, repeats: int = 7,
                  dtype: Any = None, name: str | None = None) -> Machine:
    """Spec R12 on a torch device: ``Tensor.copy_`` bandwidth (read + write) and matmul FLOP
    rate, synchronising the device before each host timer stops. ``dtype`` defaults to
    torch.float32 (with TF32 as torch is configured)."""
    import torch

    dtype = dtype or torch.float32
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    n = max(1, int(copy_bytes) // 4)
    src = torch.ones(n, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    t_copy = _median_time(lambda: dst.copy_(src), repeats, sync)
    a = torch.randn(matmul_n, matmul_n, dtype=dtype, device=dev)
    b = torch.randn(matmul_n, matmul_n, dtype=dtype, device=dev)
    t_mm = _median_time(lambda: a @ b, repeats, sync)
    label = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"torch cpu ({torch.get_num_threads()} threads)"
    return Machine(
        name=name or label,
        bandwidth=2.0 * n * 4 / t_copy,
        flops=2.0 * matmul_n**3 / t_mm,
        details={"copy_bytes": n * 4, "copy_s": t_copy, "matmul_n": matmul_n, "matmul_s": t_mm,
                 "dtype": str(dtype), "repeats": repeats},
    )


def _cpu_count() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


# --------------------------------------------------------------------------- predictions
def predicted_time(cost: Cost, machine: Machine) -> Any:
    """Spec R10.1 (alias of :meth:`Cost.time`)."""
    return cost.time(machine)


def break_even(shape: Shape, sub: Subspace, machine: Machine, phases: Iterable[str] = PHASES,
               t_max: int = 1 << 20) -> int | None:
    """Spec R11: the least context length T in [1, t_max] such that the subspace method's
    predicted time (the given phases of a decode step) is strictly below exact attention's at
    every T' in [T, t_max]; None when it is not below at t_max. Every integer is evaluated."""
    phases = tuple(phases)
    T = np.arange(1, int(t_max) + 1, dtype=float)
    wins = subspace_cost(T, shape, sub).phase(*phases).time(machine) < exact_cost(T, shape).phase(*phases).time(machine)
    if not wins[-1]:
        return None
    losing = np.flatnonzero(~wins)
    return 1 if losing.size == 0 else int(losing[-1]) + 2


def speedup(T: Any, shape: Shape, sub: Subspace, machine: Machine, phases: Iterable[str] = PHASES) -> Any:
    """Predicted exact time / subspace time (spec R10.1) at context length T."""
    phases = tuple(phases)
    return exact_cost(T, shape).phase(*phases).time(machine) / subspace_cost(T, shape, sub).phase(*phases).time(machine)


def summary(T: int, shape: Shape, sub: Subspace, machine: Machine) -> str:
    """A human-readable breakdown (used by the CLI and docs)."""
    ex, su = exact_cost(T, shape), subspace_cost(T, shape, sub)
    be = break_even(shape, sub, machine)
    return "\n".join([
        f"machine  {machine}",
        f"exact    T={T}: {ex.flops:.4g} FLOPs, {ex.bytes:.4g} B, {ex.time(machine) * 1e6:.3g} us ({ex.bound(machine)}-bound)",
        f"subspace T={T}: {su.flops:.4g} FLOPs, {su.bytes:.4g} B, {su.time(machine) * 1e6:.3g} us ({su.bound(machine)}-bound)",
        f"break-even context length: {be if be is not None else 'none up to 2^20'}",
        su.table(),
    ])


__all__ = [
    "PHASES",
    "ROOFLINE_FORMATS",
    "ROPE_FLOPS_PER_DIM",
    "Cost",
    "Machine",
    "Shape",
    "Subspace",
    "Term",
    "binding_roofs",
    "break_even",
    "exact_cost",
    "exact_layer_cost",
    "h100",
    "measure_cpu",
    "measure_torch",
    "predicted_time",
    "speedup",
    "state_cost",
    "subspace_cost",
    "subspace_for_state",
    "summary",
    "svd_flops",
]
