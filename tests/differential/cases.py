"""Cases of the differential harness: shapes, state kinds and input distributions.

Variants (spec/window.md sinks and windows, spec/rope.md pre-RoPE bases, spec/sharing.md query
groups, spec/sketch_variants.md ring/stride/reuse, int8 coefficients, encoded bases) are fields of
the same :class:`Case`, so every backend meets them in the same matrix; a backend that lacks one
must refuse it with a reason its declared capabilities give (:func:`.harness.declared_gaps`).

Each case is drawn afresh from its own seed (``crc32(case name)`` xor ``SUBSPACE_DIFF_SEED``,
default 0), so every case has independent random inputs and a failure is reproduced by
re-running with the same environment. States are built by the float64 NumPy oracle
(``append_reference``); every backend is then compared with that oracle on the same state.
"""

from __future__ import annotations

import math

import functools
import os
import zlib
from dataclasses import dataclass

import numpy as np

import subspace_ref as sr
from subspace_ref.numpy_backend import attend_reference

BASE_SEED = int(os.environ.get("SUBSPACE_DIFF_SEED", "0"))


@dataclass(frozen=True)
class Case:
    """One state and one query batch. ``data``: "random" (Gaussian keys/values: the adaptive
    residual trigger fires often) or "lowrank" (keys/values in a subspace the warm-up captures,
    plus 1e-6 noise: only the max_chunk rule fires, so chunk boundaries are at multiples of L).
    ``logit``: rescale q so that max |logit| equals it (None: natural size, |logit| ~ 1)."""

    name: str
    kind: str  # "static", "adaptive", "rotating"
    N: int = 1
    H: int = 2
    group: int = 1
    d: int = 16
    d_v: int = 16
    rank_k: int | tuple[int, ...] = 4
    rank_v: int | tuple[int, ...] = 4
    T: int = 32
    max_chunk: int = 8
    tau: float = 0.5
    refresh_every: int = 8
    warmup: int | None = None
    sketch_reset: bool = False
    data: str = "random"
    logit: float | None = None
    scale: float | None = None
    coefficients: str = "float"  # or "int8" (spec A10), "int4", "int2" (spec/quantization.md), or "key/value" formats (Q0, e.g. "int4/int8")
    group_size: int = 32  # tokens per key group of int4/int2 coefficients (spec/quantization.md Q2)
    bases: str = "native"  # or "float16", "int8" (spec/storage.md S1)
    window: int = 0  # spec/window.md W1: exact recent window ...
    min_tokens: int = 0  # ... and length threshold
    lookahead: int = 0  # W4, adaptive only
    sinks: int = 0  # W7: exact first tokens
    rope: bool = False  # spec/rope.md P2: pre-RoPE static bases (a partial-rotary RopeParams)
    share: bool = False  # spec/sharing.md A3: static bases per QUERY head, query_group = group
    ring_warm_start: int = 0  # spec/sketch_variants.md S1 (adaptive)
    fd_stride: int = 1  # S2 (adaptive)
    reuse_angle: float | None = None  # S3 (adaptive)
    byte_ceiling: float = 1.0  # spec A7.3 (adaptive); math.inf: seed 001's uncapped policy
    trigger: str = "reproject"  # spec A7.2 (adaptive); "paper": seed 001's order

    @property
    def features(self) -> frozenset[str]:
        """The variants this case switches on, by the names backends' refusals are declared with
        (harness.declared_gaps)."""
        on = {
            "window": self.window or self.min_tokens,
            "lookahead": self.lookahead,
            "sinks": self.sinks,
            "rope": self.rope,
            "query_group": self.share,
            "ring_warm_start": self.ring_warm_start,
            "fd_stride": self.fd_stride != 1,
            "reuse_angle": self.reuse_angle is not None,
            "int8": self.coefficients == "int8",
            "int4": self.coefficients == "int4",
            "int2": self.coefficients == "int2",
            "mixed_formats": "/" in self.coefficients,
            "encoded_bases": self.bases != "native",
        }
        return frozenset(name for name, value in on.items() if value)

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode()) ^ BASE_SEED

    def __str__(self) -> str:
        return self.name


