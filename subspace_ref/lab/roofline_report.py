"""``subspace-kv roofline``: measure decode attention on every backend available here and hold
it against the roofline model of ``spec/roofline.md`` (R10: predicted time; R12: this machine).

A small sweep -- static and adaptive states, a few context lengths and ranks, plus the exact
baselines (the NumPy oracle ``exact_attention`` and torch SDPA) -- is timed, each point's
roofline limit is computed from the model's bytes and FLOPs of the ``attend`` phase (R1.5) and
this machine's measured copy bandwidth and matmul rate, and the ratio measured / limit is
printed. Writes ``roofline.csv``, ``machine.json`` and ``roofline.png`` (log-log, measured
against predicted, one line per backend) under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from subspace_ref.workloads import grown_states, near_subspace_tokens, spanning_basis
from subspace_ref.roofline import Machine, Shape, Subspace, binding_roofs, break_even, exact_layer_cost, h100, measure_cpu, measure_torch, state_cost

#: (backend, device) of each target; GPU targets need CUDA.
TARGETS = {
    "numpy": ("numpy", None),
    "torch-cpu": ("torch", "cpu"),
    "torch-cuda": ("torch", "cuda"),
    "triton": ("triton", "cuda"),
    "cupy": ("cupy", "cuda"),
}
EXACT = ("exact-numpy", "sdpa-cpu", "sdpa-cuda")
MAX_CHUNK = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("results/roofline"), help="output directory (default: results/roofline)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384], help="context lengths T (default: 1024 4096 16384)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 32], help="ranks r = r_v (default: 16 32)")
    parser.add_argument("--heads", type=int, default=8, help="KV heads of the layer (default: 8; one query head each)")
    parser.add_argument("--d", type=int, default=128, help="head size d = d_v (default: 128)")
    parser.add_argument("--targets", nargs="+", default=list(TARGETS) + list(EXACT),
                        help=f"what to time (default: all available of {', '.join(list(TARGETS) + list(EXACT))})")
    parser.add_argument("--adaptive-max-tokens", type=int, default=4096,
                        help="largest T for adaptive states, whose append is sequential in the tokens (default: 4096)")
    parser.add_argument("--numpy-max-tokens", type=int, default=16384,
                        help="largest T for the NumPy oracle, which loops over heads and chunks (default: 16384)")
    parser.add_argument("--min-time", type=float, default=0.1, help="seconds of repeats per point (default: 0.1)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads of torch and of the OpenBLAS libraries loaded (NumPy's, SciPy's) for the whole "
                             "run, machine measurement included (default 1: decode attention is a chain of small ops, and "
                             "2 threads made torch-cpu ~400x slower on a loaded 2-core machine; 0 = leave the defaults)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")


@dataclass
class Point:
    target: str
    state: str
    T: int
    rank: int
    chunks: float
    measured_s: float
    roofline_s: float
    ratio: float
    bound: str
    model_bytes: float
    model_flops: float
    achieved_GBps: float
    machine: str


# ----------------------------------------------------------------------------- fixtures
def _static_state(heads: int, d: int, T: int, r: int):
    import subspace_ref as sr

    state = sr.SubspaceState.static(spanning_basis(heads, d, r), dtype=np.float32)
    state.append(near_subspace_tokens(1, heads, T, d), near_subspace_tokens(2, heads, T, d))
    return state


def _adaptive_states(heads: int, d: int, contexts: list[int], r: int, torch_ok: bool) -> dict[int, Any]:
    """NumPy adaptive states at each length, from one growing stream appended on the torch
    backend (CPU) when it is available, else on the oracle."""
    import subspace_ref as sr

    state = sr.SubspaceState.adaptive(heads, d, rank_k=r, rank_v=r, max_chunk=MAX_CHUNK, dtype=np.float32)

    def tokens(start: int, n: int):
        return near_subspace_tokens(3 + start, heads, n, d), near_subspace_tokens(4 + start, heads, n, d)

    return grown_states(state, contexts, tokens, "torch" if torch_ok else "numpy")


# ----------------------------------------------------------------------------- timing
def median_seconds(fn: Callable[[], Any], sync: Callable[[], None], min_time: float) -> float:
    """Median wall time after a warm-up call; at least 3 runs, more until ``min_time`` (at most 100);
    the device is synchronised before each host timer stops."""
    fn()
    sync()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < 100):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sync_for(backend: str, device: str | None) -> Callable[[], None]:
    if device != "cuda":
        return lambda: None
    if backend == "cupy":
        import cupy

        return cupy.cuda.runtime.deviceSynchronize
    import torch

    return torch.cuda.synchronize


def _available(names: list[str]) -> tuple[list[str], dict[str, str]]:
    """Targets that run here, and the reason for each that does not."""
    import subspace_ref as sr

    infos = {b.name: b for b in sr.backends()}
    torch_cuda = False
    try:
        import torch

        torch_cuda = torch.cuda.is_available()
    except ImportError:
        torch = None
    ok, why = [], {}
    for name in names:
        if name in EXACT:
            if name == "exact-numpy" or (torch is not None and (name == "sdpa-cpu" or torch_cuda)):
                ok.append(name)
            else:
                why[name] = "torch is not installed" if torch is None else "torch sees no CUDA device"
            continue
        if name not in TARGETS:
            why[name] = f"unknown target (choose from {', '.join(list(TARGETS) + list(EXACT))})"
            continue
        backend, device = TARGETS[name]
        info = infos.get(backend)
        if info is None or not info.available:
            why[name] = info.reason if info else "not registered"
        elif backend == "torch" and device == "cuda" and not torch_cuda:
            why[name] = "torch sees no CUDA device"
        else:
            ok.append(name)
    return ok, why


# ----------------------------------------------------------------------------- the sweep
def sweep(args) -> tuple[list[Point], dict[str, Machine], dict[str, str]]:
    import subspace_ref as sr

    targets, skipped = _available(args.targets)
    uses_cuda = any(t in ("torch-cuda", "triton", "cupy", "sdpa-cuda") for t in targets)
    machines = {"cpu": measure_cpu()}
    if uses_cuda:
        machines["cuda"] = measure_torch("cuda")
    torch_ok = "torch" in {b.name for b in sr.backends() if b.available}
    heads, d = args.heads, args.d
    shape = Shape(d, d, 1, 4.0)
    rng = np.random.default_rng(3)
    q_np = rng.standard_normal((heads, d)).astype(np.float32)
    points: list[Point] = []

    def record(target, kind, T, r, chunks, seconds, cost, machine_key):
        m = machines[machine_key]
        limit = float(cost.time(m))
        points.append(Point(target, kind, T, r, chunks, seconds, limit, seconds / limit, str(cost.bound(m)),
                            float(cost.bytes), float(cost.flops), float(cost.bytes) / seconds / 1e9, m.name))

    # coefficient-space attention
    adaptive_T = [T for T in args.contexts if T <= args.adaptive_max_tokens]
    for r in args.ranks:
        adaptive = _adaptive_states(heads, d, adaptive_T, r, torch_ok) if adaptive_T else {}
        for T in args.contexts:
            states = {"static": _static_state(heads, d, T, r)}
            if T in adaptive:
                states["adaptive"] = adaptive[T]
            for kind, state in states.items():
                for name in targets:
                    if name in EXACT:
                        continue
                    backend, device = TARGETS[name]
                    if backend == "numpy" and T > args.numpy_max_tokens:
                        continue
                    s = state.to(backend, device=device)
                    q = sr.get_backend(backend).converter(device=device)(q_np)
                    seconds = median_seconds(lambda: sr.attend(q, s, backend=backend), _sync_for(backend, device), args.min_time)
                    cost = state_cost(s, group=1).phase("attend")
                    record(name, kind, T, r, float(s.num_chunks.mean()), seconds, cost, "cuda" if device == "cuda" else "cpu")

    # exact baselines
    for T in args.contexts:
        K, V = near_subspace_tokens(11, heads, T, d), near_subspace_tokens(12, heads, T, d)
        cost = exact_layer_cost(T, shape, heads).phase("attend")
        for name in targets:
            if name not in EXACT:
                continue
            if name == "exact-numpy":
                if T > args.numpy_max_tokens:
                    continue
                fn, sync, key = (lambda: sr.exact_attention(q_np, K, V)), (lambda: None), "cpu"
            else:
                import torch

                dev = name.removeprefix("sdpa-")
                qt, Kt, Vt = (torch.from_numpy(x).to(dev) for x in (q_np[None, :, None], K[None], V[None]))
                fn = lambda qt=qt, Kt=Kt, Vt=Vt: torch.nn.functional.scaled_dot_product_attention(qt, Kt, Vt)  # noqa: E731
                sync, key = _sync_for("torch", dev), ("cuda" if dev == "cuda" else "cpu")
            record(name, "exact", T, d, 1.0, median_seconds(fn, sync, args.min_time), cost, key)
    return points, machines, skipped


# ----------------------------------------------------------------------------- output
def binding_table(T: int, shape: Shape, r: int, cpu: Machine) -> str:
    """Spec R13.7: which roof binds the attend phase of static states (plain and pre-RoPE, float
    and int8 coefficients) on this CPU (measured) and, from the model, on an H100."""
    subs = {f"static r={r} {coef}{' pre-RoPE' if rope else ''}": Subspace.static(r, coef=coef, rope=rope)
            for rope in (False, True) for coef in ("float", "int8")}
    lines = [f"which roof binds (model, attend phase, T = {T}, d = {shape.d}, {shape.elem_bytes:g}-byte elements; "
             "ratio = predicted time / exact's on the same machine):"]
    for row in binding_roofs(T, shape, subs, (cpu, h100(), h100(tensor_cores=True))):
        lines.append(f"  {row['config']:<28} {row['machine']:<45} {row['intensity']:7.1f} FLOP/B  "
                     f"{row['bound']:<7} bound  {row['ratio_to_exact']:.3f}x exact")
    return "\n".join(lines)


def format_table(points: list[Point]) -> str:
    head = f"{'target':<11} {'state':<9} {'T':>6} {'r':>4} {'J':>6} {'measured':>11} {'roofline':>11} {'ratio':>8} {'bound':<8} {'GB/s':>7}"
    rows = [head, "-" * len(head)]
    for p in points:
        rows.append(f"{p.target:<11} {p.state:<9} {p.T:>6} {p.rank:>4} {p.chunks:>6.1f} {_ms(p.measured_s):>11} "
                    f"{_ms(p.roofline_s):>11} {p.ratio:>8.1f} {p.bound:<8} {p.achieved_GBps:>7.2f}")
    return "\n".join(rows)


def set_blas_threads(n: int) -> list[str]:
    """Set the thread count of every OpenBLAS library loaded in this process (what threadpoolctl
    does, for Linux, without the dependency); returns the libraries changed. Best effort."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line})
    except OSError:
        return []
    changed = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(ctypes.c_int(n))
                changed.append(path)
                break
    return changed


