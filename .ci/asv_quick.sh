#!/usr/bin/env bash
# Run the asv suite (benchmarks/) once in quick mode against the package installed in the current
# Python environment, so that a broken benchmark fails CI. Called from .ci/run after pytest.
# Offline: `--python=same` uses this interpreter (environment type "existing"), builds nothing.
#   - SUBSPACE_BENCH_QUICK=1 shrinks the parameter grids to one small point (T = 1024, rank 16);
#   - SUBSPACE_BENCH_REQUIRE: targets that must run here (an unavailable one fails, not skips);
#     GPU targets skip on a machine without a GPU (asv's skip: NotImplementedError in setup);
#   - one BLAS/OpenMP thread: on a shared 2-core runner, oversubscribed BLAS threads make the
#     adaptive fixtures 10-20x slower; the quick run checks that benchmarks work, not their speed.
# asv exits 2 when a benchmark fails and 1 when the suite cannot be imported; the log is also
# searched for asv's failure markers in case a future asv stops reporting them in its status.
set -uo pipefail
cd "$(dirname "$0")/../benchmarks"
export SUBSPACE_BENCH_QUICK=1
export SUBSPACE_BENCH_REQUIRE="${SUBSPACE_BENCH_REQUIRE:-numpy,torch-cpu}"
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
PY="${PYTHON:-python}"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT

"$PY" -m asv machine --yes --machine subspace-ci >/dev/null || exit 1
"$PY" -m asv check --python=same || { echo "asv check failed" >&2; exit 1; }
"$PY" -m asv run --python=same --quick --dry-run --show-stderr --machine subspace-ci \
    --launch-method forkserver 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
if grep -qE "asv: benchmark failed|Failed to build the project and import the benchmark suite|asv: benchmark timed out" "$log"; then
    echo "asv quick run: a benchmark failed (see above)" >&2
    [ "$status" -ne 0 ] || status=2
fi
[ "$status" -eq 0 ] && echo "asv quick run: all benchmarks ran (unavailable backends skipped)"
exit "$status"
