"""The plugin end to end on the shipped model (docs/vllm.md): greedy output equal to the
library's transformers path at two ranks (tokens stored by make_reference.py), the KV capacity vLLM reports against stock, bases
found in their default place, and stock vLLM untouched without bases. Three engines, started
once for the module."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm.v1", reason="vLLM is not installed in this venv (its tests run in their own: .ci/vllm)")

from _vllm_support import attention_layers, bases_dir, capacity, greedy, model_copy, running, with_allocation  # noqa: E402

HEAD = 64  # the shipped model's head size


@pytest.fixture(scope="module")
def stock(shipped_model):
    with running(shipped_model) as llm:
        yield llm


@pytest.fixture(scope="module")
def rank32(shipped_model, shipped_bases):
    with running(shipped_model, additional_config={"subspace_bases": str(shipped_bases[32])}) as llm:
        yield llm


@pytest.fixture(scope="module")
def rank16_default_place(shipped_model, shipped_bases, tmp_path_factory):
    """The r = 16 bases found in ``<model>/subspace_bases`` with no additional_config."""
    model = model_copy(shipped_model, tmp_path_factory.mktemp("model") / "stdlib_llama", shipped_bases[16])
    with running(model) as llm:
        yield llm


def test_without_bases_vllm_is_untouched(stock, expected):
    layers = attention_layers(stock)
    assert {(row["backend"], row["impl"]) for row in layers} == {("CPU_ATTN", "CPUAttentionBackendImpl")}
    assert {row["cache_shape"][1:] for row in layers} == {(2, 128, 2 * HEAD)}  # (blocks, KV heads, block size, k | v)
    assert greedy(stock) == expected["shipped/stock"]


def test_rank32_greedy_equals_the_transformers_path(rank32, expected):
    layers = attention_layers(rank32)
    assert {(row["backend"], row["impl"]) for row in layers} == {("SUBSPACE_CPU_ATTN", "SubspaceCPUAttentionImpl")}
    assert {row["cache_shape"][1:] for row in layers} == {(2, 128, 2 * 32)}
    assert greedy(rank32) == expected["shipped/r32"]


def test_rank16_from_the_default_place_greedy_equals_the_transformers_path(rank16_default_place, expected):
    layers = attention_layers(rank16_default_place)
    # two KV heads of r = 16 share one cache head of 32, the kernel's smallest head size
    assert {row["cache_shape"][1:] for row in layers} == {(1, 128, 2 * 32)}
    assert greedy(rank16_default_place) == expected["shipped/r16"]


def test_an_allocation_of_float_post_rope_heads_equals_the_allocated_path(shipped_model, expected, tmp_path):
    """An artifact carrying a per-head Allocation: the library builds allocated_states for it."""
    allocated = with_allocation(bases_dir("shipped_r32"), tmp_path / "bases")
    with running(shipped_model, additional_config={"subspace_bases": str(allocated)}) as llm:
        assert greedy(llm) == expected["shipped/r32-allocation"]


def test_energy_ranks_from_the_calibrate_cli_padded_equal_the_transformers_path(shipped_model, expected):
    """`subspace-kv calibrate --compression-ratio 0.25` bases: ranks differ per head, layer and side; subspace_pad serves them exactly."""
    extra = {"subspace_bases": str(bases_dir("shipped_energy")), "subspace_pad": True}
    with running(shipped_model, additional_config=extra) as llm:
        assert greedy(llm) == expected["shipped/energy"]


def test_kv_capacity_against_stock(stock, rank32, rank16_default_place):
    tokens = {"stock": capacity(stock), "r=32": capacity(rank32), "r=16": capacity(rank16_default_place)}
    print(f"\nKV capacity per GiB of VLLM_CPU_KVCACHE_SPACE (tokens): {tokens}")
    space = int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30
    assert tokens["stock"] == space // (4 * 2 * (HEAD + HEAD) * 4)  # 4 layers x 2 KV heads x (64 + 64) float32
    assert tokens["r=32"] >= HEAD / 32 * tokens["stock"]
    assert tokens["r=16"] >= HEAD / 16 * tokens["stock"]
