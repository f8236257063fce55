"""Fixtures shared by the benchmark modules: parameter grids, backend targets, synthetic keys and
values, state construction and a synchronising timer.

Targets name a backend and a device: ``numpy`` (the oracle), ``torch-cpu``, ``torch-cuda``,
``triton`` and ``cupy`` (CUDA). A target that cannot run here raises ``NotImplementedError`` in
``setup`` -- asv's way to skip a benchmark -- with the backend's own reason as the message.
"""

from __future__ import annotations

import os
import pickle
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

import subspace_ref as sr
from subspace_ref.workloads import grown_states, near_subspace_tokens, spanning_basis

try:  # imported here so asv's forkserver loads it once; CUDA is only touched in setup
    import torch
except ImportError:  # pragma: no cover - torch is optional
    torch = None

#: SUBSPACE_BENCH_QUICK=1 shrinks every grid to one small point (used by CI, .ci/asv_quick.sh).
QUICK = os.environ.get("SUBSPACE_BENCH_QUICK", "") not in ("", "0")
#: Comma-separated targets that must run (CI: "numpy,torch-cpu"): for these an unavailable
#: backend fails the benchmark instead of skipping it, so a broken backend cannot pass as absent.
REQUIRED = {t for t in os.environ.get("SUBSPACE_BENCH_REQUIRE", "").split(",") if t}

HEADS = 8  # KV heads of one layer
GROUP = 1  # query heads per KV head
D = 128  # key and value head size
DTYPE = np.float32
MAX_CHUNK = 256  # adaptive states: chunks close at this length (the data never trips the residual test)

CONTEXTS = [1024] if QUICK else [1024, 4096, 16384, 65536]
RANKS = [16] if QUICK else [16, 32]
KINDS = ["static", "adaptive"]
TARGETS = ["numpy", "torch-cpu", "torch-cuda", "triton", "cupy"]
#: The NumPy oracle loops over heads and chunks in Python (and its adaptive append over tokens):
#: it is benchmarked at small contexts only.
NUMPY_MAX_T = 4096


# ----------------------------------------------------------------------------- targets
@dataclass(frozen=True)
class Target:
    name: str
    backend: str
    device: str | None

    @property
    def cuda(self) -> bool:
        return self.device is not None and self.device.startswith("cuda")

    def convert(self, x: np.ndarray) -> Any:
        """A NumPy array in this target's array family and device."""
        return sr.get_backend(self.backend).converter(device=self.device)(x)

    def state(self, state):
        return state.to(self.backend, device=self.device)

    def sync(self) -> None:
        """Wait for the device, so that a host timer stopping after it includes the GPU work."""
        if not self.cuda:
            return
        if self.backend == "cupy":
            import cupy

            cupy.cuda.runtime.deviceSynchronize()
        else:
            torch.cuda.synchronize()


_TARGETS = {
    "numpy": ("numpy", None),
    "torch-cpu": ("torch", "cpu"),
    "torch-cuda": ("torch", "cuda"),
    "triton": ("triton", "cuda"),
    "cupy": ("cupy", "cuda"),
}


def target(name: str) -> Target:
    """The target, or NotImplementedError (asv: skipped) saying why it cannot run here
    (RuntimeError, a failure, for a target named in SUBSPACE_BENCH_REQUIRE)."""
    backend, device = _TARGETS[name]
    info = {b.name: b for b in sr.backends()}.get(backend)
    reason = None
    if info is None:
        reason = f"{name}: backend {backend!r} is not registered"
    elif not info.available:
        reason = f"{name}: backend {backend!r} unavailable: {info.reason}"
    elif device == "cuda" and backend == "torch" and not torch.cuda.is_available():
        reason = f"{name}: torch sees no CUDA device"
    if reason is not None:
        if name in REQUIRED:
            raise RuntimeError(f"{reason} (required by SUBSPACE_BENCH_REQUIRE)")
        raise NotImplementedError(reason)
    return Target(name, backend, device)


def skip_numpy_oracle_at(tgt: Target, T: int) -> None:
    if tgt.backend == "numpy" and T > NUMPY_MAX_T:
        raise NotImplementedError(f"the NumPy oracle loops over heads and chunks in Python; benchmarked at T <= {NUMPY_MAX_T} only")


# ----------------------------------------------------------------------------- data and states
def tokens(seed: int, T: int, heads: int = HEADS, d: int = D) -> np.ndarray:
    """(heads, T, d) float32 rows near a fixed DATA_RANK-dimensional subspace per head
    (subspace_ref.workloads): a stand-in for post-RoPE keys of a calibrated head."""
    return near_subspace_tokens(seed, heads, T, d, DTYPE)