L = 8  # max_chunk of the boundary cases
M = 8  # refresh period of the rotating boundary cases

CASES = [
    # static (spec A6): T = 1, batch > 1, r = d, r = 1, GQA 1/4/8, per-head ranks, huge logits
    Case("static-T1", "static", T=1),
    Case("static-N2-gqa4-r_eq_d", "static", N=2, group=4, d=16, d_v=12, rank_k=16, rank_v=12, T=50),
    Case("static-r1-gqa8", "static", H=1, group=8, rank_k=1, rank_v=1, T=40),
    Case("static-head_ranks", "static", N=2, H=3, group=2, rank_k=(2, 5, 3), rank_v=(4, 1, 2), T=64),
    Case("static-logits1e4", "static", N=2, group=4, T=300, logit=1e4),
    Case("static-scale", "static", T=20, scale=0.37),
    Case("static-T4000", "static", H=4, group=2, d=32, d_v=32, rank_k=8, rank_v=8, T=4000),
    # adaptive (spec A7): chunk boundaries at 1, L-1, L, L+1 (uncapped: the byte ceiling, spec A7.3,
    # lets a chunk of these ranks open only past ~11 tokens); one chunk; hundreds of chunks
    Case("adaptive-T1", "adaptive", group=4, T=1, max_chunk=L, data="lowrank"),
    Case("adaptive-T_L-1", "adaptive", group=4, T=L - 1, max_chunk=L, data="lowrank", byte_ceiling=math.inf),
    Case("adaptive-T_L", "adaptive", group=4, T=L, max_chunk=L, data="lowrank", byte_ceiling=math.inf),
    Case("adaptive-T_L+1", "adaptive", group=4, T=L + 1, max_chunk=L, data="lowrank", byte_ceiling=math.inf),
    Case("adaptive-T_5L+1-N2", "adaptive", N=2, group=2, T=5 * L + 1, max_chunk=L, data="lowrank", byte_ceiling=math.inf),
    Case("adaptive-one_chunk", "adaptive", group=2, T=40, max_chunk=64, data="lowrank"),
    # hundreds of chunks: the uncapped policy (the byte ceiling, spec A7.3, would keep ~150)
    Case("adaptive-hundreds", "adaptive", N=2, group=2, rank_k=3, rank_v=3, T=500, max_chunk=16, tau=0.6, byte_ceiling=math.inf),
    Case("adaptive-gqa8-logits1e4", "adaptive", H=1, group=8, T=200, max_chunk=16, tau=0.7, logit=1e4),
    Case("adaptive-head_ranks", "adaptive", N=2, H=3, rank_k=(2, 4, 3), rank_v=(3, 2, 4), T=150, max_chunk=32, tau=0.8),
    Case("adaptive-paper_no_warmup", "adaptive", group=2, T=60, warmup=0, tau=0.7, trigger="paper", byte_ceiling=math.inf),
    Case("adaptive-r_eq_d", "adaptive", group=2, d=8, d_v=8, rank_k=8, rank_v=8, T=50, max_chunk=16),
    Case("adaptive-sketch_reset", "adaptive", group=2, T=120, max_chunk=16, tau=0.95, sketch_reset=True, data="lowrank"),
    # chunks of exactly max(ell_k, ell_v) = 8 tokens: the edge of step 3b's "long enough to reset"
    Case(
        "adaptive-sketch_reset-chunk_eq_ell",
        "adaptive",
        group=2,
        d=12,
        d_v=10,
        rank_k=4,
        rank_v=3,
        T=50,
        max_chunk=8,
        tau=0.95,
        sketch_reset=True,
        data="lowrank",
    ),
    # rotating (spec A8): refresh boundaries at 1, m-1, m, m+1; long with huge logits
    Case("rotating-T1", "rotating", group=4, T=1, refresh_every=M),
    Case("rotating-T_m-1", "rotating", group=4, T=M - 1, refresh_every=M),
    Case("rotating-T_m", "rotating", group=4, T=M, refresh_every=M),
    Case("rotating-T_m+1", "rotating", group=4, T=M + 1, refresh_every=M),
    Case("rotating-N2-gqa4-logits1e4", "rotating", N=2, group=4, T=400, refresh_every=16, logit=1e4),
    Case("rotating-head_ranks", "rotating", H=3, group=2, rank_k=(2, 4, 3), rank_v=(3, 1, 2), T=100, refresh_every=10),
    Case("rotating-r_eq_d", "rotating", group=2, d=8, d_v=8, rank_k=8, rank_v=8, T=40, refresh_every=M),
    # int8 coefficients with per-token float32 scales (spec A10)
    Case("static-int8-N2-gqa4", "static", N=2, group=4, T=300, coefficients="int8"),
    Case("adaptive-int8", "adaptive", N=2, group=2, T=150, max_chunk=16, tau=0.7, coefficients="int8"),
    Case("rotating-int8-logits1e4", "rotating", group=4, T=100, refresh_every=16, logit=1e4, coefficients="int8"),
    # bases stored as float16 or int8 with per-row scales (spec/storage.md S1)
    Case("static-f16bases-gqa4", "static", N=2, group=4, T=120, bases="float16"),
    Case("adaptive-int8bases", "adaptive", N=2, group=2, T=150, max_chunk=16, tau=0.7, bases="int8"),
    Case("rotating-f16bases-int8", "rotating", group=2, T=60, refresh_every=8, coefficients="int8", bases="float16"),
    # variants (issue 18 item 6), every one with d != d_v and per-head gamma != 1 (empty_state draws gamma)
    Case("static-window-gqa4", "static", N=2, group=4, d=16, d_v=10, T=40, window=6),
    Case("static-window-below_min_tokens", "static", group=2, d=12, d_v=16, T=30, window=4, min_tokens=100),
    Case("static-sinks-window-head_ranks", "static", N=2, H=3, group=2, d=16, d_v=8, rank_k=(2, 5, 3), rank_v=(4, 1, 2), T=64, sinks=4, window=5),
    Case("static-sinks-only-logits1e4", "static", group=4, d=16, d_v=12, T=100, sinks=3, logit=1e4),
    Case("adaptive-sinks-window", "adaptive", N=2, group=2, d=16, d_v=8, T=90, max_chunk=16, tau=0.7, sinks=3, window=7),
    Case("adaptive-window-lookahead", "adaptive", group=2, d=12, d_v=16, T=70, max_chunk=16, tau=0.7, window=8, lookahead=4),
    Case("rotating-sinks-window-min_tokens", "rotating", group=4, d=12, d_v=16, T=60, refresh_every=8, sinks=2, window=5, min_tokens=20),
    Case("static-rope", "static", group=2, d=16, d_v=12, T=50, rope=True),
    Case("static-rope-window", "static", N=2, group=4, d=16, d_v=8, T=40, rope=True, window=6),
    Case("static-query_group2", "static", N=2, H=2, group=2, d=16, d_v=12, T=50, share=True),
    Case("static-query_group4-sinks-int8", "static", H=1, group=4, d=16, d_v=8, T=60, share=True, sinks=2, window=4, coefficients="int8"),
    Case("adaptive-ring", "adaptive", group=2, d=16, d_v=12, T=80, max_chunk=16, tau=0.7, ring_warm_start=8),
    Case("adaptive-stride2", "adaptive", N=2, group=2, d=12, d_v=16, T=80, max_chunk=16, tau=0.7, fd_stride=2),
    Case("adaptive-reuse-int8", "adaptive", group=2, d=16, d_v=12, T=80, max_chunk=8, tau=0.7, reuse_angle=0.6, coefficients="int8"),
    # int4/int2 coefficients (spec/quantization.md Q2): complete key groups and a float tail,
    # groups straddling chunks, refreshes re-quantising, huge logits, composed with pre-RoPE
    # bases and with sinks + window
    Case("static-int4-N2-gqa4-G8", "static", N=2, group=4, d=16, d_v=12, T=45, coefficients="int4", group_size=8),
    Case("adaptive-int2-G8", "adaptive", N=2, group=2, d=12, d_v=16, T=70, max_chunk=16, tau=0.7, coefficients="int2", group_size=8),
    Case("rotating-int4-logits1e4", "rotating", group=4, d=16, d_v=12, T=60, refresh_every=16, logit=1e4, coefficients="int4", group_size=8),
    Case("static-rope-int4", "static", group=2, d=16, d_v=12, T=50, rope=True, coefficients="int4", group_size=16),
    Case("static-rope-int2-window", "static", group=2, d=16, d_v=8, T=40, rope=True, window=6, coefficients="int2", group_size=8),
    # spec/window.md W10: compressed token t rotated at position S + t after the sinks
    Case("static-rope-sinks-window", "static", N=2, group=2, d=16, d_v=8, T=45, rope=True, sinks=3, window=5),
    Case("static-rope-sinks-int4", "static", group=2, d=16, d_v=12, T=50, rope=True, sinks=4, coefficients="int4", group_size=8),
    Case("static-sinks-window-int2", "static", N=2, group=2, d=16, d_v=8, T=60, sinks=3, window=5, coefficients="int2", group_size=8),
    Case("adaptive-sinks-int4", "adaptive", group=2, d=16, d_v=12, T=70, max_chunk=16, tau=0.7, sinks=4, coefficients="int4", group_size=8),
    # a format per side (spec/quantization.md Q0; the head groups of spec/layer_state.md L2)
    Case("static-int4keys-int8values-N2-gqa4", "static", N=2, group=4, d=16, d_v=12, T=45, coefficients="int4/int8", group_size=8),
    Case("static-rope-sinks-window-int4keys-floatvalues", "static", group=2, d=16, d_v=12, T=50, rope=True, sinks=3, window=5, coefficients="int4/float", group_size=8),
    Case("static-int8keys-int2values-sinks", "static", N=2, group=2, d=12, d_v=16, T=40, sinks=2, window=4, coefficients="int8/int2", group_size=8),
    Case("static-floatkeys-int4values-logits1e4", "static", group=4, d=16, d_v=16, T=40, logit=1e4, coefficients="float/int4"),
    Case("adaptive-int2keys-int4values", "adaptive", group=2, d=16, d_v=12, T=60, max_chunk=16, tau=0.7, coefficients="int2/int4", group_size=8),
    Case("rotating-floatkeys-int8values", "rotating", group=2, T=60, refresh_every=16, coefficients="float/int8"),
]