def _blas_threads() -> str:
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line})
    except OSError:
        return "n/a"
    counts = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads"):
            fn = getattr(lib, name, None)
            if fn is not None:
                counts.append(str(fn()))
                break
    return ",".join(counts) or "n/a"


def _torch_threads() -> str:
    try:
        import torch

        return str(torch.get_num_threads())
    except ImportError:
        return "n/a"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4f} ms" if seconds < 1e-3 else f"{seconds * 1e3:.3f} ms"


def plot(points: list[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 6))
    names = list(dict.fromkeys(p.target for p in points))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, name in enumerate(names):
        pts = sorted((p for p in points if p.target == name), key=lambda p: p.roofline_s)
        for kind, style in (("static", "-o"), ("adaptive", "--s"), ("exact", ":^")):
            sel = [p for p in pts if p.state == kind]
            if sel:
                ax.plot([p.roofline_s for p in sel], [p.measured_s for p in sel], style, color=colors[i % len(colors)],
                        label=f"{name} ({kind})", markersize=4)
    lo = min(min(p.roofline_s, p.measured_s) for p in points) / 2
    hi = max(max(p.roofline_s, p.measured_s) for p in points) * 2
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="measured = roofline limit")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("roofline limit (model, spec R10), s")
    ax.set_ylabel("measured time per decode step, s")
    ax.set_title("Decode attention: measured vs roofline (one layer)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args) -> int:
    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.threads > 0:
        set_blas_threads(args.threads)
        try:
            import torch

            torch.set_num_threads(args.threads)
        except ImportError:
            pass
    points, machines, skipped = sweep(args)
    if not points:
        print("nothing was measured: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()), file=sys.stderr)
        return 1
    for key, m in machines.items():
        print(f"machine ({key}): {m}  [ridge {m.ridge:.2f} FLOP/B]")
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    print(f"layer: {args.heads} KV heads x 1 query head, d = d_v = {args.d}, float32; attend phase of spec R1.5; "
          f"threads: torch {_torch_threads()}, OpenBLAS {_blas_threads()}")
    print("ratio = measured / roofline limit (spec R10.4; 1 = at the limit)")
    print(format_table(points))
    cpu = machines["cpu"]
    shape = Shape(args.d, args.d, 1, 4.0)
    for r in args.ranks:
        be_s = break_even(shape, Subspace.static(r), cpu, phases=("attend",))
        be_a = break_even(shape, Subspace.adaptive(r, max_chunk=MAX_CHUNK), cpu, phases=("attend",))
        print(f"model break-even T on {cpu.name} (attend, float32): static r={r}: {be_s}; adaptive r={r}, L={MAX_CHUNK}: {be_a}")
    print(binding_table(args.contexts[-1], shape, args.ranks[-1], cpu))
    with open(args.out / "roofline.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(points[0])))
        w.writeheader()
        w.writerows(asdict(p) for p in points)
    (args.out / "machine.json").write_text(json.dumps(
        {k: {"name": m.name, "bandwidth_Bps": m.bandwidth, "flops": m.flops, **m.details} for k, m in machines.items()}, indent=2))
    if not args.no_plot:
        plot(points, args.out / "roofline.png")
    print(f"wrote {args.out}/roofline.csv, machine.json" + ("" if args.no_plot else ", roofline.png") + f" in {time.perf_counter() - t0:.0f} s")
    return 0
