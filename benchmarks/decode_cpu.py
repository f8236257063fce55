"""Decode-step benchmark of the torch backend on this CPU (plain script; the asv suite is separate).

One decode step at H = 8 KV heads (query heads = 8 x --group), d = d_v = 128, r = r_v = 32, a
static basis, float32, batch 1: ``subspace_ref.attend(q, state, backend="torch")`` against
``torch.nn.functional.scaled_dot_product_attention`` over the full uncompressed cache of the same
tokens, for T in {4k, 16k, 64k}. Both run in the same process with the same thread count.

Reported per T (medians of --repeats timed calls after --warmup untimed ones; SDPA, attend, the
read, the backend call and the copy are timed in turn within each repeat, so load from other
processes on a shared machine falls on all of them alike, and each call finds its data evicted
from the caches by the one before, as a decode step finds a layer's cache):

* time of the coefficient-space attend (public API, with its argument checks; it follows SDPA)
  and of the backend call alone (``TorchBackend.attend``; it follows the read of 256 MiB), and
  of SDPA; ratio = attend / SDPA. The two columns can differ by more than the public layer,
  because a call after SDPA can be slower than the same call after a read (docs/benchmarks.md,
  "A call after SDPA is slower than after a read");
* bytes each reads -- SDPA: K and V (2 H T d 4 bytes); attend: key and value coefficients
  (H T (r + r_v) 4 bytes) plus the bases -- and the bandwidth that achieves;
* the machine's copy bandwidth measured in the same run, per row, timed in turn with the
  attention calls: ``dst.copy_(src)`` of a 256 MiB float32 tensor into a preallocated one,
  counted as bytes read + bytes written (the STREAM convention), and the read-only bandwidth
  (``src.sum()``); %copy and %read compare the attend's bandwidth with these;
* append cost per token (one decode token appended to a static state holding T tokens): the
  median of --appends single appends; the amortised cost: their mean plus the one geometric
  growth of the coefficient arrays (an O(T) copy, once per T appends) divided by T; and that
  growth share alone. None may grow with T (the mean is sensitive to preemption on a busy
  machine; the median is the steady cost).

Targets: ratio <= 0.30 at T >= 16k; attend bandwidth >= 70% of copy bandwidth.

Contention (issue 18 item 5): ``--threads 2 --neighbours 1`` starts a busy-loop process beside
the run; compare each ratio with the quiet run's (SDPA slows too: the ratio is what must hold).

    python benchmarks/decode_cpu.py [--threads 1] [--tokens 4096 16384 65536] [--group 1] [--stat min]
        [--formats float int8 rope-float rope-int8] [--neighbours 1]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import statistics
import time

import numpy as np
import torch

import subspace_ref as sr
from subspace_ref.rope import RopeParams


def timeit(fn, repeats: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


STAT = statistics.median  # --stat min: the fastest repeat instead (filters preemption on a busy machine)


def interleaved(fns, repeats: int, warmup: int) -> list[float]:
    """Median (or --stat) time of each function, timed in turn within each repeat, so that load
    from other processes (a shared machine) falls on all of them alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [STAT(ts) for ts in times]


def copy_bandwidth(repeats: int) -> tuple[float, float]:
    """(copy GB/s counting read + write, read-only GB/s) on 256 MiB float32 tensors."""
    n = 64 * 1024 * 1024
    src = torch.rand(n)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages
    t_copy = statistics.median(timeit(lambda: dst.copy_(src), repeats, 2))
    t_read = statistics.median(timeit(lambda: src.sum(), repeats, 2))
    nbytes = src.numel() * src.element_size()
    return 2 * nbytes / t_copy / 1e9, nbytes / t_read / 1e9


