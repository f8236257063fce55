"""Every python block of the README runs: the Use snippet as written (tests/test_readme.py), and
each block marked as continuing it ("# continues the example above") after it. A block for a
CUDA device runs here on the CPU with the torch backend in triton's place, unless a GPU is there."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.test_readme import README, use_snippet

CONTINUES = "# continues the example above"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_every_python_block_is_the_use_snippet_or_continues_it():
    first, _ = use_snippet()
    blocks = python_blocks()
    assert blocks and blocks[0] == first
    assert [b for b in blocks[1:] if not b.startswith(CONTINUES)] == []


@pytest.mark.parametrize("index", range(1, len(python_blocks())))
def test_continuation_runs_after_the_use_snippet(index):
    pytest.importorskip("torch")
    import torch

    block = python_blocks()[index]
    if "cuda" in block and not torch.cuda.is_available():
        block = block.replace('device="cuda", ', "").replace('backend="triton"', 'backend="torch"')
    code = use_snippet()[0] + block
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
