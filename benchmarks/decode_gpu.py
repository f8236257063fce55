"""Decode-step benchmark on one CUDA GPU: coefficient-space attention (spec A2, A3) against torch
SDPA (and flash-attention's ``flash_attn_with_kvcache`` when importable) over the full bf16 KV
cache, in one run.

Setting (issues 5 and 21): batch N in {1, 8}, 32 query heads over 8 KV heads (GQA group 4),
d = d_v = 128, r = r_v = 32, bfloat16 bases, float (bf16), int8 (spec A10) and int4
(spec/quantization.md Q2, ``--coef int4``) coefficients, T in {4k, 8k, 32k, 64k, 128k}.

Per (N, T), all in the same process:

* **sdpa** -- ``torch.nn.functional.scaled_dot_product_attention`` of one query token over the
  full bf16 K, V (N, 8, T, 128) with ``enable_gqa=True``, and **sdpa-expanded** with K, V
  expanded to 32 heads beforehand (the expansion is not timed). The faster of the two is the
  baseline of the speedup column. **flash-attn** -- ``flash_attn_with_kvcache`` over the same
  cache (N, T, 8, 128), when the ``flash_attn`` package imports.
* **<backend>-static[-int8]** -- ``Backend.attend`` of every backend in ``--backend`` on a static
  state (spec A6) holding the same T tokens, projected by the Triton projection kernel
  (``TritonBackend.append``, one launch); **triton-static-api** is the same through the public
  ``subspace_ref.attend`` (argument checks included); **triton-static split-kernel** is the split
  kernel and merge whichever path the backend routes the state to.
* **vendor-sdpa-coef[-expanded|-rows]** -- the vendor path (issue 38): the float static state as
  exact attention over (B q, C, D) with head size r through torch SDPA: the backend's
  ``vendor.attention`` (GQA), C and D expanded to 32 heads beforehand, or the 4 query heads of a KV
  head as 4 query rows; the query projection and the value basis included in the time.
* **attend-graph[-int8|-int4] cols=<c> splits/step=<b> S=<splits>**, **merge-graph...** and
  **split-graph... S=<splits>** (``--merge-sweep``, ``--merge-splits``) -- the attention, the merge
  launch alone and the split launch alone, replayed from CUDA graphs, with the merge launch's other
  shapes (MERGE_SWEEP: ``decode.merge_launch``'s ``columns`` and ``block_s``) at the default split
  count and those given (the parts take no ratio to SDPA).
* **triton-<kind> bt=<tile> w=<warps> [cap=<registers>]** -- the triton kernel with other
  tiles / warp counts and register caps (cap=none: uncapped; ``--no-sweep`` skips them), to
  check ``launch_config`` (tiles from the compile report, caps from GPU timing) by measurement.
* **<backend>-rope[-int8|-int4]** (``--rope``) -- the same on a pre-RoPE static state
  (spec/rope.md P2-P3: keys stored as coefficients before the rotation, rebuilt and rotated to
  each token's position inside the kernel), full rotary (64 planes, base 10000).
  **triton-rope[-...] <keywords>** (``--rope-sweep``): the pre-RoPE kernel with other launch
  keywords (``ROPE_SWEEP``: the default, a softmax per warp, uncapped, ``max_registers=0``; one
  softmax a tile, ``warp_softmax=False``, the default until timed slower; other tiles and warps,
  chosen from the compiled code).
* **<backend>-adaptive[-int8]** -- the same on an adaptive-layout state (spec A7/A9) with
  J = T / 256 chunks per head (``--chunk-tokens``): chunk j covers tokens [256 j, 256 (j + 1))
  with its own random orthonormal bases, coefficients those of the static state. Synthetic --
  building a 128k-token adaptive state by FD would take minutes and its boundaries depend on the
  data -- but it has exactly the layout and chunk count the kernel walks.
* **attend-graph[ rope][-int8|-int4]** -- the attention alone (split and merge launches of a
  ``DecodeWorkspace`` at the state's T) replayed from a CUDA graph, for every format: the
  attention part of a step where the append has no one-launch form here (int4, pre-RoPE).
* **step-eager** / **step-graph** -- one whole decode step of the static float state: project
  one new token into the cache (c = B k, d = E v, written at the device-resident row T) and
  advance T (``DecodeWorkspace.append``: one launch and one add), attend
  (``subspace_ref_triton.workspace.DecodeWorkspace``); eagerly, and replayed from a
  captured CUDA graph. The difference is the host overhead a graph removes. **step-eager
  fused-merge** / **step-graph fused-merge**: the same with split and merge in one launch
  (``DecodeWorkspace(..., fused_merge=True)``); **triton-static fused-merge**: the static state's
  attention so (``decode_attention(..., fused_merge=True)``). **step-eager rope** / **step-graph
  rope** (``--rope``): the same step over the pre-RoPE static float state, its workspace built
  with ``rope=`` (the pre-RoPE kernel reading T on the device, spec/models.md M11.10; the new
  token's un-rotation, a few hundred FLOPs, is left out of the step).

Columns: median time (``triton.testing.do_bench``, L2 flushed between calls, after its warm-up),
bytes each method reads (SDPA: K and V; coefficient attention: ``state.nbytes``, the
coefficients, scales and zero points of every token and the bases of every chunk in use, as the
library counts them; the split partials, ~1% at T >= 32k, are not counted), achieved bandwidth, its fraction of the device-to-device copy bandwidth measured in the
same run (``dst.copy_(src)`` on 1 GiB, counted as read + write), speedup over the best SDPA, and
max |out - torch backend out| on the same state (correctness on the GPU, at every size).

Writes ``decode_gpu_<date>.json`` and ``decode_gpu_<date>.md`` (device name, date, git commit,
versions, the table) into ``--out``; ``--plot FILE.json ...`` draws time and speedup against T
from such files (``decode_gpu_<date>.png``).

    python benchmarks/decode_gpu.py --out bench_results [--backend triton,cupy,torch]
        [--batch 1 8] [--tokens 4096 ... 131072] [--coef float int8] [--no-adaptive] [--no-sweep]
    python benchmarks/decode_gpu.py --plot bench_results/decode_gpu_*.json --out bench_results

Exits with status 2 and a message when there is no CUDA GPU (or TRITON_INTERPRET is set).
``--smoke`` instead runs the whole script on the CPU under TRITON_INTERPRET=1 at tiny sizes, with
wall-clock timings that mean nothing: a check that the script itself works before GPU time is
spent on it.
"""

