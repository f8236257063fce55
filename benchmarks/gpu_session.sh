#!/usr/bin/env bash
# The prepared GPU session of issue 38 (docs/gpu.md, "Static budgets"): at most 8 minutes on one
# H100/H200, each step writing under $OUT; a failing step does not stop the next. The steps' own
# limits add up to more than one call may take (the two calls of 2026-11-28 took 278 and 326 s
# before steps 3b and 3p were added), so BUDGET (seconds) caps every step's limit by the time left
# and skips a step with under 10 s left: nothing outlives the call (a killed `timeout` leaves its
# child running). Run from the repository root:
#   OUT=gpu_results BUDGET=460 timeout 470 bash benchmarks/gpu_session.sh
# and continue a call that ran out of budget with a second one that skips the steps done:
#   SKIP="1 1b 2 3 3p" (step names as below).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
unset TRITON_INTERPRET
export TRITON_DEFAULT_FP_FUSION=1
PY=${PYTHON:-python}
END=$((SECONDS + ${BUDGET:-100000}))
lim() { local left=$((END - SECONDS)); ((left < 1)) && left=1; echo $(($1 < left ? $1 : left)); }  # a limit capped by the time left (>= 1: 0 would disable it)
want() {  # step $1 is not in SKIP and there is time for it
  [[ " ${SKIP:-} " == *" $1 "* ]] && return 1
  (( END - SECONDS > 10 )) && return 0
  echo "step $1: skipped, under 10 s of BUDGET left" >> "$OUT/session.txt"
  return 1
}

# 0. the transformers the caches need (subspace_ref/hf_requirements.py; constraints.txt's pin), installed offline
#    from .gpu_wheels when the call carries it (benchmarks/gpu_wheels.sh builds it here: the GPU image's 5.17 is older,
#    and nothing can be downloaded there); without it the caches' tests and step 3b skip (<= 60 s)
if want 0 && [ -d .gpu_wheels ]; then
  timeout $(lim 60) $PY -m pip install -q --no-index --find-links .gpu_wheels "$(grep -E '^transformers==' constraints.txt)" > "$OUT/wheels.log" 2>&1
  echo "transformers from .gpu_wheels: rc=$?" >> "$OUT/session.txt"
fi

# device, date and commit, for docs/gpu.md
{
  date -u +%FT%TZ
  git rev-parse HEAD 2>/dev/null; git status --short backends 2>/dev/null | head -20
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  $PY -c "import transformers; print('transformers', transformers.__version__)"
} >> "$OUT/session.txt" 2>&1

if want 1; then
# 1. GPU differential tests of the changed kernels: the split kernel, the pre-RoPE kernel, the
#    vendor path, the merge launch's shapes, the optional one-launch split + merge, and the graph cache's CUDA-graph generate (<= 150 s). -v names each result as it
#    comes (the junit file is written only at the end), and a per-test limit fails a hung test
#    instead of killing the run (docs/gpu.md, "Fifth-pass kernels timed"); each failure's traceback is appended to
#    failures.log as it happens (tests/conftest.py: pytest prints them only at the end, which a limit cuts off).
XDIST=$($PY -c "import xdist" 2> /dev/null && echo "-n 14")
PER_TEST=$($PY -c "import pytest_timeout" 2> /dev/null && echo "--timeout=60")
#    The torch backend's C kernels are left off (SUBSPACE_REF_CPU_KERNELS=0: their first build took 90 s, past the per-test
#    limit, in 2026-11-29's run) and the fused kernel's compile check is CI's, not this step's (70 s of compiling).
SUBSPACE_FAILURE_LOG="$OUT/failures.log" SUBSPACE_REF_CPU_KERNELS=0 timeout $(lim 150) $PY -m pytest -v $XDIST $PER_TEST tests/test_triton_vendor.py tests/test_triton_fused_merge.py tests/test_triton_merge_launch.py tests/test_triton_launch.py tests/test_graph_cache.py tests/test_graph_kernel_decode.py \
  tests/test_rope_decode.py tests/test_triton_kernels.py -k "(Decode or LowBit or rope or Rope or graph or Workspace or vendor or refused or float32_states or fused or merge or cuda or device_row) and not compiles_without_local_memory" \
  -p no:cacheprovider --junitxml="$OUT/tests.xml" > "$OUT/tests.log" 2>&1
