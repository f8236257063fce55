"""The transformers release the caches need (subspace_ref/hf_requirements.py, spec/models.md M9):
on an older one every way to make a cache, or to run the stock model with ``cache=``
(``teacher_forced``, the lab's ``token_logprobs``), raises ImportError naming it, the version
found and the one required, before the model or a state factory is touched; the minimum is
the ``models`` extra's, and reading it imports neither torch nor transformers (the tests'
skips read it first)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from subspace_ref.hf_requirements import MIN_TRANSFORMERS

ROOT = Path(__file__).resolve().parents[1]


def test_caches_refuse_an_older_transformers_before_anything_changes(monkeypatch):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")  # any release: the refusal comes first
    from transformers import LlamaConfig, LlamaForCausalLM

    from subspace_ref import hf_requirements
    from subspace_ref.hf import GraphSubspaceCache, SubspaceCache, compress, static_states
    from subspace_ref.workloads import random_static_bases

    assert hf_requirements.installed_transformers() == transformers.__version__
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=64, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    bases = random_static_bases(2, 2, 8, 4)
    built = []
    factory = static_states(bases)

    def counting(spec):
        built.append(spec.layer_idx)
        return factory(spec)

    before = model.config._attn_implementation
    # transformers' lazy module may be a new object after `from transformers import ...`: patch what the check reads
    monkeypatch.setattr(hf_requirements, "installed_transformers", lambda: "5.17.0")
    makers = {
        "SubspaceCache": [lambda: SubspaceCache(model.config, counting), lambda: SubspaceCache.for_model(model, counting)],
        "GraphSubspaceCache": [lambda: GraphSubspaceCache(model.config, counting, max_cache_len=16),
                               lambda: GraphSubspaceCache.for_model(model, counting, max_cache_len=16)],
    }
    for name, makes in makers.items():
        for make in makes:
            with pytest.raises(ImportError, match=rf"^{name} needs transformers >= {re.escape(MIN_TRANSFORMERS)} \(generate's cache= .*found transformers 5\.17\.0"):
                make()
    with pytest.raises(ImportError, match="^SubspaceCache needs transformers"):
        with compress(model, bases):
            pass
    # the stock model's forward with cache= (no subspace cache made): the same refusal by name
    import torch

    from subspace_ref.hf import teacher_forced
    from subspace_ref.lab.baselines._attention import token_logprobs

    ids = torch.zeros(1, 4, dtype=torch.long)
    for name, run in (("teacher_forced", lambda: teacher_forced(model, ids)), ("token_logprobs", lambda: token_logprobs(model, ids))):
        with pytest.raises(ImportError, match=rf"^{name} needs transformers >= {re.escape(MIN_TRANSFORMERS)}"):
            run()
    assert model.config._attn_implementation == before and built == []


def test_the_minimum_is_the_models_extras():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["models"]
    assert [s for s in extra if s.startswith("transformers")] == [f"transformers>={MIN_TRANSFORMERS},<6"]


def test_reading_the_minimum_imports_neither_torch_nor_transformers():
    code = "import sys, subspace_ref.hf_requirements; assert not {'torch', 'transformers'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