# Bigger sweeps, run on purpose: pytest -m slow tests/differential
SLOW_CASES = [
    Case("slow-static-d128-T16k", "static", H=4, group=2, d=128, d_v=128, rank_k=32, rank_v=32, T=16384),
    Case("slow-static-gqa8-logits1e4-T8k", "static", N=2, H=2, group=8, d=64, d_v=64, rank_k=16, rank_v=16, T=8192, logit=1e4),
    Case("slow-adaptive-d64-T3000", "adaptive", N=2, H=2, group=4, d=64, d_v=64, rank_k=8, rank_v=8, T=3000, max_chunk=128, tau=0.9),
    Case("slow-adaptive-lowrank-T4000", "adaptive", H=4, group=2, d=32, d_v=32, rank_k=8, rank_v=8, T=4000, max_chunk=64, data="lowrank"),
    Case("slow-adaptive-logits1e4-T2000", "adaptive", N=2, H=2, group=4, T=2000, max_chunk=32, tau=0.75, logit=1e4),
    Case("slow-rotating-d64-T3000", "rotating", N=2, H=2, group=4, d=64, d_v=64, rank_k=8, rank_v=8, T=3000, refresh_every=64),
    Case("slow-static-int8-d128-T8k", "static", H=4, group=4, d=128, d_v=128, rank_k=32, rank_v=32, T=8192, coefficients="int8"),
    # int4/int2 at the benchmark's head size: 256 complete key groups and a tail of 8; many
    # chunks and a tail of 24; a 256-token exact window (16 exact tiles) beside sinks
    Case("slow-static-int4-d128-T8200", "static", H=4, group=4, d=128, d_v=128, rank_k=32, rank_v=32, T=8200, coefficients="int4"),
    Case("slow-adaptive-int2-d64-T3000", "adaptive", N=2, H=2, group=4, d=64, d_v=64, rank_k=8, rank_v=8, T=3000, max_chunk=128, tau=0.9, coefficients="int2"),
    Case("slow-static-sinks-window256-T4000", "static", H=2, group=4, d=64, d_v=48, rank_k=16, rank_v=16, T=4000, sinks=4, window=256),
] + [
    Case(
        f"slow-random-{i}",
        kind,
        N=1 + i % 2,
        H=1 + i % 3,
        group=(1, 4, 8)[i % 3],
        d=(8, 16, 32)[i % 3],
        d_v=(8, 12, 32)[i % 3],
        rank_k=(1, 4, 8)[i % 3],
        rank_v=(2, 3, 8)[i % 3],
        T=(1, 37, 700, 64)[i % 4],
        max_chunk=(4, 16, 64)[i % 3],
        tau=0.6,
        refresh_every=(3, 16)[i % 2],
        logit=(None, 1e2, 1e4)[i % 3],
    )
    for i, kind in enumerate(["static", "adaptive", "rotating"] * 4)
]