rc=$?
grep -E "(FAILED|ERROR) " "$OUT/tests.log" | sed 's/^\[gw[0-9]*\] *\[ *[0-9]*%\] *//' | sort | uniq | head -40 >> "$OUT/session.txt"
echo "tests: rc=$rc" >> "$OUT/session.txt"
fi

if want 1b; then
# 1b. the kernels of the last landing, when carried in .gpu_before/ (an ignored copy of
#     backends/subspace_ref_triton, first on PYTHONPATH): the same N = 8 run, for a before/after
#     on the same machine (<= 70 s)
if [ -d .gpu_before/subspace_ref_triton ]; then
  PYTHONPATH=$PWD/.gpu_before${PYTHONPATH:+:$PYTHONPATH} timeout $(lim 70) $PY -c "import subspace_ref_triton as m; print('timed tree:', m.__file__)" > "$OUT/decode_n8_before.log" 2>&1
  PYTHONPATH=$PWD/.gpu_before${PYTHONPATH:+:$PYTHONPATH} timeout $(lim 70) $PY benchmarks/decode_gpu.py --out "$OUT/before" --batch 8 --tokens 32768 131072 --coef float int8 int4 --rope \
    --no-adaptive --no-sweep --no-graph --backend triton >> "$OUT/decode_n8_before.log" 2>&1
  echo "decode N=8 before: rc=$?" >> "$OUT/session.txt"
fi
fi

if want 2; then
# 2. decode_gpu.py at N = 8, T = 32k and 128k (float, int8, int4, pre-RoPE), with the graph step and attend-graph rows (<= 150 s;
#    results are written after each T)
timeout $(lim 150) $PY benchmarks/decode_gpu.py --out "$OUT" --batch 8 --tokens 32768 131072 --coef float int8 int4 --rope --no-adaptive --no-sweep \
  --backend triton > "$OUT/decode_n8.log" 2>&1
echo "decode N=8: rc=$?" >> "$OUT/session.txt"
fi

if want 3; then
# 3. ... and at N = 1, T = 32k, with the graph-captured step, the attention alone under a graph, and the merge launch's
#    shapes at the default split count and at 32 and 64 (MERGE_SWEEP: docs/gpu.md "The merge at N = 1") (<= 90 s: the step
#    took ~30 s without the sweep; the sweep's share is estimated, it has not run on a GPU yet)
timeout $(lim 90) $PY benchmarks/decode_gpu.py --out "$OUT" --batch 1 --tokens 32768 --coef float int4 --no-adaptive --no-sweep --backend triton \
  --merge-sweep --merge-splits 32 64 > "$OUT/decode_n1.log" 2>&1
echo "decode N=1: rc=$?" >> "$OUT/session.txt"
fi

if want 3p; then
# 3p. the same captured graphs traced with torch.profiler, in a process of their own (its timings are not used): each
#     kernel's duration and the gaps between them, where the N = 1 step's time goes against the goal of 20 us (<= 50 s)
timeout $(lim 50) $PY benchmarks/decode_gpu.py --out "$OUT/profiled" --batch 1 --tokens 32768 --coef float int4 --no-adaptive --no-sweep \
  --backend triton --profile-step "$OUT/step_profiles" > "$OUT/decode_n1_profile.log" 2>&1
echo "decode N=1 profile: rc=$?" >> "$OUT/session.txt"
fi

