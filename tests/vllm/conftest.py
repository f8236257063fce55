"""Fixtures of the vLLM plugin tests (docs/vllm.md). They run in the venv `.ci/vllm` builds
(vllm-cpu pins its own torch and transformers < 5.20); every test module skips where vLLM is
not importable, as in the project's main venv.

The references are the library's transformers path, which needs the main venv's transformers:
tests/vllm/make_reference.py computes them there, with the bases it stores beside them in
tests/vllm/data/, and the tests here serve the same bases under vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from _vllm_support import DATA, NEW_TOKENS, PROMPTS, REFERENCE, RANKS


def _have_vllm() -> bool:
    # tests/vllm is a directory on sys.path under pytest: a bare `import vllm` would find it as a namespace package
    try:
        return importlib.util.find_spec("vllm.v1") is not None
    except ImportError:
        return False


if _have_vllm():
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine: capacities below are per GiB
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # LLM.apply_model ships a function to the workers
    os.environ.pop("TRITON_INTERPRET", None)  # tests/conftest.py sets it for its triton tests; vLLM must not see it


@pytest.fixture(scope="session")
def shipped_model() -> str:
    from subspace_ref.models.default_model import default_model_dir

    return str(default_model_dir())


@pytest.fixture(scope="session")
def shipped_bases():
    """rank -> the stored bases directory of the shipped model at r_k = r_v = rank."""
    return {r: DATA / f"shipped_r{r}" for r in RANKS}


@pytest.fixture(scope="session")
def expected() -> dict:
    """The stored greedy tokens of the transformers path: "shipped/stock", "shipped/r32",
    "shipped/r16", "replicated/r32" (make_reference.py)."""
    record = json.loads(REFERENCE.read_text())
    assert record["prompts"] == [p.decode() for p in PROMPTS] and record["new_tokens"] == NEW_TOKENS, (
        f"{REFERENCE} was made for other prompts: run python tests/vllm/make_reference.py in the main venv"
    )
    return record["tokens"]