def _orthonormal(rng, H: int, ranks: tuple[int, ...], dim: int) -> np.ndarray:
    out = np.zeros((H, max(ranks), dim))
    for h, r in enumerate(ranks):
        q, _ = np.linalg.qr(rng.standard_normal((dim, r)))
        out[h, :r] = q.T
    return out


def _ranks(rank, H):
    return (rank,) * H if isinstance(rank, int) else tuple(rank)


def rope_params(d: int):
    """Partial rotary (3/4 of the dims rotate), Llama's "half" layout, attention scaling != 1."""
    from subspace_ref.rope import RopeParams

    m = 3 * d // 8
    return RopeParams(1.0 / 10000.0 ** (np.arange(m) / m), attention_scaling=1.1)


def low_bit(case: Case) -> bool:
    """Whether a side of the case stores int4/int2 codes (spec/quantization.md Q2)."""
    return any(name in ("int4", "int2") for name in case.coefficients.split("/"))


def empty_state(case: Case, rng) -> sr.SubspaceState:
    """The case's state before any token, float64 NumPy, batched (N, H, ...)."""
    heads = case.H * case.group if case.share else case.H  # query_group: one basis per query head
    gamma = rng.uniform(0.5, 1.5, heads)
    exact = dict(window=case.window, min_tokens=case.min_tokens, sinks=case.sinks)
    if low_bit(case):
        exact["group_size"] = case.group_size
    if case.kind == "static":
        B = _orthonormal(rng, heads, _ranks(case.rank_k, heads), case.d)
        E = _orthonormal(rng, heads, _ranks(case.rank_v, heads), case.d_v)
        return sr.SubspaceState.static(
            sr.StaticBasis.from_bases(B, E, gamma),
            batch=case.N,
            coefficients=case.coefficients,
            bases=case.bases,
            rope=rope_params(case.d) if case.rope else None,
            query_group=case.group if case.share else 1,
            **exact,
        )
    common = dict(
        rank_k=case.rank_k, rank_v=case.rank_v, warmup=case.warmup, gamma=gamma, batch=case.N, coefficients=case.coefficients, bases=case.bases, **exact
    )
    if case.kind == "adaptive":
        return sr.SubspaceState.adaptive(
            case.H,
            case.d,
            case.d_v,
            tau_k=case.tau,
            tau_v=case.tau,
            max_chunk=case.max_chunk,
            sketch_reset=case.sketch_reset,
            lookahead=case.lookahead,
            ring_warm_start=case.ring_warm_start,
            fd_stride=case.fd_stride,
            reuse_angle=case.reuse_angle,
            byte_ceiling=case.byte_ceiling,
            trigger=case.trigger,
            **common,
        )
    return sr.SubspaceState.rotating(case.H, case.d, case.d_v, refresh_every=case.refresh_every, **common)


