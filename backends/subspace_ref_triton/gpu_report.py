"""``subspace-kv gpu-report``: static evidence about every shipped GPU kernel configuration, on a
machine without a GPU.

For each configuration the backends launch (Triton: the split, merge and projection kernels at
the benchmark's shape for every state dtype and coefficient storage, eager and graph-capturable;
CUDA: every template instantiation of the CuPy backend) and each of sm_80 / sm_90, compiled as it
will launch (:mod:`subspace_ref_triton.compile_report`): registers, spills, stack, shared memory,
resident programs per SM (:mod:`subspace_ref_triton.occupancy`) on an A100 (108 SMs) / H100
(132 SMs), and for the decode kernels the waves of the benchmark's grid (8 KV heads x 32 query
heads, d = 128, r = 32, N = 1 and 8, T = 32k) with the split count the launcher now picks and with
the one it picked before (4 programs per SM assumed); then the roofline-predicted time of the
benchmark's decode step (``subspace_ref.roofline``, spec R10) on both GPUs.

For the default decode kernels it also measures the main loop from the sm_90 SASS
(:mod:`subspace_ref_triton.sass`): warp-instructions per token and KV head, local memory,
float64 and CALLs in the loop, load widths and a model of the bytes in flight per SM, against
issue 38's budgets (``tests/test_sass_budget.py``).

A configuration is *default* when the backend launches it for the benchmark's setting (d = 128,
r = 32, any dtype and coefficient storage); ``tests/test_triton_compile.py`` and
``tests/test_cuda_sources.py`` fail when one of them spills. ``--exhaustive`` adds head sizes
64-256, ranks 16-128 and GQA groups 1-32 for the Triton decode kernel.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from subspace_ref_triton.occupancy import A100, GPUS, H100, resident_blocks

ARCH_GPU = {90: H100, 80: A100}
ARCHS = (90, 80)
# The benchmark's setting (benchmarks/decode_gpu.py): 32 query heads over 8 KV heads.
H_KV, GROUP, D, RANK = 8, 4, 128, 32
BENCH_BATCH = (1, 8)
BENCH_TOKENS = 32768
ROOFLINE_TOKENS = (4096, 32768, 131072)


@dataclass
class Row:
    backend: str  # "triton" or "cuda"
    kernel: str
    config: str
    default: bool
    arch: int
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    shared: int
    num_warps: int
    resident: int = 0
    limiter: str = ""
    waves: dict | None = None  # "N=1": (splits, waves now, waves with 4 programs/SM assumed)
    measured: str = ""  # a default chosen by GPU timings although it spills: why


# ------------------------------------------------------------------------------------- Triton


def _layout(torch, T, d, r, dtype, coef, J=1):
    """A zero layout of the benchmark's shape; ``coef``: "float", "int8" (spec A10) or
    "int4"/"int2" (spec/quantization.md Q2, default group of 32)."""
    from subspace_ref.layout import PackedLayout
    from subspace_ref.formats import coefficient_format
    from subspace_ref.quantization import DEFAULT_GROUP, packed_width

    cdt, width, scales = dtype, r, {}
    if coef == "int8":
        cdt = torch.int8
        scales = dict(key_scale=torch.zeros(1, H_KV, T), value_scale=torch.zeros(1, H_KV, T), key_format=coef, value_format=coef)
    elif coefficient_format(coef).low_bits:
        G, f16, bits = DEFAULT_GROUP, torch.float16, coefficient_format(coef).low_bits
        cdt, width = torch.uint8, packed_width(r, bits)
        scales = dict(key_group_scale=torch.zeros(1, H_KV, T // G, r, dtype=f16), key_group_zero=torch.zeros(1, H_KV, T // G, r, dtype=f16),
                      key_tail=torch.zeros(1, H_KV, G, r, dtype=dtype), value_token_scale=torch.zeros(1, H_KV, T, dtype=f16),
                      value_token_zero=torch.zeros(1, H_KV, T, dtype=f16), key_format=coef, value_format=coef, group=G)
    return PackedLayout(torch.zeros(1, H_KV, T, width, dtype=cdt), torch.zeros(1, H_KV, T, width, dtype=cdt),
                        torch.zeros(1, H_KV, J, r, d, dtype=dtype), torch.zeros(1, H_KV, J, r, d, dtype=dtype),
                        torch.zeros(1, H_KV, J, dtype=torch.int64), torch.ones(1, H_KV, dtype=torch.int64),
                        torch.ones(H_KV, dtype=dtype), T, **scales)


def triton_launches(exhaustive: bool = False):
    """(kernel, config label, default?, Launch) of every Triton configuration reported. Tensors are
    CPU tensors with the shapes, dtypes and 16-byte alignment of the real launch."""
    import torch

    from subspace_ref_triton import decode, project

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    out = []
    T = 8192
    shapes = [(D, RANK, GROUP)]
    if exhaustive:
        shapes += [(d, r, g) for d in (64, 128, 256) for r in (16, 32, 64, 128) for g in (1, 4, 8, 32) if r <= d and (d, r, g) != (D, RANK, GROUP)]
    for d, r, g in shapes:
        default = (d, r, g) == (D, RANK, GROUP)
        for name, dt in dtypes.items():
            for coef in ("float", "int8", "int4", "int2"):
                lay = _layout(torch, T, d, r, dt, coef)
                q = torch.zeros(1, H_KV * g, d, dtype=dt)
                for graph in (False, True):
                    if graph and not (default and name == "bf16"):
                        continue  # the graph-capturable variant differs by one load: reported at the default shape
                    kw = dict(num_tokens=torch.zeros(1, dtype=torch.int64)) if graph else {}
                    launch, _ = decode.split_launch(q, lay, 0.1, 0 if graph else 1024, 8, **kw)
                    label = f"{name}{'' if coef == 'float' else ' ' + coef} d={d} r={r} g={g} bt={launch.constexprs['BLOCK_T']} w={launch.num_warps}"
                    out.append(("decode split" + (" (graph)" if graph else ""), label, default, launch))
                    if default and name == "bf16" and not graph and launch.max_registers:  # what the register cap trades
                        uncapped, _ = decode.split_launch(q, lay, 0.1, 1024, 8, max_registers=0)
                        out.append(("decode split", label + " uncapped", False, uncapped))
    import numpy as np

    from subspace_ref.rope import RopeParams
    from subspace_ref_triton import rope_decode, window_decode

    rope = RopeParams(1.0 / 10000.0 ** (np.arange(D // 2) / (D // 2)))  # full rotary, Llama's layout
    for name, coef in (("bf16", "float"), ("bf16", "int8"), ("bf16", "int4"), ("bf16", "int2"), ("fp32", "float")):  # pre-RoPE (spec/rope.md P3)
        lay = _layout(torch, T, D, RANK, dtypes[name], coef)
        for graph in (False, True):
            if graph and name != "bf16":
                continue  # the graph-capturable variant (a device token count, one base-angle table over the capacity): 16-bit bases
            kw = dict(num_tokens=torch.zeros(1, dtype=torch.int64), num_splits=8) if graph else {}
            launch, _ = rope_decode.split_launch(torch.zeros(1, H_KV * GROUP, D, dtype=dtypes[name]), lay, rope, 0.1, 0 if graph else 1024, **kw)
            label = f"{name}{'' if coef == 'float' else ' ' + coef} d={D} r={RANK} g={GROUP} bt={launch.constexprs['BLOCK_T']} w={launch.num_warps}"
            out.append(("decode rope" + (" (graph)" if graph else ""), label, True, launch))
            if not graph and launch.max_registers:  # what the register cap (rope_decode.MAX_REGISTERS) trades
                uncapped, _ = rope_decode.split_launch(torch.zeros(1, H_KV * GROUP, D, dtype=dtypes[name]), lay, rope, 0.1, 1024, max_registers=0)
                out.append(("decode rope", label + " uncapped", False, uncapped))

    for name in ("bf16", "fp32"):  # exact tokens (spec/window.md W3, W8): one partial per segment
        k = torch.zeros(1, H_KV, 512, D, dtype=dtypes[name])
        q = torch.zeros(1, H_KV * GROUP, D, dtype=dtypes[name])
        parts = (torch.zeros(1, H_KV * GROUP, 2), torch.zeros(1, H_KV * GROUP, 2), torch.zeros(1, H_KV * GROUP, 2, D))
        out.append(("decode exact", f"{name} d={D} g={GROUP} bt={window_decode.BLOCK_T}", True, window_decode.exact_launch(q, k, k, 0.1, parts, 1)))
        # a windowed graph layer's merge launch (spec/models.md M11.14 step 4): 4 sinks and 32 recent slots, 40 split partials
        merge_parts = (torch.zeros(1, H_KV * GROUP, 40), torch.zeros(1, H_KV * GROUP, 40), torch.zeros(1, H_KV * GROUP, 40, D))
        launch = window_decode.exact_merge_launch(q, k[:, :, :36], k[:, :, :36], 0.1, merge_parts, torch.zeros(1, H_KV * GROUP, D, dtype=dtypes[name]),
                                                  torch.zeros((), dtype=torch.int64))
        out.append(("decode exact merge (graph)", f"{name} d={D} g={GROUP} bt={window_decode.BLOCK_T} sinks+recent=36", True, launch))
    for name in ("bf16", "fp32"):
        m = torch.zeros(1, H_KV * GROUP, 40)
        launch, _ = decode.merge_launch(m, m, torch.zeros(1, H_KV * GROUP, 40, D), dtypes[name])
        out.append(("decode merge", f"{name} d_v={D}", True, launch))
    for name, int8 in (("bf16", False), ("bf16", True), ("fp32", False)):
        dt = dtypes[name]
        keys = torch.zeros(1, H_KV, 16, D, dtype=dt)
        bases = torch.zeros(1, H_KV, 1, RANK, D, dtype=dt)
        coef = torch.zeros(1, H_KV, 16, RANK, dtype=torch.int8 if int8 else dt)
        scales = dict(out_key_scale=torch.zeros(1, H_KV, 16), out_value_scale=torch.zeros(1, H_KV, 16)) if int8 else {}
        launch, _ = project.project_launch(keys, keys, bases, bases, torch.zeros(1, H_KV, dtype=torch.int64), coef, coef.clone(), True, **scales)
        out.append(("project", f"{name}{' int8' if int8 else ''} d={D} r={RANK} residuals", True, launch))
        if name == "bf16":  # DecodeWorkspace.append: one token at the device count, no residuals
            launch, _ = project.project_launch(keys[:, :, :1], keys[:, :, :1], bases, bases, torch.zeros(1, H_KV, dtype=torch.int64), coef, coef.clone(),
                                               out_row=torch.zeros((), dtype=torch.int64), **scales)
            out.append(("project", f"{name}{' int8' if int8 else ''} d={D} r={RANK} one token at the device count", True, launch))
    return out


def sass_rows() -> list[dict]:
    """The main loop of every default decode configuration (split and pre-RoPE, eager and
    graph-capturable) compiled for sm_90, measured from its SASS (:mod:`subspace_ref_triton.sass`), with
    the budget it is held to (None: float32 bases, reported only)."""
    from subspace_ref_triton import sass
    from subspace_ref_triton.compile_report import launch_resources

    out = []
    for kernel, label, default, launch in triton_launches():
        if not default or not kernel.startswith(("decode split", "decode rope")):
            continue
        res = launch_resources(launch, 90)
        resident = resident_blocks(H100, res.registers, res.num_warps, res.shared).blocks_per_sm
        stats = sass.launch_stats(launch, 90, resident)
        out.append(dict(kernel=kernel, config=label, budget=sass.budget_kind(kernel, label), sass=stats.as_dict()))
    return out


def chosen_reason(kernel: str, launch) -> str:
    """Why a default ``launch`` of ``kernel`` may spill ("" when it may not): a register cap the
    split kernel's launcher gave it because a GPU timed it faster (launch_config's caps and the
    centred form's: decode.REGISTER_CAPS_MEASURED), the int8 one-warp launch that a GPU timed
    fastest uncapped, spilling at ptxas's own limit (decode.INT8_UNCAPPED_MEASURED), or the
    pre-RoPE kernel's softmax per warp under its cap, timed faster (rope_decode.WARP_SOFTMAX_MEASURED).
    Read from the launch, so the exemption cannot drift from the rule that sets it. No other kernel
    or cap may spill (the two-warp float cap and the pre-RoPE cap with one softmax a tile were
    chosen as spill-free)."""
    from subspace_ref_triton import decode, rope_decode

    c = launch.constexprs
    if kernel.startswith("decode rope"):
        per_warp = c.get("WARPS", 1) > 1 and launch.max_registers == rope_decode.MAX_REGISTERS
        return rope_decode.WARP_SOFTMAX_MEASURED if per_warp else ""
    if not kernel.startswith("decode split"):
        return ""
    if launch.max_registers is None and c["K_INT8"] and c["V_INT8"] and launch.num_warps == decode.INT8_WARPS:
        return decode.INT8_UNCAPPED_MEASURED
    measured = (decode.QUANTISED_MAX_REGISTERS, decode.FLOAT16_MAX_REGISTERS, decode.CENTRED_MAX_REGISTERS)
    return decode.REGISTER_CAPS_MEASURED if launch.max_registers in measured else ""


def triton_rows(exhaustive: bool = False) -> list[Row]:
    from subspace_ref_triton.compile_report import launch_resources

    rows = []
    for kernel, label, default, launch in triton_launches(exhaustive):
        for arch in ARCHS:
            res = launch_resources(launch, arch)
            rows.append(Row("triton", kernel, label, default, arch, res.registers, res.spill_stores, res.spill_loads, res.stack, res.shared, res.num_warps,
                            measured=chosen_reason(kernel, launch) if default else ""))
    return rows


# ------------------------------------------------------------------------------------- CUDA


def cuda_default_names() -> set[str]:
    """The CuPy backend's instantiations for the benchmark's setting, every dtype and storage:
    decode and pre-RoPE decode (float, int8, int4, int2 coefficients), projection (float, int8:
    the formats appended to), merge and the exact-token partial."""
    from subspace_ref_cupy import _kernels as K

    names = set()
    for dtype in K.CUDA_TYPES:
        for coef in K.DECODE_COEF_KINDS:
            cfg = K.find_config(dtype, coef, D, D, RANK, RANK)
            names |= {cfg.decode_name, cfg.merge_name, K.find_rope_config(dtype, coef, RANK, RANK).name}
            if coef in K.COEF_KINDS:
                names.add(cfg.project_name)
        names.add(K.exact_name(dtype))
    return {n.replace(" ", "") for n in names}


def cuda_rows(workdir: Path | None = None) -> tuple[list[Row], list[str]]:
    """Rows of every CUDA instantiation for sm_80 and sm_90, and the nvcc failures (empty when
    every file compiled)."""
    from subspace_ref_cupy import _kernels as K

    from subspace_ref_triton.compile_report import nvcc_compile, nvcc_resources

    threads = {"decode_split_partial": K.DECODE_THREADS, "merge_splits": K.MERGE_THREADS, "project_append": K.PROJECT_THREADS,
               "decode_rope_partial": K.DECODE_THREADS, "exact_partial": K.DECODE_THREADS}
    defaults = cuda_default_names()
    rows, failures = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for filename in K.SOURCES:
            proc, cmd = nvcc_compile(filename, tuple(sorted(ARCHS)), Path(workdir or tmp))
            if proc.returncode != 0:
                failures.append(f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
                continue
            for res in nvcc_resources(proc, threads):
                rows.append(Row("cuda", res.kernel.split("<")[0].removeprefix(f"{K.NAMESPACE}::"), res.kernel, res.kernel.replace(" ", "") in defaults,
                                res.arch, res.registers, res.spill_stores, res.spill_loads, res.stack, res.shared, res.num_warps))
    return rows, failures


# ------------------------------------------------------------------------------------- occupancy


def _decode_shared(row: Row) -> int:
    """Shared memory per block: Triton's allocation, or the CUDA decode kernel's dynamic carve-up
    at the benchmark's GQA group plus its static shared memory."""
    if row.backend == "cuda" and row.kernel == "decode_split_partial":
        from subspace_ref_cupy import _kernels as K

        args = [a.strip() for a in row.config.split("<", 1)[1].rstrip(">").split(",")]  # <T, KeyT, ValT, D, DV, RT>
        d = int(args[3]) or D
        return row.shared + K.decode_shared_bytes(GROUP, d, d, int(args[5]), args[1], args[2])
    if row.backend == "cuda" and row.kernel == "decode_rope_partial":  # head sizes at run time: the benchmark's d
        from subspace_ref_cupy import _kernels as K

        args = [a.strip() for a in row.config.split("<", 1)[1].rstrip(">").split(",")]
        return row.shared + K.rope_shared_bytes(GROUP, D, int(args[3]), args[1], args[2])  # <T, KeyT, ValT, RT>
    if row.backend == "cuda" and row.kernel == "exact_partial":
        from subspace_ref_cupy import _kernels as K

        return row.shared + K.exact_shared_bytes(GROUP, D, D)
    return row.shared