if want 3b; then
# 3b. transformers generate through the graph cache, float, int4 and docs/baselines.md's best state (pre-RoPE int4,
#     4 sinks, 32 recent tokens; the kernel operator), compiled by generate's default (CUDA graphs), against
#     DynamicCache + SDPA and the compiled StaticCache, at T = 32k (<= 180 s; rows print as they finish)
timeout $(lim 180) $PY benchmarks/graph_decode.py --device cuda --contexts 32768 --steps 64 --coefficients float int4 pre-rope-int4-sinks4-window32 \
  --json "$OUT/graph_decode.json" > "$OUT/graph_decode.log" 2>&1
echo "graph decode: rc=$?" >> "$OUT/session.txt"
fi

if want 3c; then
# 3c. the sweeps, after the goals' rows (a cut run loses exploration, not the goals):
#    the int4 sweep at 128k: the centred kernel at 1 (default), 2 and 4 warps, under other caps (cap=176: the default before
#    2026-11-29's timing, for Triton versions other than 3.6), the per-code path at 64-token tiles (<= 90 s)
timeout $(lim 90) $PY benchmarks/decode_gpu.py --out "$OUT" --batch 8 --tokens 131072 --coef int4 --no-adaptive --no-graph --backend triton \
  > "$OUT/decode_n8_int4_sweep.log" 2>&1
echo "decode N=8 int4 sweep: rc=$?" >> "$OUT/session.txt"
#    the pre-RoPE kernel's sweep at 128k: the default launch (register-capped, a softmax per warp) and ROPE_SWEEP's (the same
#    uncapped; one softmax a tile; 32 tokens on 2 and 4 warps, 16 on 4, 128 on 8) for float and int4, then int8 (last, as rows
#    are written as they come, so a cut loses only int8's) (<= 80 s)
timeout $(lim 80) $PY benchmarks/decode_gpu.py --out "$OUT" --batch 8 --tokens 131072 --coef float int4 int8 --rope --rope-sweep --no-sweep --no-adaptive --no-graph \
  --backend triton > "$OUT/decode_n8_rope_sweep.log" 2>&1
echo "decode N=8 rope sweep: rc=$?" >> "$OUT/session.txt"
fi

if want 4; then
# 4. one profiler pass per changed kernel (ncu when installed: one launch each) (<= 3 x 32 s)
if command -v ncu > /dev/null; then
  for coef in int4 float; do
    timeout $(lim 32) ncu --kernel-name regex:_decode_split_kernel --launch-skip 3 --launch-count 1 --section SpeedOfLight --section Occupancy \
      --section WarpStateStats --section MemoryWorkloadAnalysis -o "$OUT/ncu_split_$coef" -f \
      $PY benchmarks/decode_gpu.py --out "$OUT/ncu_run" --batch 8 --tokens 32768 --coef $coef --no-adaptive --no-sweep --no-graph --backend triton \
      > "$OUT/ncu_split_$coef.log" 2>&1
    echo "ncu split $coef: rc=$?" >> "$OUT/session.txt"
  done
  timeout $(lim 32) ncu --kernel-name 'regex:_rope_(split|mma)_kernel' --launch-skip 3 --launch-count 1 --section SpeedOfLight --section Occupancy \
    --section WarpStateStats -o "$OUT/ncu_rope" -f \
    $PY benchmarks/decode_gpu.py --out "$OUT/ncu_run" --batch 8 --tokens 32768 --coef float --rope --no-adaptive --no-sweep --no-graph --backend triton \
    > "$OUT/ncu_rope.log" 2>&1
  echo "ncu rope: rc=$?" >> "$OUT/session.txt"
  for rep in "$OUT"/ncu_*.ncu-rep; do ncu --import "$rep" --page details > "${rep%.ncu-rep}.txt" 2>&1; done
else
  echo "ncu: not installed, no profiler pass" >> "$OUT/session.txt"
fi
fi
cat "$OUT/session.txt"
