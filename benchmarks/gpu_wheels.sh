#!/usr/bin/env bash
# Wheels for a lent GPU (docs/gpu.md, "The campaign"): its image has transformers 5.17, older than the
# caches need (subspace_ref/hf_requirements.py), and nothing can be downloaded there. Run this here
# before a session, carry .gpu_wheels in the device call, and gpu_session.sh's step 0 installs
# constraints.txt's transformers from it, offline:
#   bash benchmarks/gpu_wheels.sh [PYTHON_VERSION]   (default 3.12, the GPU image's Python)
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
PIN=$(grep -E '^transformers==' constraints.txt)
rm -rf .gpu_wheels
mkdir -p .gpu_wheels
python3 -m pip download -q --only-binary=:all: --python-version "$PYV" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 -d .gpu_wheels "$PIN"
# the image's numpy satisfies transformers (>= 1.17), and its wheel is 16 MB of the 64 MiB a device call carries
rm -f .gpu_wheels/numpy-*.whl
du -sh .gpu_wheels