def _old_triton_splits(programs: int, sms: int) -> int:
    """The split count before the occupancy fix: 4 programs per SM assumed, >= 256 tokens."""
    return max(1, min(math.ceil(BENCH_TOKENS / 256), math.ceil(4 * sms / programs)))


def add_occupancy(rows: list[Row]) -> None:
    from subspace_ref_cupy import _launch

    from subspace_ref_triton.occupancy import full_wave_splits

    for row in rows:
        gpu = ARCH_GPU[row.arch]
        occ = resident_blocks(gpu, row.registers, row.num_warps, _decode_shared(row))
        row.resident, row.limiter = occ.blocks_per_sm, occ.limiter
        if row.kernel.startswith("decode split") and "d=128 r=32 g=4" in row.config:
            row.waves = {}
            for N in BENCH_BATCH:
                programs = N * H_KV
                S = full_wave_splits(programs, BENCH_TOKENS, occ.blocks_per_sm, gpu.sms, 256)
                old = _old_triton_splits(programs, gpu.sms)
                row.waves[f"N={N}"] = (S, occ.waves(programs * S, gpu.sms), occ.waves(programs * old, gpu.sms))
        elif row.kernel == "decode_split_partial" and row.default:
            row.waves = {}
            for N in BENCH_BATCH:
                S, _ = _launch.choose_splits(N * H_KV, BENCH_TOKENS, gpu.sms)
                row.waves[f"N={N}"] = (S, occ.waves(N * H_KV * S, gpu.sms), None)


