"""The plugin's plan without an engine: which KV heads a tensor-parallel rank holds (as vLLM's
QKVParallelLinear shards them), the cache geometry (packing, kernel head size), padding and the
decoded bases, against the library's own state."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm.v1", reason="vLLM is not installed in this venv (its tests run in their own: .ci/vllm)")

from _vllm_support import random_bases  # noqa: E402

from subspace_ref.vllm.config import SubspaceConfigError, cache_geometry, kernel_width, local_kv_heads, make_plan, options  # noqa: E402

CPU_SIZES = [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]


def test_cpu_kernel_sizes_are_the_ones_assumed_here():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert CPUAttentionBackend.get_supported_head_sizes() == CPU_SIZES


@pytest.mark.parametrize("kv_heads,tp", [(2, 1), (2, 2), (2, 4), (8, 2), (8, 4), (8, 8), (1, 2), (4, 8), (6, 3)])
def test_local_kv_heads_follow_vllm_sharding(kv_heads, tp):
    # vLLM's QKVParallelLinear: kv heads per rank = max(1, total / tp), shard = rank // replicas
    replicas = max(1, tp // kv_heads)
    per_rank = max(1, kv_heads // tp)
    for rank in range(tp):
        shard = rank // replicas
        assert local_kv_heads(rank, tp, kv_heads) == range(shard * per_rank, (shard + 1) * per_rank)


@pytest.mark.parametrize("kv_heads,tp", [(6, 4), (4, 3), (3, 2)])
def test_uneven_sharding_is_refused(kv_heads, tp):
    with pytest.raises(SubspaceConfigError, match=f"tensor_parallel_size {tp} does not divide the model's {kv_heads} KV heads"):
        local_kv_heads(0, tp, kv_heads)


@pytest.mark.parametrize(
    "rank,heads,expected",
    [
        (32, 2, (1, 32)),  # fits a kernel size: no packing
        (16, 2, (2, 32)),  # below the smallest size: two heads share one
        (16, 1, (1, 32)),  # one head on the rank: padded, nothing to pack with
        (8, 8, (4, 32)),
        (40, 2, (2, 80)),  # 80 holds two heads of 40 exactly, 64 holds one with 24 wasted
        (24, 2, (1, 32)),  # 32 per head either way: the least packing
        (64, 2, (1, 64)),
        (512, 1, (1, 512)),
    ],
)
def test_cache_geometry(rank, heads, expected):
    assert cache_geometry(rank, heads, CPU_SIZES) == expected


def test_ranks_above_the_kernel_are_refused():
    with pytest.raises(SubspaceConfigError, match="rank 513 exceeds every head size"):
        kernel_width(513, CPU_SIZES)


def test_options_accept_the_off_values():
    off = {"subspace_rope": None, "subspace_coefficients": "float", "subspace_window": 0, "subspace_sinks": 0, "subspace_state": "static", "subspace_pad": False}
    assert options(off | {"other_plugin_key": 1}) == off


def test_pad_must_be_a_boolean():
    with pytest.raises(SubspaceConfigError, match="subspace_pad must be true or false"):
        options({"subspace_pad": "yes"})


@pytest.mark.parametrize("fmt", ["native", "float16", "float8_e4m3", "int8"])
def test_plan_bases_are_what_the_library_state_attends_with(shipped_model, tmp_path, fmt):
    """Padded with zero rows, decoded from the artifact's basis format exactly as SubspaceState.static stores them."""
    from subspace_ref import SubspaceState
    from subspace_ref.hf import CalibratedBases

    src = random_bases(shipped_model, tmp_path / "b", 24, 24, basis_format=fmt)
    bases = CalibratedBases.from_pretrained(src)
    plan = make_plan(bases, directory=str(src), num_layers=4, num_heads=4, num_kv_heads=2, head_size=64, head_size_v=64, supported_widths=CPU_SIZES)
    assert (plan.rank, plan.width, plan.pack) == (24, 32, 1)
    for layer, basis in zip(plan.layers, bases.layers):
        state = SubspaceState.static(basis, dtype=np.float32, bases=fmt)
        lay = state.layout
        for h in range(2):
            np.testing.assert_array_equal(layer.B[h], lay.basis("key", (0, h, 0), np.float32))
            np.testing.assert_array_equal(layer.E[h], lay.basis("value", (0, h, 0), np.float32))
        np.testing.assert_array_equal(layer.gamma, lay.gamma)