def static_state(T: int, r: int) -> sr.SubspaceState:
    """A NumPy static state (spec A6) holding T tokens (built with one block append: fast)."""
    state = sr.SubspaceState.static(spanning_basis(HEADS, D, r, DTYPE), dtype=DTYPE)
    for a in range(0, T, 16384):
        n = min(16384, T - a)
        state.append(tokens(1 + a, n), tokens(10**6 + a, n))
    return state


def adaptive_empty(r: int) -> sr.SubspaceState:
    return sr.SubspaceState.adaptive(HEADS, D, rank_k=r, rank_v=r, max_chunk=MAX_CHUNK, dtype=DTYPE)


def adaptive_states(contexts: list[int], r: int, numpy_only_to: int | None = None) -> dict[int, sr.SubspaceState]:
    """NumPy adaptive states (spec A7) at every context length, built by one growing stream.

    The adaptive append is sequential in the tokens; it runs on the torch backend (CPU) when
    that is available -- about twice as fast as the oracle -- and the copies are returned as NumPy
    states. Without torch, lengths above ``numpy_only_to`` are left out.
    """
    use_torch = torch is not None and {b.name: b.available for b in sr.backends()}.get("torch", False)
    if not use_torch and numpy_only_to is not None:
        contexts = [T for T in contexts if T <= numpy_only_to]

    def stream(start: int, n: int):
        return tokens(2 + start, n), tokens(2 * 10**6 + start, n)

    return grown_states(adaptive_empty(r), contexts, stream, "torch" if use_torch else "numpy")


def save_states(states: dict[Any, sr.SubspaceState], prefix: str) -> dict[Any, str]:
    """Pickle each state to its own file in the working directory (asv runs setup_cache and the
    benchmarks in the same directory), so a benchmark loads only the state it needs."""
    paths = {}
    for key, state in states.items():
        path = f"{prefix}-{'-'.join(map(str, key))}.pkl"
        with open(path, "wb") as f:
            pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
        paths[key] = os.path.abspath(path)
    return paths


def load_state(path: str) -> sr.SubspaceState:
    with open(path, "rb") as f:
        return pickle.load(f)


def query(tgt: Target, seed: int = 3) -> Any:
    q = np.random.default_rng(seed).standard_normal((HEADS * GROUP, D)).astype(DTYPE)
    return tgt.convert(q)


# ----------------------------------------------------------------------------- timing
def median_seconds(fn: Callable[[], Any], sync: Callable[[], None], min_total: float = 0.05, max_runs: int = 50) -> float:
    """Median wall time of ``fn`` (after one warm-up call), synchronising before each timer stop;
    runs until ``min_total`` seconds or ``max_runs`` runs (at least 3)."""
    fn()
    sync()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_total and len(times) < max_runs):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def exact_baseline(tgt: Target, T: int) -> Callable[[], Any]:
    """Exact attention (spec A1) over random K, V of T tokens on the target's device: the NumPy
    oracle ``exact_attention`` for ``numpy``, torch SDPA otherwise (on the GPU for CUDA targets)."""
    q = np.random.default_rng(5).standard_normal((HEADS * GROUP, D)).astype(DTYPE)
    K, V = tokens(11, T), tokens(12, T)
    if tgt.backend == "numpy":
        return lambda: sr.exact_attention(q, K, V)
    device = "cuda" if tgt.cuda else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise NotImplementedError("the exact baseline (torch SDPA) needs torch with CUDA")
    return sdpa(device, q, K, V)


def sdpa(device: str, q: np.ndarray, K: np.ndarray, V: np.ndarray) -> Callable[[], Any]:
    """torch.nn.functional.scaled_dot_product_attention for one decode query per head."""
    F = torch.nn.functional
    qt = torch.from_numpy(q).to(device)[None, :, None, :]  # (1, H_q, 1, d)
    Kt = torch.from_numpy(K).to(device)[None]  # (1, H, T, d)
    Vt = torch.from_numpy(V).to(device)[None]
    gqa = {"enable_gqa": True} if GROUP > 1 else {}
    return lambda: F.scaled_dot_product_attention(qt, Kt, Vt, **gqa)


def machines() -> dict[str, Any]:
    """This machine's rooflines (spec R12), measured once: "cpu", and "cuda" when torch sees a GPU."""
    from subspace_ref.roofline import measure_cpu, measure_torch

    out = {"cpu": measure_cpu()}
    if torch is not None and torch.cuda.is_available():
        out["cuda"] = measure_torch("cuda")
    return out