# ------------------------------------------------------------------------------------- roofline


def roofline_rows() -> list[dict]:
    """Spec R10: predicted time of the benchmark's attention step (all 8 KV heads x N) per GPU."""
    from subspace_ref.roofline import Machine, Shape, Subspace, exact_cost, subspace_cost

    out = []
    for gpu in GPUS:
        machine = Machine(gpu.name, gpu.bandwidth, gpu.flops)
        for coef in ("float", "int8"):
            for N in BENCH_BATCH:
                for T in ROOFLINE_TOKENS:
                    shape = Shape(D, D, GROUP, 2.0)
                    sub = subspace_cost(T, shape, Subspace.static(RANK, coef=coef)).phase("attend").scaled(N * H_KV)
                    full = exact_cost(T, shape).phase("attend").scaled(N * H_KV)
                    out.append(dict(gpu=gpu.name, coef=coef, N=N, T=T, subspace_us=1e6 * float(sub.time(machine)),
                                    sdpa_us=1e6 * float(full.time(machine)), bytes=float(sub.bytes)))
    return out


# ------------------------------------------------------------------------------------- report


def build(exhaustive: bool = False, cuda: bool = True) -> dict:
    """The whole report as plain data (rows, roofline, nvcc failures, what was skipped and why)."""
    from subspace_ref_triton.compile_report import nvcc

    skipped = []
    rows = triton_rows(exhaustive)
    failures: list[str] = []
    if not cuda:
        skipped.append("CUDA kernels: not asked for (--no-cuda)")
    elif nvcc() is None:
        skipped.append("CUDA kernels: nvcc not found on PATH, $CUDA_PATH or $CUDA_HOME")
    else:
        cuda_rows_, failures = cuda_rows()
        rows += cuda_rows_
    add_occupancy(rows)
    return dict(rows=[asdict(r) for r in rows], roofline=roofline_rows(), nvcc_failures=failures, skipped=skipped, sass=sass_rows())


