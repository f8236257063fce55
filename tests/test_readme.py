"""The README's Use snippet runs as written and prints what the README says it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def use_snippet() -> tuple[str, str]:
    """The first python block of the README's "## Use" section and the text block after it."""
    text = README.read_text()
    use = text[text.index("## Use\n"):]
    use = use[: use.index("\n## ", 1)]
    m = re.search(r"```python\n(.*?)```\s*```text\n(.*?)```", use, re.S)
    assert m, "README's Use section must hold a python block followed by its expected output"
    return m.group(1), m.group(2)


def test_readme_use_snippet_runs_as_written():
    code, expected = use_snippet()
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == expected.strip()


def test_readme_cites_the_seeds_by_title_not_by_a_path_a_clone_lacks():
    text = " ".join(README.read_text().split())
    assert "shared/seeds" not in text
    assert "Online Subspace Projection for KV Caches" in text and "Low-Rank KV Cache Subspaces in Decoding" in text