def logit_multipliers(state) -> np.ndarray:
    """(N, H_s, T): gamma for the compressed tokens, 1 for the exact ones (spec/window.md W3, W8),
    in the token order of ``state.reconstruct()`` (sinks, compressed, recent)."""
    N, Hs, T_c = state.batch, state.heads, state.layout.num_tokens
    s = 0 if state.window is None else state.window.sink_count
    out = np.ones((N, Hs, state.num_tokens))
    out[:, :, s : s + T_c] = state.layout.gamma[None, :, None]
    return out


def rotated_keys(state, K_hat: np.ndarray) -> np.ndarray:
    """Keys as attention sees them: a pre-RoPE state's compressed tokens rotated to their
    positions (spec/rope.md P3): compressed token t at position S + t after S sinks, which come
    first in the token order of ``state.reconstruct()`` (spec/window.md W10)."""
    rope = getattr(state.policy, "rope", None)
    if rope is None:
        return K_hat
    from subspace_ref.rope import rotate

    from subspace_ref.window import first_compressed_position

    T_c, S = state.layout.num_tokens, first_compressed_position(state)
    s = 0 if state.window is None else state.window.sink_count
    K_hat = K_hat.copy()
    K_hat[:, :, s : s + T_c] = rotate(K_hat[:, :, s : s + T_c], np.arange(S, S + T_c), rope)
    return K_hat


