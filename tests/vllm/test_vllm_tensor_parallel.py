"""Tensor parallelism with bases (docs/vllm.md): each rank keeps the bases of the KV heads vLLM
gives it. TP = 2 on the shipped model splits its two KV heads; TP = 2 on a random-init model
with one KV head replicates it on both ranks. Both equal the library's transformers path, which
the TP = 1 engines of test_vllm_serving.py equal too."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1", reason="vLLM is not installed in this venv (its tests run in their own: .ci/vllm)")

from _vllm_support import REPLICATED, attention_layers, bases_dir, greedy, numpy_llama, running  # noqa: E402


def test_tp2_splits_kv_heads_and_equals_tp1(shipped_model, shipped_bases, expected):
    with running(shipped_model, additional_config={"subspace_bases": str(shipped_bases[16])}, tensor_parallel_size=2) as llm:
        layers = attention_layers(llm)
        out = greedy(llm)
    assert len(layers) == 2 * 4 and {row["impl"] for row in layers} == {"SubspaceCPUAttentionImpl"}
    # one KV head per rank: nothing to pack, r = 16 padded to the kernel's 32
    assert {row["cache_shape"][1:] for row in layers} == {(1, 128, 2 * 32)}
    assert out == expected["shipped/r16"]


def test_tp2_replicated_kv_head_equals_the_transformers_path(tmp_path, expected):
    model = numpy_llama(tmp_path / "model", **REPLICATED)
    # vLLM's default process layout here (engine core in a process of its own): the plugin loads through its entry point in every process
    with running(model, multiprocessing=True, additional_config={"subspace_bases": str(bases_dir("replicated_r32"))}, tensor_parallel_size=2) as llm:
        layers = attention_layers(llm)
        out = greedy(llm)
    assert {row["cache_shape"][1:] for row in layers} == {(1, 128, 2 * 32)}
    assert out == expected["replicated/r32"]