def default_spills(report: dict, measured: bool = False) -> list[str]:
    """The default configurations that spill, one line each (empty: none): those not chosen by
    GPU timings, or (``measured``) those that were, with why."""
    return [f"{r['backend']} {r['kernel']} [{r['config']}] sm_{r['arch']}: {r['spill_stores']} B spill stores, {r['spill_loads']} B loads"
            + (f" ({r['measured']})" if measured else "")
            for r in report["rows"] if r["default"] and (r["spill_stores"] or r["spill_loads"]) and bool(r.get("measured")) == measured]


def markdown(report: dict) -> str:
    lines = [
        "| backend | kernel | configuration | default | arch | registers | spill st/ld (B) | stack (B) | shared (B) | warps | resident/SM | limiter "
        "| N=1: S, waves (was) | N=8: S, waves (was) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        waves = []
        for key in ("N=1", "N=8"):
            w = (r.get("waves") or {}).get(key)
            waves.append("" if w is None else f"{w[0]}, {w[1]:.2f}" + ("" if w[2] is None else f" ({w[2]:.2f})"))
        lines.append(
            f"| {r['backend']} | {r['kernel']} | {r['config']} | {'yes' if r['default'] else ''} | sm_{r['arch']} | {r['registers']} | "
            f"{r['spill_stores']}/{r['spill_loads']} | {r['stack']} | {r['shared']} | {r['num_warps']} | {r['resident']} | {r['limiter']} | "
            f"{waves[0]} | {waves[1]} |"
        )
    lines += ["", "Roofline-predicted attention time of one decode step (spec R10; 8 KV heads x N, d = 128, r = 32, bf16 bases):", "",
              "| GPU | coefficients | N | T | subspace (us) | SDPA over the full cache (us) | ratio |", "|---|---|---|---|---|---|---|"]
    for x in report["roofline"]:
        ratio = x["sdpa_us"] / x["subspace_us"]
        lines.append(f"| {x['gpu']} | {x['coef']} | {x['N']} | {x['T']} | {x['subspace_us']:.1f} | {x['sdpa_us']:.1f} | {ratio:.2f} |")
    if report.get("sass"):
        from subspace_ref_triton import sass

        lines += ["", "Main loops of the default decode kernels on sm_90, from their SASS (issue 38 item 6; docs/gpu.md, \"Static budgets\"):", "",
                  sass.table(report["sass"])]
    for s in report["skipped"]:
        lines.append(f"\nSkipped: {s}")
    for f in report["nvcc_failures"]:
        lines.append(f"\nnvcc failed:\n```\n{f}\n```")
    spills = default_spills(report)
    lines.append("\nDefault configurations that spill: " + ("none." if not spills else "\n- " + "\n- ".join(spills)))
    chosen = default_spills(report, measured=True)
    if chosen:
        lines.append("\nDefault configurations that spill by choice (GPU timings or the compiled code, as each says):\n- " + "\n- ".join(chosen))
    return "\n".join(lines) + "\n"


def add_arguments(parser) -> None:
    parser.add_argument("--exhaustive", action="store_true", help="also head sizes 64-256, ranks 16-128, groups 1-32 (minutes)")
    parser.add_argument("--no-cuda", action="store_true", help="skip the nvcc compile of the CuPy backend's kernels")
    parser.add_argument("--out", default=None, help="write the markdown table here and the JSON beside it (.json)")


def run(args) -> int:
    """Exit status 1 when a default configuration spills or nvcc fails, else 0."""
    if os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "y", "on"):
        print("gpu-report compiles for the GPU: unset TRITON_INTERPRET")
        return 2
    report = build(args.exhaustive, not args.no_cuda)
    text = markdown(report)
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    return 1 if default_spills(report) or report["nvcc_failures"] else 0