from __future__ import annotations

import argparse
import functools
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
# (tokens per tile, warps, register cap) of the triton split kernel timed besides its default
# (launch_config; None: the default's, 0: no cap)
SWEEP = ((32, 4, None), (64, 4, None), (128, 4, None), (32, 8, None), (64, 8, None), (None, None, 0), (None, None, 176), (None, None, 128), (None, None, 96),
         (32, 1, 0), (32, 2, 0))  # 1-2 warps: fewer instructions per token in the compiled loop (docs/gpu.md, "Static budgets")
# merge launch shapes (columns, splits a step; None: the default): whole rows in steps of 16 (the merge before
# 2026-11-29's second H200 session), 32 columns in steps of 16, the default, 16 and 128 columns with 128 a step
MERGE_SWEEP = ((0, 16), (32, 16), (None, None), (16, 128), (128, 128))
# launch keywords of the pre-RoPE kernel timed besides its default (64-token tiles, one warpgroup: 8
# resident warps per SM): the configurations without spills that hold more warps or fewer barriers
# per SM, from the compiled code (docs/gpu.md, "Pre-RoPE launch sweep"): 32-token tiles on two warps
# (mma.sync instead of wgmma, 5 barriers instead of 9), 32 or 16 on four (12-16 warps per SM), 128 on eight
ROPE_SWEEP = (dict(max_registers=0), dict(warp_softmax=False), dict(block_t=32, num_warps=2), dict(block_t=32, num_warps=4), dict(block_t=16, num_warps=4),
              dict(block_t=128, num_warps=8))


def fail(msg: str) -> None:
    print(f"decode_gpu.py: {msg}", file=sys.stderr)
    sys.exit(2)


def git_commit() -> str:
    """HEAD (+dirty), or $SUBSPACE_REF_COMMIT where set: a GPU machine that receives the working
    tree may carry another commit's git metadata (2026-11-26: the last landed one)."""
    if os.environ.get("SUBSPACE_REF_COMMIT"):
        return os.environ["SUBSPACE_REF_COMMIT"]
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
PROFILE_DIR: Path | None = None  # --profile-step: where the captured steps' kernel traces go
PROFILE_REPLAYS = 20


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
    ms = bench(functools.partial(dst.copy_, src))
    return 2 * n / (ms * 1e-3)


