"""Decode-step benchmark on one CUDA GPU: coefficient-space attention (spec A2, A3) against torch
SDPA over the full bf16 KV cache, in one run.

Setting (the brief of issue 5): batch N in {1, 8}, 32 query heads over 8 KV heads (GQA group 4),
d = d_v = 128, r = r_v = 32, bfloat16, T in {8k, 32k, 128k}.

Per (N, T), all in the same process:

* **sdpa** -- ``torch.nn.functional.scaled_dot_product_attention`` of one query token over the
  full bf16 K, V (N, 8, T, 128) with ``enable_gqa=True``, and **sdpa-expanded** with K, V
  expanded to 32 heads beforehand (the expansion is not timed). The faster of the two is the
  baseline of the speedup column.
* **<backend>-static** -- ``Backend.attend`` of every backend in ``--backend`` on a static state
  (spec A6) holding the same T tokens, projected by the Triton projection kernel
  (``TritonBackend.append``, one launch); **triton-static-api** is the same through the public
  ``subspace_ref.attend`` (argument checks included: one host sync for the finiteness check).
* **triton-<kind> bt=<tile> w=<warps>** -- the triton kernel with other tiles / warp counts
  (``--no-sweep`` skips them), to pick ``launch_config`` from measurements.
* **<backend>-adaptive** -- the same on an adaptive-layout state (spec A7/A9) with J = T / 256
  chunks per head (``--chunk-tokens``): chunk j covers tokens [256 j, 256 (j + 1)) with its own
  random orthonormal bases, coefficients those of the static state. It is synthetic -- building a
  128k-token adaptive state by FD would take minutes and its boundaries depend on the data --
  but it has exactly the layout and chunk count the kernel walks.

Columns: median time (``triton.testing.do_bench``, L2 flushed between calls, after its warm-up),
bytes each method reads (SDPA: K and V; coefficient attention: coefficients of every token, the
bases of every chunk in use, and the split partials written and read back by the merge),
achieved bandwidth, its fraction of the device-to-device copy bandwidth measured in the same run
(``dst.copy_(src)`` on 1 GiB, counted as read + write), speedup over the best SDPA, and
max |out - torch backend out| on the same state (correctness on the GPU, at every size).

Writes ``decode_gpu_<date>.json`` and ``decode_gpu_<date>.md`` (device name, date, git commit,
versions, the table) into ``--out``.

    python benchmarks/decode_gpu.py --out bench_results [--backend triton,cupy,torch]
        [--batch 1 8] [--tokens 8192 32768 131072] [--no-adaptive]

Exits with status 2 and a message when there is no CUDA GPU (or TRITON_INTERPRET is set).
``--smoke`` instead runs the whole script on the CPU under TRITON_INTERPRET=1 at tiny sizes, with
wall-clock timings that mean nothing: a check that the script itself works before GPU time is
spent on it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np

H_Q, H_KV, D, RANK = 32, 8, 128, 32
DTYPE = "bfloat16"
# (tokens per tile, warps) of the triton split kernel timed besides its default (launch_config)
SWEEP = ((32, 4), (64, 4), (128, 4), (32, 8), (64, 8))


def fail(msg: str) -> None:
    print(f"decode_gpu.py: {msg}", file=sys.stderr)
    sys.exit(2)


def git_commit() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha or "unknown") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def orthonormal(gen, shape_lead: tuple[int, ...], r: int, d: int, device, dtype=None):
    """Random (..., r, d) matrices with orthonormal rows (float64 QR when dtype is float64)."""
    import torch

    dtype = dtype or torch.float32
    g = torch.randn(*shape_lead, d, r, generator=gen, device=device, dtype=dtype)
    return torch.linalg.qr(g).Q.mT.contiguous()


SMOKE = False  # --smoke: CPU interpreter, tiny sizes, meaningless wall-clock timings


def bench(fn) -> float:
    """Median milliseconds of ``fn`` (triton.testing.do_bench: warm-up, L2 flush per call)."""
    if SMOKE:
        import statistics
        import time

        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def synchronize() -> None:
    import torch

    if not SMOKE:
        torch.cuda.synchronize()


def copy_bandwidth(device) -> float:
    """Device-to-device copy bandwidth in bytes/s, counted as bytes read + bytes written."""
    import torch

    n = (1 << 24) if SMOKE else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    del src, dst
    return 2 * n / (ms * 1e-3)


def build_states(N: int, T: int, K, V, chunk_tokens: int, adaptive: bool, gen, device):
    """(static state, adaptive-layout state or None) in bf16 on ``device``."""
    import torch

    import subspace_ref as sr
    from subspace_ref.layout import PackedLayout
    from subspace_ref.policies import AdaptivePolicy
    from subspace_ref.state import SubspaceState
    from subspace_ref_triton import TritonBackend

    # StaticBasis checks orthonormality to 1e-10: a float64 QR
    B = orthonormal(gen, (H_KV,), RANK, D, device, torch.float64).cpu().numpy()
    E = orthonormal(gen, (H_KV,), RANK, D, device, torch.float64).cpu().numpy()
    gamma = np.ones(H_KV)
    static = sr.SubspaceState.static(sr.StaticBasis.from_bases(B, E, gamma), batch=N).to("triton", device=device, dtype=DTYPE)
    TritonBackend().append(static, K, V)  # spec A6, one projection launch for all N x H x T
    synchronize()
    if not adaptive:
        return static, None
    J = -(-T // chunk_tokens)
    lay = static.layout
    starts = (torch.arange(J, device=device, dtype=torch.int64) * chunk_tokens).expand(N, H_KV, J).contiguous()
    layout = PackedLayout(
        key_coef=lay.key_coef,
        value_coef=lay.value_coef,
        key_bases=orthonormal(gen, (N, H_KV, J), RANK, D, device).to(torch.bfloat16),
        value_bases=orthonormal(gen, (N, H_KV, J), RANK, D, device).to(torch.bfloat16),
        chunk_starts=starts,
        num_chunks=torch.full((N, H_KV), J, dtype=torch.int64, device=device),
        gamma=lay.gamma,
        num_tokens=T,
    )
    policy = AdaptivePolicy((RANK,) * H_KV, (RANK,) * H_KV, 2 * RANK, 2 * RANK, 0.5, 0.5, chunk_tokens, 0)
    return static, SubspaceState(policy, layout, None, True, "torch")


def coef_bytes(state, N: int, split_partials: int) -> int:
    """Bytes coefficient attention reads: coefficients, bases of the chunks in use, partials."""
    lay = state.layout
    item = lay.key_coef.element_size()
    T = lay.num_tokens
    J = int(lay.num_chunks.max())
    coef = N * H_KV * T * (lay.key_coef.shape[3] + lay.value_coef.shape[3]) * item
    bases = N * H_KV * J * (lay.key_bases.shape[3] * D + lay.value_bases.shape[3] * D) * item
    partials = 2 * N * H_Q * split_partials * (D + 2) * 4  # written by the split kernel, read by the merge
    return coef + bases + partials


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_results", help="folder for the JSON and markdown results")
    ap.add_argument("--backend", default="triton,torch", help="comma-separated backends to time on the same states (e.g. triton,cupy,torch)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk of the adaptive layout (J = T / this)")
    ap.add_argument("--no-adaptive", action="store_true")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the triton tile/warp sweep")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="check the script on the CPU interpreter at tiny sizes (timings meaningless)")
    args = ap.parse_args()

    global SMOKE
    SMOKE = args.smoke
    if SMOKE:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports the kernels
        args.batch, args.tokens, args.chunk_tokens = [1, 2], [300], 64
    elif os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        fail("TRITON_INTERPRET is set: the kernels would run on the CPU interpreter; unset it to benchmark")
    try:
        import torch
        import triton
    except ImportError as err:
        fail(f"needs torch and triton ({err}); pip install 'subspace_ref[triton]'")
    if not SMOKE and not torch.cuda.is_available():
        fail("no CUDA GPU: torch.cuda.is_available() is False. Run this on an H100/H200 machine (or --smoke to check the script on the CPU).")

    import torch.nn.functional as F

    import subspace_ref as sr
    from subspace_ref.arrays import to_numpy
    from subspace_ref.backend import Availability
    from subspace_ref.registry import backend_availability, get_backend
    from subspace_ref_triton import decode

    device = torch.device("cpu" if SMOKE else "cuda")
    props = None if SMOKE else torch.cuda.get_device_properties(device)
    meta = {
        "device": "CPU interpreter (--smoke: timings meaningless)" if SMOKE else torch.cuda.get_device_name(device),
        "sm_count": 0 if SMOKE else props.multi_processor_count,
        "memory_gib": 0 if SMOKE else round(props.total_memory / 2**30, 1),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "setting": dict(query_heads=H_Q, kv_heads=H_KV, d=D, d_v=D, r=RANK, r_v=RANK, dtype=DTYPE, chunk_tokens=args.chunk_tokens),
    }
    print(f"{meta['device']} ({meta['sm_count']} SMs, {meta['memory_gib']} GiB), torch {meta['torch']}, triton {meta['triton']}, commit {meta['git_commit']}")

    copy_bw = copy_bandwidth(device)
    meta["copy_bandwidth_GBps"] = round(copy_bw / 1e9, 1)
    print(f"device-to-device copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s")

    names = [b.strip() for b in args.backend.split(",") if b.strip()]
    usable = {}
    for name in names:
        try:
            avail = backend_availability(name)
        except ValueError as err:  # unknown name
            avail = Availability(False, str(err))
        usable[name] = avail
        if not avail:
            print(f"backend {name}: unavailable ({avail.reason})")

    rows = []
    gen = torch.Generator(device=device).manual_seed(args.seed)
    scale = 1.0 / math.sqrt(D)
    for N in args.batch:
        for T in args.tokens:
            print(f"\n--- N = {N}, T = {T}")
            K = torch.randn(N, H_KV, T, D, generator=gen, device=device, dtype=torch.bfloat16)
            V = torch.randn(N, H_KV, T, D, generator=gen, device=device, dtype=torch.bfloat16)
            q = torch.randn(N, H_Q, D, generator=gen, device=device, dtype=torch.bfloat16)
            q4 = q[:, :, None, :]
            kv_bytes = N * H_KV * T * 2 * D * 2
            sdpa_rows = []
            try:
                ms = bench(lambda: F.scaled_dot_product_attention(q4, K, V, enable_gqa=True))
                sdpa_rows.append(dict(method="sdpa", ms=ms, bytes=kv_bytes))
            except (TypeError, RuntimeError) as err:  # torch < 2.5 has no enable_gqa
                print(f"sdpa with enable_gqa: {err}")
            Kx = K.repeat_interleave(H_Q // H_KV, dim=1)
            Vx = V.repeat_interleave(H_Q // H_KV, dim=1)
            ms = bench(lambda: F.scaled_dot_product_attention(q4, Kx, Vx))
            sdpa_rows.append(dict(method="sdpa-expanded", ms=ms, bytes=4 * kv_bytes))
            del Kx, Vx
            base_ms = min(r["ms"] for r in sdpa_rows)

            static, adaptive = build_states(N, T, K, V, args.chunk_tokens, not args.no_adaptive, gen, device)
            del K, V
            split_len = decode.default_split_len(T, N * H_KV, device)
            splits = -(-T // split_len)
            torch_impl = get_backend("torch")
            states = [("static", static)] + ([("adaptive", adaptive)] if adaptive is not None else [])
            for kind, state in states:
                ref = torch_impl.attend(q, state, None).float()  # the torch backend on the same state
                J = int(state.layout.num_chunks.max())
                for name in names:
                    row = dict(method=f"{name}-{kind}", chunks=J)
                    if not usable[name]:
                        rows.append(dict(row, N=N, T=T, skipped=usable[name].reason))
                        continue
                    try:
                        impl = get_backend(name)
                        st = state if impl.array_family == "torch" else state.to(name, device=str(device), dtype=DTYPE)
                        qq = q if impl.array_family == "torch" else impl.converter(device=str(device), dtype=DTYPE)(q)
                        reasons = impl.not_supported_reasons(qq, st)
                        if reasons:
                            rows.append(dict(row, N=N, T=T, skipped="; ".join(reasons)))
                            continue
                        out = impl.attend(qq, st, scale)
                        diff = float((torch.as_tensor(np.asarray(to_numpy(out)), dtype=torch.float32).to(device) - ref).abs().max()) if impl.array_family != "torch" else float((out.float() - ref).abs().max())
                        ms = bench(lambda: impl.attend(qq, st, scale))
                        row.update(ms=ms, bytes=coef_bytes(state, N, splits if name == "triton" else 0), max_abs_diff_vs_torch=diff)
                        if name == "triton":
                            row.update(split_len=split_len, splits=splits)
                        rows.append(dict(row, N=N, T=T))
                        if name == "triton" and kind == "static":
                            ms_api = bench(lambda: sr.attend(q, state, backend="triton", scale=scale))
                            rows.append(dict(method="triton-static-api", chunks=J, ms=ms_api, bytes=row["bytes"], N=N, T=T))
                        if name == "triton" and args.sweep:
                            for bt, nw in SWEEP:
                                fn = lambda bt=bt, nw=nw: decode.decode_attention(q, st.layout, scale, block_t=bt, num_warps=nw)  # noqa: E731
                                d_sw = float((fn().float() - ref).abs().max())
                                rows.append(dict(method=f"triton-{kind} bt={bt} w={nw}", chunks=J, ms=bench(fn), bytes=row["bytes"], N=N, T=T, max_abs_diff_vs_torch=d_sw))
                    except Exception as err:  # noqa: BLE001 - one failing backend must not end the run
                        traceback.print_exc()
                        rows.append(dict(row, N=N, T=T, skipped=f"error: {type(err).__name__}: {err}"))
            for r in sdpa_rows:
                rows.append(dict(r, N=N, T=T))
            for r in rows:
                if r["N"] == N and r["T"] == T and "ms" in r:
                    r["GBps"] = r["bytes"] / (r["ms"] * 1e-3) / 1e9
                    r["bw_fraction"] = r["GBps"] * 1e9 / copy_bw
                    r["speedup_vs_sdpa"] = base_ms / r["ms"]
            for r in [r for r in rows if r["N"] == N and r["T"] == T]:
                print(format_row(r))
            del static, adaptive, states
            if not SMOKE:
                torch.cuda.empty_cache()

    write_results(Path(args.out), meta, rows)


COLUMNS = ("N", "T", "method", "chunks", "ms", "bytes", "GBps", "bw_fraction", "speedup_vs_sdpa", "max_abs_diff_vs_torch")


def format_row(r: dict) -> str:
    if "skipped" in r:
        return f"{r['method']:22s} skipped: {r['skipped']}"
    diff = r.get("max_abs_diff_vs_torch")
    return (
        f"{r['method']:22s} {r['ms'] * 1e3:9.1f} us  {r['bytes'] / 2**20:9.1f} MiB  {r['GBps']:7.0f} GB/s"
        f"  {100 * r['bw_fraction']:5.1f}% of copy  x{r['speedup_vs_sdpa']:6.2f} vs SDPA"
        + (f"  |diff| {diff:.2e}" if diff is not None else "")
    )


def write_results(out: Path, meta: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stamp = meta["date"].replace(":", "").replace("-", "")
    (out / f"decode_gpu_{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        f"# Decode attention on {meta['device']}",
        "",
        f"{meta['date']}, commit `{meta['git_commit']}`, torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}. "
        f"{H_Q} query heads, {H_KV} KV heads, d = d_v = {D}, r = r_v = {RANK}, {DTYPE}. "
        f"Copy bandwidth (read + write) {meta['copy_bandwidth_GBps']} GB/s. Median of triton.testing.do_bench.",
        "",
        "| N | T | method | chunks | time (us) | MiB read | GB/s | % of copy bw | speedup vs SDPA | max abs diff vs torch |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['N']} | {r['T']} | {r['method']} | {r.get('chunks', '')} | skipped: {r['skipped']} | | | | | |")
            continue
        diff = r.get("max_abs_diff_vs_torch")
        lines.append(
            f"| {r['N']} | {r['T']} | {r['method']} | {r.get('chunks', '')} | {r['ms'] * 1e3:.1f} | {r['bytes'] / 2**20:.1f} | "
            f"{r['GBps']:.0f} | {100 * r['bw_fraction']:.1f} | {r['speedup_vs_sdpa']:.2f} | {'' if diff is None else f'{diff:.2e}'} |"
        )
    (out / f"decode_gpu_{stamp}.md").write_text("\n".join(lines) + "\n")
    print(f"\nwrote {out / f'decode_gpu_{stamp}.json'} and {out / f'decode_gpu_{stamp}.md'}")


if __name__ == "__main__":
    main()
