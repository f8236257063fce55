"""Ahead-of-time compile of the Triton kernels for NVIDIA GPUs (sm_90, sm_80), on any machine.

The interpreter (TRITON_INTERPRET=1, what ``test_triton_kernels.py`` runs without a GPU) executes
kernel bodies as Python, so it misses what only the GPU compiler rejects: non-constexpr globals,
tl.dot operand dtypes and shapes, loop-carried type changes. Here the exact launches the backend
makes (``split_launch``, ``merge_launch``, ``project_launch`` on CPU tensors) are compiled with
``triton.compile`` for a GPU target: frontend, MLIR passes and the ptxas bundled with Triton; no
GPU or driver is needed. It runs in a subprocess because the kernels must be decorated with
TRITON_INTERPRET unset. The resource usage (registers, stack) is printed for the record.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"

SCRIPT = r'''
import json, os, re, subprocess, sys, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from subspace_ref.layout import PackedLayout
from subspace_ref_triton import decode, project

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64", torch.int32: "i32", torch.int8: "i8"}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def signature(launch):
    sig, consts, args = {}, {}, iter(launch.args)
    for p in launch.kernel.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            consts[p.name] = launch.constexprs[p.name]
            continue
        a = next(args)
        if isinstance(a, torch.Tensor):
            sig[p.name] = "*" + TYPES[a.dtype]
        elif isinstance(a, bool):
            sig[p.name] = "i1"
        elif isinstance(a, int):
            sig[p.name] = "i32" if -2**31 <= a < 2**31 else "i64"
        else:
            sig[p.name] = "fp32"
    return sig, consts


def compile_for(launch, arch):
    sig, consts = signature(launch)
    k = triton.compile(ASTSource(launch.kernel, sig, consts), target=GPUTarget("cuda", arch, 32), options={"num_warps": launch.num_warps})
    usage = ""
    if os.path.exists(CUOBJDUMP):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"]); f.flush()
            out = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+)", out)
        usage = f"regs {m.group(1)} stack {m.group(2)} B" if m else ""
    return usage


def layout(N, H, T, d, r, r_v, J, dtype, int8=False):
    cdt = torch.int8 if int8 else dtype
    scales = dict(key_scale=torch.zeros(N, H, T), value_scale=torch.zeros(N, H, T)) if int8 else {}
    return PackedLayout(torch.zeros(N, H, T, r, dtype=cdt), torch.zeros(N, H, T, r_v, dtype=cdt),
                        torch.zeros(N, H, J, r, d, dtype=dtype), torch.zeros(N, H, J, r_v, d, dtype=dtype),
                        torch.zeros(N, H, J, dtype=torch.int64), torch.ones(N, H, dtype=torch.int64),
                        torch.ones(H, dtype=dtype), T, **scales)


results = {}
# (name, q dtype, state dtype, int8, d, r, r_v, group): the benchmark's setting and odd shapes
cases = [
    ("decode bf16 d128 r32 g4", torch.bfloat16, torch.bfloat16, False, 128, 32, 32, 4),
    ("decode fp16 d80 r5/7 g6", torch.float16, torch.float16, False, 80, 5, 7, 6),
    ("decode fp32 d64 r12 g20", torch.float32, torch.float32, False, 64, 12, 12, 20),
    ("decode fp32 q, bf16 state", torch.float32, torch.bfloat16, False, 128, 32, 32, 4),
    ("decode int8/bf16 d128 r32 g4", torch.bfloat16, torch.bfloat16, True, 128, 32, 32, 4),
]
for name, qdt, sdt, int8, d, r, r_v, g in cases:
    lay = layout(1, 2, 100, d, r, r_v, 3, sdt, int8)
    launch, _ = decode.split_launch(torch.zeros(1, 2 * g, d, dtype=qdt), lay, 0.1, 64)
    results[name] = compile_for(launch, 90)
launch, _ = decode.split_launch(torch.zeros(1, 8, 128, dtype=torch.bfloat16), layout(1, 2, 100, 128, 32, 32, 1, torch.bfloat16), 0.1, 64)
results["decode bf16 d128 r32 g4 (sm_80)"] = compile_for(launch, 80)
for dt, S in ((torch.bfloat16, 40), (torch.float32, 1)):
    launch, _ = decode.merge_launch(torch.zeros(1, 4, S), torch.zeros(1, 4, S), torch.zeros(1, 4, S, 128), dt)
    results[f"merge {TYPES[dt]} S={S}"] = compile_for(launch, 90)
for dt, quant, rho in ((torch.bfloat16, False, True), (torch.float32, False, False), (torch.bfloat16, True, True)):
    keys = torch.zeros(1, 2, 5, 80, dtype=dt)
    bases = torch.zeros(1, 2, 3, 7, 80, dtype=dt)
    out = torch.zeros(1, 2, 5, 7, dtype=torch.int8 if quant else dt)
    scales = dict(out_key_scale=torch.zeros(1, 2, 5), out_value_scale=torch.zeros(1, 2, 5)) if quant else {}
    launch, _ = project.project_launch(keys, keys, bases, bases, torch.zeros(1, 2, dtype=torch.int64), out, out.clone(), rho, **scales)
    results[f"project {TYPES[dt]} int8={quant} rho={rho}"] = compile_for(launch, 90)
print("RESULTS " + json.dumps(results))
'''


@pytest.mark.skipif(not PTXAS.exists(), reason=f"Triton's bundled ptxas is not at {PTXAS}")
def test_kernels_compile_for_gpu_targets():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-6000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULTS "))
    results = json.loads(line.removeprefix("RESULTS "))
    print("\n" + "\n".join(f"  {name}: compiled, {usage}" for name, usage in results.items()))
    assert len(results) == 11