def rope_params():
    """Full rotary over d = 128 (64 planes), base 10000, Llama's "half" layout."""
    from subspace_ref.rope import RopeParams

    return RopeParams(1.0 / 10000.0 ** (np.arange(D // 2) / (D // 2)))


def build_states(N: int, T: int, K, V, chunk_tokens: int, adaptive: bool, gen, device, coef: str = "float", spare: int = 0, rope=None):
    """(static state, adaptive-layout state or None) in bf16 on ``device``, with ``coef``
    coefficients ("float", "int8" (spec A10) or "int4" (spec/quantization.md Q2)) and room for
    ``spare`` more tokens; with ``rope``, a pre-RoPE static state (spec/rope.md P2) and no
    adaptive one."""
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
    static = sr.SubspaceState.static(sr.StaticBasis.from_bases(B, E, gamma), batch=N, coefficients=coef, rope=rope).to("triton", device=device, dtype=DTYPE)
    if spare:
        static.layout = static.layout.with_capacity(T + spare, 1)
    TritonBackend().append(static, K, V)  # spec A6, one projection launch for all N x H x T (float, int8)
    synchronize()
    if not adaptive or rope is not None or coef not in ("float", "int8"):
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
        key_scale=getattr(lay, "key_scale", None),
        value_scale=getattr(lay, "value_scale", None),
        key_format=lay.key_format,
        value_format=lay.value_format,
    )
    policy = AdaptivePolicy((RANK,) * H_KV, (RANK,) * H_KV, 2 * RANK, 2 * RANK, 0.5, 0.5, chunk_tokens, 0)
    return static, SubspaceState(policy, layout, None, True, "torch")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_results", help="folder for the JSON and markdown results")
    ap.add_argument("--backend", default="triton,torch", help="comma-separated backends to time on the same states (e.g. triton,cupy,torch)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 32768, 65536, 131072])
    ap.add_argument("--coef", nargs="+", default=["float", "int8"], choices=["float", "int8", "int4"], help="coefficient storage (spec A10, spec/quantization.md Q2)")
    ap.add_argument("--rope", action="store_true", help="also time pre-RoPE static states (spec/rope.md P3) for every --coef")
    ap.add_argument("--rope-sweep", action="store_true", help="time the pre-RoPE kernel's other tiles, warps and rebuilds too (ROPE_SWEEP)")
    ap.add_argument("--no-graph", dest="graph", action="store_false", help="skip the eager / CUDA-graph decode step")
    ap.add_argument("--merge-sweep", action="store_true", help="time the merge launch's other shapes under a graph too (MERGE_SWEEP)")
    ap.add_argument("--merge-splits", type=int, nargs="+", default=[], metavar="S",
                    help="with --merge-sweep: also at these split counts (DecodeWorkspace's num_splits), beside the default")
    ap.add_argument("--plot", nargs="+", default=None, metavar="JSON", help="only draw the plots of these result files into --out")
    ap.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk of the adaptive layout (J = T / this)")
    ap.add_argument("--no-adaptive", action="store_true")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the triton tile/warp sweep")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="check the script on the CPU interpreter at tiny sizes (timings meaningless)")
    ap.add_argument("--profile-step", metavar="DIR", default=None,
                    help="trace replays of each captured step with torch.profiler into DIR: each kernel's duration and the step's span (the gaps between)")
    args = ap.parse_args()
    if args.plot:
        plot(args.plot, Path(args.out))
        return

    global SMOKE, PROFILE_DIR
    SMOKE = args.smoke
    PROFILE_DIR = None if args.profile_step is None else Path(args.profile_step)
    if SMOKE:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports the kernels
        args.batch, args.tokens, args.chunk_tokens = [1, 2], [300], 64
        args.sweep = False
    elif os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        fail("TRITON_INTERPRET is set: the kernels would run on the CPU interpreter; unset it to benchmark")
    try:
        import torch
        import triton
    except ImportError as err:
        fail(f"needs torch and triton ({err}); pip install 'subspace_ref[triton]'")
    if not SMOKE and not torch.cuda.is_available():
        fail("no CUDA GPU: torch.cuda.is_available() is False. Run this on an H100/H200 machine (or --smoke to check the script on the CPU).")
    if PROFILE_DIR is not None and not SMOKE:
        import torch.profiler._utils as profiler_utils

        if hasattr(profiler_utils, "_init_for_cuda_graphs"):
            profiler_utils._init_for_cuda_graphs()  # CUPTI set up before any capture (pytorch#75504)


    from subspace_ref.backend import Availability
    from subspace_ref.registry import backend_availability

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
            here = []
            base_ms = baselines(here, q, K, V)
            shown = 0

            def flush_rows():
                """Print and save the rows measured since the last call (a run cut by its limit keeps them)."""
                nonlocal shown
                for r in here[shown:]:
                    r.update(N=N, T=T)
                    if "ms" in r and not r.get("part"):  # a part of the attention (the merge alone) takes no ratio to SDPA
                        r["speedup_vs_sdpa"] = base_ms / r["ms"]
                        if r.get("bytes"):
                            r["GBps"] = r["bytes"] / (r["ms"] * 1e-3) / 1e9
                            r["bw_fraction"] = r["GBps"] * 1e9 / copy_bw
                    print(format_row(r))
                shown = len(here)
                write_results(Path(args.out), meta, rows + here)

            for coef in args.coef:
                static, adaptive = build_states(N, T, K, V, args.chunk_tokens, not args.no_adaptive, gen, device, coef, spare=16 if coef == "float" else 0)
                suffix = "" if coef == "float" else f"-{coef}"
                states = [("static" + suffix, static)] + ([("adaptive" + suffix, adaptive)] if adaptive is not None else [])
                for kind, state in states:
                    time_backends(here, names, usable, kind, state, q, scale, sweep=args.sweep)
                if coef == "float":
                    time_vendor(here, static, q, scale)
                if args.graph:
                    time_attend_graph(here, static, q, scale, suffix)
                if args.graph and args.merge_sweep:
                    time_merge_shapes(here, static, q, scale, suffix, args.merge_splits)
                if coef == "float" and args.graph:
                    time_steps(here, static, q, K, V, scale)
                del static, adaptive, states
                if args.rope:
                    rope_state, _ = build_states(N, T, K, V, args.chunk_tokens, False, gen, device, coef, spare=16 if coef == "float" else 0, rope=rope_params())
                    time_backends(here, names, usable, "rope" + suffix, rope_state, q, scale, sweep=args.rope_sweep)
                    if args.graph:
                        time_attend_graph(here, rope_state, q, scale, " rope" + suffix)
                    if coef == "float" and args.graph:
                        time_step(here, rope_state, q, K, V, scale, fused=False)
                    del rope_state
                flush_rows()
            flush_rows()
            rows += here
            K = V = None
            if not SMOKE:
                torch.cuda.empty_cache()


def baselines(rows: list[dict], q, K, V) -> float:
    """SDPA (GQA and expanded) and flash-attention over the full cache; returns the best SDPA ms."""
    import torch
    import torch.nn.functional as F

    N, _, T, _ = K.shape
    q4 = q[:, :, None, :]
    kv_bytes = N * H_KV * T * 2 * D * 2
    sdpa = []
    try:
        sdpa.append(dict(method="sdpa", ms=bench(functools.partial(F.scaled_dot_product_attention, q4, K, V, enable_gqa=True)), bytes=kv_bytes))
    except (TypeError, RuntimeError) as err:  # torch < 2.5 has no enable_gqa
        print(f"sdpa with enable_gqa: {err}")
    Kx, Vx = K.repeat_interleave(H_Q // H_KV, dim=1), V.repeat_interleave(H_Q // H_KV, dim=1)
    sdpa.append(dict(method="sdpa-expanded", ms=bench(functools.partial(F.scaled_dot_product_attention, q4, Kx, Vx)), bytes=4 * kv_bytes))
    Kx = Vx = None
    rows += sdpa
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError as err:
        rows.append(dict(method="flash-attn", skipped=f"flash_attn not importable ({err})"))
    else:
        kc, vc = K.transpose(1, 2).contiguous(), V.transpose(1, 2).contiguous()  # (N, T, H, d)
        rows.append(dict(method="flash-attn", ms=bench(functools.partial(flash_attn_with_kvcache, q[:, None], kc, vc, causal=True)), bytes=kv_bytes))
        kc = vc = None
    torch.cuda.empty_cache() if not SMOKE else None
    return min(r["ms"] for r in sdpa)


def time_backends(rows: list[dict], names, usable, kind: str, state, q, scale: float, sweep: bool) -> None:
    """Every backend's attend on ``state``, its difference to the torch backend, the public API
    and the tile/warp sweep of the triton kernel."""
    import torch

    import subspace_ref as sr
    from subspace_ref.arrays import to_numpy
    from subspace_ref.registry import get_backend
    from subspace_ref_triton import decode, rope_decode

    ref = get_backend("torch").attend(q, state, scale).float()
    J = int(state.layout.num_chunks.max())
    nbytes = state.nbytes
    for name in names:
        row = dict(method=f"{name}-{kind}", chunks=J)
        if not usable[name]:
            rows.append(dict(row, skipped=usable[name].reason))
            continue
        try:
            impl = get_backend(name)
            st = state if impl.array_family == "torch" else state.to(name, device=str(q.device), dtype=DTYPE)
            qq = q if impl.array_family == "torch" else impl.converter(device=str(q.device), dtype=DTYPE)(q)
            reasons = impl.not_supported_reasons(qq, st)
            if reasons:
                rows.append(dict(row, skipped="; ".join(reasons)))
                continue
            out = impl.attend(qq, st, scale)
            # CuPy bfloat16 comes back as ml_dtypes.bfloat16, which torch cannot take: via float32
            got = out.float() if impl.array_family == "torch" else torch.as_tensor(np.asarray(to_numpy(out), dtype=np.float32), device=q.device)
            row.update(ms=bench(functools.partial(impl.attend, qq, st, scale)), bytes=nbytes, max_abs_diff_vs_torch=float((got - ref).abs().max()))
            rows.append(row)
            if name == "triton" and kind == "static":
                ms_api = bench(functools.partial(sr.attend, q, state, backend="triton", scale=scale))
                rows.append(dict(method="triton-static-api", chunks=J, ms=ms_api, bytes=nbytes))
                # the split kernel itself, where the backend routes the state to the vendor path
                # (float 16-bit): the two paths timed side by side decide that route
                split = functools.partial(decode.decode_attention, q, st.layout, scale)
                rows.append(dict(method="triton-static split-kernel", chunks=J, ms=bench(split), bytes=nbytes,
                                 max_abs_diff_vs_torch=float((split().float() - ref).abs().max())))
                # split and merge in one launch (decode.fused_launch; off by default until timed)
                fused = functools.partial(decode.decode_attention, q, st.layout, scale, fused_merge=True)
                rows.append(dict(method="triton-static fused-merge", chunks=J, ms=bench(fused), bytes=nbytes,
                                 max_abs_diff_vs_torch=float((fused().float() - ref).abs().max())))
            if name == "triton" and sweep and kind.startswith("rope"):
                rope = st.policy.rope
                configs = [(" ".join(f"{k}={v}" for k, v in kw.items()), functools.partial(rope_decode.decode_attention, q, st.layout, rope, scale, **kw))
                           for kw in ROPE_SWEEP]
            elif name == "triton" and sweep:
                configs = [(sweep_label(bt, nw, cap), functools.partial(decode.decode_attention, q, st.layout, scale, block_t=bt, num_warps=nw, max_registers=cap))
                           for bt, nw, cap in SWEEP]
            else:
                configs = []
            for label, fn in configs:
                d_sw = float((fn().float() - ref).abs().max())
                rows.append(dict(method=f"triton-{kind} {label}", chunks=J, ms=bench(fn), bytes=nbytes, max_abs_diff_vs_torch=d_sw))
        except Exception as err:  # noqa: BLE001 - one failing backend must not end the run
            traceback.print_exc()
            rows.append(dict(row, skipped=f"error: {type(err).__name__}: {err}"))


def time_vendor(rows: list[dict], state, q, scale: float) -> None:
    """The vendor path (issue 38 item 4): a float post-RoPE static state is exact attention over
    (B q, C, D) with head size r and scale 1/sqrt(d) (spec A2), so torch SDPA runs it; the value
    basis maps its output back to d. Timed whole (both projections included): the backend's own
    ``vendor.attention`` (one query per query head, GQA), the same with C and D expanded to H_Q
    heads, and with the g query heads of a KV head as g query rows (the slower form, docs/gpu.md)."""
    import torch
    import torch.nn.functional as F

    from subspace_ref_triton import vendor

    lay = state.layout
    T = int(lay.num_tokens)
    B, E = lay.key_bases[:, :, 0], lay.value_bases[:, :, 0]  # (N, H_KV, r, d)
    C, Dv = lay.key_coef[:, :, :T], lay.value_coef[:, :, :T]  # (N, H_KV, T, r)
    g = H_Q // H_KV
    ref = get_torch_attend(state, lay, q, scale, T)

    def variant(keys, values, queries_per_head):
        qt = torch.einsum("nhgd,nhrd->nhgr", q.view(q.shape[0], H_KV, g, D), B).reshape(q.shape[0], -1, queries_per_head, RANK)
        y = F.scaled_dot_product_attention(qt, keys, values, scale=scale)
        return torch.einsum("nhgr,nhrd->nhgd", y.reshape(q.shape[0], H_KV, g, RANK), E).reshape(q.shape[0], H_Q, D)

    Cx, Dx = C.repeat_interleave(g, dim=1), Dv.repeat_interleave(g, dim=1)
    variants = (("vendor-sdpa-coef", functools.partial(vendor.attention, q, lay, scale)),
                ("vendor-sdpa-coef-expanded", functools.partial(variant, Cx, Dx, 1)),
                ("vendor-sdpa-coef-rows", functools.partial(variant, C, Dv, g)))
    for label, fn in variants:
        try:
            diff = float((fn().float() - ref).abs().max())
            rows.append(dict(method=label, ms=bench(fn), bytes=state.nbytes, max_abs_diff_vs_torch=diff))
        except Exception as err:  # noqa: BLE001 - one failing row must not end the run
            traceback.print_exc()
            rows.append(dict(method=label, skipped=f"error: {type(err).__name__}: {err}"))


def sweep_label(block_t, num_warps, cap) -> str:
    """"bt=64 w=4", "bt=default w=default cap=none", ... for a SWEEP entry."""
    label = f"bt={block_t or 'default'} w={num_warps or 'default'}"
    return label if cap is None else label + f" cap={cap or 'none'}"


def profile_step(graph, reset, label: str) -> None:
    """PROFILE_REPLAYS replays of a captured graph under torch.profiler, each after an L2 flush
    (as ``bench``) and ``reset``: the chrome trace, and a summary of each kernel's mean duration
    and the replay's mean span from its first kernel's start to its last one's end (the span
    minus the durations is the gaps between launches). The flush and the reset are fill
    kernels, launched outside the graph: they mark where each replay starts and are left out."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    PROFILE_DIR.mkdir(parents=True, exist_ok=True)
    try:
        flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILE_REPLAYS):
                flush.zero_()
                reset()
                graph.replay()
                torch.cuda.synchronize()
        prof.export_chrome_trace(str(PROFILE_DIR / f"{label}.json"))
        replays, current = [], []
        for e in sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start):
            if "Fill" in e.name:
                if current:
                    replays.append(current)
                current = []
            else:
                current.append(e)
        if current:
            replays.append(current)
        lines = [f"{label}: {len(replays)} replays traced of {PROFILE_REPLAYS}"]
        if replays:
            span = sum(k[-1].time_range.end - k[0].time_range.start for k in replays) / len(replays)
            busy = sum(e.time_range.end - e.time_range.start for k in replays for e in k) / len(replays)
            lines.append(f"replay span {span:.1f} us, kernels busy {busy:.1f} us, gaps {span - busy:.1f} us")
            same = [k for k in replays if len(k) == len(replays[-1])]
            for i, e in enumerate(replays[-1]):
                mean = sum(k[i].time_range.end - k[i].time_range.start for k in same) / len(same)
                lines.append(f"  {i}: {mean:8.1f} us  {e.name[:120]}")
        text = "\n".join(lines) + "\n"
        (PROFILE_DIR / f"{label}.txt").write_text(text)
        print(text)
    except Exception:  # noqa: BLE001 - the trace must not cost the timings
        traceback.print_exc()


def time_steps(rows: list[dict], state, q, K, V, scale: float) -> None:
    """One decode step of a static float state (append one token at the device-resident row T,
    advance T, attend), eager and replayed from a CUDA graph, with split and merge in two
    launches and in one (``fused_merge``); the state's T is restored."""
    for fused in (False, True):
        time_step(rows, state, q, K, V, scale, fused)


def time_step(rows: list[dict], state, q, K, V, scale: float, fused: bool) -> None:
    """:func:`time_steps` for one workspace (``fused``: its split launch also merges)."""
    import torch

    from subspace_ref_triton.workspace import DecodeWorkspace

    lay = state.layout
    rope = state.policy.rope
    ws = DecodeWorkspace(lay, H_Q, q.dtype, scale, fused_merge=fused, rope=rope)
    suffix = (" fused-merge" if fused else "") + (" rope" if rope is not None else "")
    T0 = int(lay.num_tokens)
    k_new, v_new = K[:, :, -1:].clone(), V[:, :, -1:].clone()
    B, E = lay.key_bases[:, :, 0], lay.value_bases[:, :, 0]  # (N, H, r, d): the static basis

    def step():
        if rope is None:  # spec A6 for one token, projected and written at row T on the device, T advanced: one launch and one add
            ws.append(k_new, v_new)
        else:  # the pre-RoPE key's un-rotation is left out (see the module docstring): the projection as torch ops
            ws.layout.key_coef.index_copy_(2, ws.num_tokens, torch.matmul(k_new, B.mT).to(lay.key_coef.dtype))
            ws.layout.value_coef.index_copy_(2, ws.num_tokens, torch.matmul(v_new, E.mT).to(lay.value_coef.dtype))
            ws.advance(1)
        return ws.attend(q)

    def reset():
        ws.num_tokens.fill_(T0)

    try:
        eager = bench(lambda: (reset(), step()))
        reset()
        want = get_torch_attend(state, ws.layout, q, scale, T0 + 1)  # row T0 is in the workspace's buffers, not the state's
        rows.append(dict(method="step-eager" + suffix, ms=eager, max_abs_diff_vs_torch=float((step().float() - want).abs().max())))
        if SMOKE:
            rows.append(dict(method="step-graph" + suffix, skipped="no CUDA graphs on the CPU interpreter"))
            return
        graph = capture(step, reset)
        reset()
        graph.replay()
        diff = float((ws.out.float() - want).abs().max())
        rows.append(dict(method="step-graph" + suffix, ms=bench(lambda: (reset(), graph.replay())), max_abs_diff_vs_torch=diff))
        if PROFILE_DIR is not None:
            profile_step(graph, reset, f"step-graph{suffix.replace(' ', '-')}_N{q.shape[0]}_T{T0}")
    except Exception as err:  # noqa: BLE001
        traceback.print_exc()
        rows.append(dict(method="step-graph" + suffix, skipped=f"error: {type(err).__name__}: {err}"))
    finally:
        reset()


def capture(fn, reset=lambda: None):
    """``fn`` captured in a CUDA graph, after two warm-up calls on a side stream (compiles,
    allocator pools), each after ``reset``."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            reset()
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    reset()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_attend_graph(rows: list[dict], state, q, scale: float, label: str) -> None:
    """The attention of a static state of any format, its split and merge launches
    (``DecodeWorkspace.attend``), replayed from a CUDA graph at the state's T: the attention part
    of a decode step, also for int4/int2 states, whose append has no one-launch form here, and
    pre-RoPE ones (row ``attend-graph<label>``)."""
    from subspace_ref_triton.workspace import DecodeWorkspace

    method = "attend-graph" + label
    lay = state.layout
    try:
        low_bit = any(lay.side_format(which).low_bits for which in ("key", "value"))
        ws = DecodeWorkspace(lay, H_Q, q.dtype, scale, fixed_tail=low_bit, rope=state.policy.rope)  # nothing is appended: the tail stays put
        want = get_torch_attend(state, lay, q, scale, int(lay.num_tokens))
        if SMOKE:  # the workspace runs; its graph cannot
            diff = float((ws.attend(q).float() - want).abs().max())
            rows.append(dict(method=method, skipped=f"no CUDA graphs on the CPU interpreter (eager |diff| {diff:.2e})"))
            return
        graph = capture(lambda: ws.attend(q))
        graph.replay()
        diff = float((ws.out.float() - want).abs().max())
        rows.append(dict(method=method, ms=bench(graph.replay), bytes=state.nbytes, max_abs_diff_vs_torch=diff))
        if PROFILE_DIR is not None:
            profile_step(graph, lambda: None, f"{method.replace(' ', '-')}_N{q.shape[0]}_T{int(lay.num_tokens)}")
    except Exception as err:  # noqa: BLE001 - one failing row must not end the run
        traceback.print_exc()
        rows.append(dict(method=method, skipped=f"error: {type(err).__name__}: {err}"))


def time_merge_shapes(rows: list[dict], state, q, scale: float, label: str, split_counts=()) -> None:
    """The merge launch alone and the attention (``DecodeWorkspace``'s split, then the merge), each
    replayed from a CUDA graph, per merge shape of MERGE_SWEEP (``decode.merge_launch``'s
    ``columns`` and ``block_s``; None: the default), at the workspace's default split count and at
    ``split_counts`` (rows ``merge-graph<label> ...`` and ``attend-graph<label> ...``; docs/gpu.md,
    "The merge at N = 1")."""
    from subspace_ref_triton.workspace import DecodeWorkspace

    lay = state.layout
    low_bit = any(lay.side_format(which).low_bits for which in ("key", "value"))
    want = get_torch_attend(state, lay, q, scale, int(lay.num_tokens))
    timed = set()
    for num_splits in [None, *split_counts]:
        ws = DecodeWorkspace(lay, H_Q, q.dtype, scale, num_splits=num_splits, fixed_tail=low_bit)
        if ws.num_splits not in timed:  # a count given that is the default's is timed once
            timed.add(ws.num_splits)
            _time_merge_shapes(rows, state, q, label, ws, want)


def _time_merge_shapes(rows: list[dict], state, q, label: str, ws, want) -> None:
    """:func:`time_merge_shapes` on one workspace."""
    from subspace_ref_triton import decode

    split, _ = ws.launches(q)
    if not SMOKE:
        try:
            rows.append(dict(method="split-graph" + label + f" S={ws.num_splits}", ms=bench(capture(split.run).replay), part=True))
        except Exception as err:  # noqa: BLE001 - one failing row must not end the run
            traceback.print_exc()
            rows.append(dict(method="split-graph" + label + f" S={ws.num_splits}", skipped=f"error: {type(err).__name__}: {err}"))
    for columns, block_s in MERGE_SWEEP:
        merge, _ = decode.merge_launch(*ws.partials, ws.out.dtype, out=ws.out, columns=columns, block_s=block_s)
        shape = f" cols={merge.constexprs['DV']} splits/step={merge.constexprs['BLOCK_S']} S={ws.num_splits}"
        try:
            if SMOKE:
                split.run()
                merge.run()
                rows.append(dict(method="attend-graph" + label + shape, skipped="no CUDA graphs on the CPU interpreter",
                                 max_abs_diff_vs_torch=float((ws.out.float() - want).abs().max())))
                continue
            split.run()
            merge_ms = bench(capture(merge.run).replay)
            graph = capture(lambda: (split.run(), merge.run()))
            graph.replay()
            diff = float((ws.out.float() - want).abs().max())
            rows.append(dict(method="merge-graph" + label + shape, ms=merge_ms, part=True))
            rows.append(dict(method="attend-graph" + label + shape, ms=bench(graph.replay), bytes=state.nbytes, max_abs_diff_vs_torch=diff))
        except Exception as err:  # noqa: BLE001 - one failing row must not end the run
            traceback.print_exc()
            rows.append(dict(method="attend-graph" + label + shape, skipped=f"error: {type(err).__name__}: {err}"))


def get_torch_attend(state, layout, q, scale, T):
    """The torch backend's attention over the first T tokens of ``layout`` under ``state``'s policy."""
    from dataclasses import replace

    from subspace_ref.registry import get_backend

    view = state.copy()
    view.layout = replace(layout, num_tokens=T)
    return get_backend("torch").attend(q, view, scale).float()


def plot(files: list[str], out: Path) -> None:
    """Time and speedup over the best SDPA against T, one panel pair per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    for f in files:
        data = json.loads(Path(f).read_text())
        rows = [r for r in data["rows"] if "ms" in r and not r.get("part") and " bt=" not in r["method"] and " cols=" not in r["method"]]  # defaults only
        batches = sorted({r["N"] for r in rows})
        fig, axes = plt.subplots(2, len(batches), figsize=(6 * len(batches), 8), squeeze=False)
        for col, N in enumerate(batches):
            for method in sorted({r["method"] for r in rows if r["N"] == N}):
                pts = sorted((r["T"], r["ms"] * 1e3, r.get("speedup_vs_sdpa", float("nan"))) for r in rows if r["N"] == N and r["method"] == method)
                T, us, sp = zip(*pts)
                axes[0][col].loglog(T, us, marker="o", label=method)
                axes[1][col].semilogx(T, sp, marker="o", label=method)
            axes[0][col].set(title=f"N = {N}: time per call", xlabel="T (tokens)", ylabel="us")
            axes[1][col].set(title=f"N = {N}: speedup over the best SDPA", xlabel="T (tokens)", ylabel="x")
            axes[0][col].legend(fontsize=7)
        fig.suptitle(f"{data['meta']['device']}, commit {data['meta']['git_commit']}")
        fig.tight_layout()
        png = out / (Path(f).stem + ".png")
        fig.savefig(png, dpi=110)
        print(f"wrote {png}")


COLUMNS = ("N", "T", "method", "chunks", "ms", "bytes", "GBps", "bw_fraction", "speedup_vs_sdpa", "max_abs_diff_vs_torch")


def format_row(r: dict) -> str:
    if "skipped" in r:
        return f"{r['method']:22s} skipped: {r['skipped']}"
    diff = r.get("max_abs_diff_vs_torch")
    bw = f"  {r['bytes'] / 2**20:9.1f} MiB  {r['GBps']:7.0f} GB/s  {100 * r['bw_fraction']:5.1f}% of copy" if "GBps" in r else ""
    ratio = f"  x{r['speedup_vs_sdpa']:6.2f} vs SDPA" if "speedup_vs_sdpa" in r else ""
    return f"{r['method']:22s} {r['ms'] * 1e3:9.1f} us{bw}{ratio}" + (f"  |diff| {diff:.2e}" if diff is not None else "")


def write_results(out: Path, meta: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stamp = "".join(ch for ch in meta["date"] if ch.isalnum())  # 20261126T160941+0000 -> 20261126T1609410000: plain file names
    (out / f"decode_gpu_{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        f"# Decode attention on {meta['device']}",
        "",
        (f"{meta['date']}, commit `{meta['git_commit']}`, torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}. "
         f"{H_Q} query heads, {H_KV} KV heads, d = d_v = {D}, r = r_v = {RANK}, {DTYPE}. "
         f"Copy bandwidth (read + write) {meta['copy_bandwidth_GBps']} GB/s. Median of triton.testing.do_bench."),
        "",
        "| N | T | method | chunks | time (us) | MiB read | GB/s | % of copy bw | speedup vs SDPA | max abs diff vs torch |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['N']} | {r['T']} | {r['method']} | {r.get('chunks', '')} | skipped: {r['skipped']} | | | | | |")
            continue
        diff = r.get("max_abs_diff_vs_torch")
        mib, gbps, frac = (f"{r['bytes'] / 2**20:.1f}", f"{r['GBps']:.0f}", f"{100 * r['bw_fraction']:.1f}") if "GBps" in r else ("", "", "")
        ratio = f"{r['speedup_vs_sdpa']:.2f}" if "speedup_vs_sdpa" in r else ""  # none for a part of the attention
        lines.append(
            f"| {r['N']} | {r['T']} | {r['method']} | {r.get('chunks', '')} | {r['ms'] * 1e3:.1f} | {mib} | "
            f"{gbps} | {frac} | {ratio} | {'' if diff is None else f'{diff:.2e}'} |"
        )
    (out / f"decode_gpu_{stamp}.md").write_text("\n".join(lines) + "\n")
    print(f"\nwrote {out / f'decode_gpu_{stamp}.json'} and {out / f'decode_gpu_{stamp}.md'}")


if __name__ == "__main__":
    main()