def tokens(case: Case, rng, T: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Keys (N, H, T, d) and values (N, H, T, d_v) of the case's distribution."""
    T = case.T if T is None else T
    N, H = case.N, case.H
    if case.data == "random":
        return rng.standard_normal((N, H, T, case.d)), rng.standard_normal((N, H, T, case.d_v))
    # "lowrank": a subspace of dimension W = the warm-up length, which the warm-up rows span
    w = min(min(_ranks(case.rank_k, H)), min(_ranks(case.rank_v, H))) if case.warmup is None else max(case.warmup, 1)
    out = []
    for dim in (case.d, case.d_v):
        basis = rng.standard_normal((N, H, w, dim))
        x = np.einsum("nhtw,nhwd->nhtd", rng.standard_normal((N, H, T, w)), basis)
        out.append(x + 1e-6 * rng.standard_normal(x.shape))
    return out[0], out[1]


@dataclass
class Built:
    case: Case
    state: sr.SubspaceState  # float64 NumPy, built by the oracle
    q: np.ndarray  # (N, H_q, d) float64
    scale: float | None
    out64: np.ndarray  # the float64 oracle's output
    max_logit: float


@functools.lru_cache(maxsize=None)
def build(case: Case) -> Built:
    """The case's oracle state, queries and float64 oracle output (cached per case: every
    backend and dtype of a case sees the same inputs)."""
    rng = np.random.default_rng(case.seed)
    state = empty_state(case, rng)
    K, V = tokens(case, rng)
    state.append(K, V)
    q = rng.standard_normal((case.N, case.H * case.group, case.d))
    s = 1.0 / np.sqrt(case.d) if case.scale is None else case.scale
    K_hat = rotated_keys(state, state.reconstruct()[0])  # (N, H_s, T, d)
    Hs = state.heads
    g = case.H * case.group // Hs
    logits = np.einsum("ngd,ntd->ngt", q.reshape(case.N * Hs, g, case.d), K_hat.reshape(case.N * Hs, case.T, case.d))
    logits = logits.reshape(case.N, Hs, g, case.T) * (s * logit_multipliers(state))[:, :, None, :]
    max_logit = float(np.abs(logits).max())
    if case.logit is not None and max_logit > 0:
        q *= case.logit / max_logit
        max_logit = case.logit
    out64 = attend_reference(q, state, case.scale)
    return Built(case, state, q, case.scale, out64, max_logit)