def orthonormal(gen: torch.Generator, H: int, r: int, d: int) -> np.ndarray:
    g = torch.randn(H, d, r, generator=gen, dtype=torch.float64)
    return torch.linalg.qr(g).Q.mT.numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=1, help="query heads per KV head")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--appends", type=int, default=200)
    ap.add_argument("--stat", choices=("median", "min"), default="median", help="statistic over repeats (min filters preemption)")
    ap.add_argument("--formats", nargs="+", default=["float"], choices=("float", "int8", "int4", "int2", "rope-float", "rope-int8", "rope-int4"),
                    help="coefficient format and key basis kind of the state (rope-*: pre-RoPE, spec/rope.md P3)")
    ap.add_argument("--neighbours", type=int, default=0, help="busy-loop processes started beside the benchmark (contention)")
    args = ap.parse_args()
    neighbours = [multiprocessing.Process(target=busy_loop, daemon=True) for _ in range(args.neighbours)]
    for p in neighbours:
        p.start()
    global STAT
    STAT = statistics.median if args.stat == "median" else min
    torch.set_num_threads(args.threads)
    H, d, r, g = args.heads, args.dim, args.rank, args.group
    gen = torch.Generator().manual_seed(0)
    backend = sr.get_backend("torch")

    src = torch.rand(64 * 1024 * 1024)  # 256 MiB, for the copy and read bandwidth of each row
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages
    copy_gbs, read_gbs = copy_bandwidth(args.repeats)  # measured again after the sweep, and per row
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, threads={torch.get_num_threads()}")
    print(f"H={H} (query heads {H * g}), d=d_v={d}, r=r_v={r}, static basis, float32, batch 1")
    print(f"copy bandwidth {copy_gbs:.2f} GB/s counting read+write ({copy_gbs / 2:.2f} GB/s of tensor copied), read bandwidth (sum) {read_gbs:.2f} GB/s")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; statistic over repeats: {args.stat}\n")

    basis = sr.StaticBasis.from_bases(orthonormal(gen, H, r, d), orthonormal(gen, H, r, d), gamma=1.0)
    header = (
        f"{'T':>6} {'format':>10} | {'copy GB/s':>9} {'read GB/s':>9} | {'SDPA ms':>8} {'GB/s':>6} | "
        f"{'attend ms':>9} {'backend ms':>10} {'GB/s':>6} {'%copy':>6} {'%read':>6} | "
        f"{'ratio':>6} {'ratio(backend)':>14} | {'append us/tok':>13} {'amortised':>9} {'growth/T':>8}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for T in args.tokens:
        K = torch.randn(1, H, T, d, generator=gen)
        V = torch.randn(1, H, T, d, generator=gen)
        q = torch.randn(1, H * g, 1, d, generator=gen)
        for fmt in args.formats:
            rows.append(measure_row(args, fmt, basis, K, V, q, backend, src, dst, gen))
        del K, V

    copy2, read2 = copy_bandwidth(args.repeats)
    print(f"\ncopy bandwidth after the sweep: {copy2:.2f} GB/s (read+write), read {read2:.2f} GB/s")
    print(
        "ratio = coefficient attend time / SDPA time (target <= 0.30 at T >= 16k; issue 16: int8 <= 0.10, int4 <= 0.08); "
        "GB/s = bytes read / time (attend: backend call); %copy = attend GB/s / copy GB/s (target >= 70%), %read = attend GB/s / read GB/s."
    )
    for p in neighbours:
        p.terminate()
        p.join()


def measure_row(args, fmt: str, basis, K, V, q, backend, src, dst, gen):
    """One printed row: format ``fmt`` ("float", "int8", "rope-float", "rope-int8") at T tokens."""
    H, T, d = K.shape[1], K.shape[2], K.shape[3]
    r, g = args.rank, args.group
    coefficients = fmt.split("-")[-1]
    rope = RopeParams(1.0 / 10000.0 ** (np.arange(0, d, 2) / d)) if fmt.startswith("rope") else None
    state = sr.SubspaceState.static(basis, dtype=np.float32, coefficients=coefficients, rope=rope).to("torch", device="cpu", dtype="float32")
    state.append(K[0], V[0])

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q, K, V, enable_gqa=g > 1)

    q_state = q[0, :, 0]  # (H_q, d)
    q_backend = q_state[None]
    out_ref = sdpa()[0, :, 0]
    out = sr.attend(q_state, state, backend="torch")
    assert torch.isfinite(out).all() and out.shape == out_ref.shape

    with torch.inference_mode():
        t_sdpa, t_att, t_read, t_bk, t_copy = interleaved(
            [sdpa, lambda: sr.attend(q_state, state, backend="torch"), lambda: src.sum(), lambda: backend.attend(q_backend, state, None),
             lambda: dst.copy_(src)],
            args.repeats,
            args.warmup,
        )
    src_bytes = src.numel() * src.element_size()
    copy_gbs, read_gbs = 2 * src_bytes / t_copy / 1e9, src_bytes / t_read / 1e9

    bytes_sdpa = 2 * H * T * d * 4 + q.numel() * 4
    # spec R4.3: int8 codes and one float32 scale per token; int4 / int2 (spec/quantization.md Q3): half / a quarter
    # of a byte per code and float16 scale and zero point per token (values) or per channel and group (keys),
    # counted approximately
    per_coef = {"int8": 1 + 4 / r, "int4": 0.5 + 4 / r, "int2": 0.25 + 4 / r}.get(coefficients, 4)
    bytes_att = H * T * 2 * r * per_coef + 2 * H * r * d * 4 + q.numel() * 4

    # append one token at a time to a state holding T tokens. The first append grows the
    # coefficient arrays geometrically (to 2T rows: one O(T) copy that serves the next T
    # appends); it is timed on its own and spread over those T tokens.
    k1 = torch.randn(args.appends + 1, H, d, generator=gen)
    v1 = torch.randn(args.appends + 1, H, d, generator=gen)
    a = time.perf_counter()
    state.append(k1[0], v1[0])
    t_growth = time.perf_counter() - a
    single = []
    for i in range(1, args.appends + 1):
        a = time.perf_counter()
        state.append(k1[i], v1[i])
        single.append(time.perf_counter() - a)
    t_app = statistics.median(single)
    amortised = statistics.fmean(single) + t_growth / T
    growth_share = t_growth / T

    bw = bytes_att / t_bk / 1e9
    print(
        f"{T:>6} {fmt:>10} | {copy_gbs:9.2f} {read_gbs:9.2f} | {t_sdpa * 1e3:8.3f} {bytes_sdpa / t_sdpa / 1e9:6.2f} | "
        f"{t_att * 1e3:9.3f} {t_bk * 1e3:10.3f} {bw:6.2f} {100 * bw / copy_gbs:5.0f}% {100 * bw / read_gbs:5.0f}% | "
        f"{t_att / t_sdpa:6.3f} {t_bk / t_sdpa:14.3f} | {t_app * 1e6:13.1f} {amortised * 1e6:9.1f} {growth_share * 1e6:8.2f}"
    )
    return (T, fmt, t_sdpa, t_att, t_bk, bw)


def busy_loop() -> None:
    """A neighbour process that keeps one core busy (issue 18 item 5: contention)."""
    while True:
        pass


if __name__ == "__main__":
    main()
