"""What the paged cache cannot hold is refused at start-up, naming what is wrong (docs/vllm.md):
one test per configuration. The checks run while vLLM builds its config, in the process that
calls ``LLM(...)``, so these tests build configs only (no engine starts) and one shows the
same refusal from ``LLM(...)`` itself."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("vllm.v1", reason="vLLM is not installed in this venv (its tests run in their own: .ci/vllm)")

from _vllm_support import config_only, engine_config, model_copy, random_bases  # noqa: E402

from subspace_ref.vllm import plugin  # noqa: E402


def bases(path) -> dict:
    return {"subspace_bases": str(path)}


def refused(model, match: str, **kwargs) -> str:
    with pytest.raises(ValueError, match=match) as info:
        engine_config(model, **kwargs)
    assert "subspace_ref.vllm" in str(info.value) or "tensor parallel" in str(info.value)
    return str(info.value)


@pytest.fixture(scope="module")
def r32(shipped_bases):
    return shipped_bases[32]


def edited(src, dest, **meta):
    """A copy of the bases directory ``src`` with its JSON's fields replaced."""
    shutil.copytree(src, dest)
    path = dest / "subspace_bases.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | meta))
    return dest


# --- state options of the library that vLLM's paged cache cannot hold yet


def test_pre_rope_option_is_refused(shipped_model, r32):
    refused(shipped_model, "pre-RoPE", additional_config=bases(r32) | {"subspace_rope": True})


def test_pre_rope_artifact_is_refused(shipped_model, r32, tmp_path):
    meta = json.loads((r32 / "subspace_bases.json").read_text())
    src = edited(r32, tmp_path / "b", calibration=meta["calibration"] | {"pre_rope": True})
    refused(shipped_model, "calibrated on pre-RoPE keys", additional_config=bases(src))


@pytest.fixture(scope="module")
def allocated(r32, tmp_path_factory):
    from _vllm_support import with_allocation

    return with_allocation(r32, tmp_path_factory.mktemp("allocated") / "bases")


def allocation_edit(src, dest, window=0, sinks=0, **head):
    """A copy of an allocation artifact whose layer 1 head 1 gets ``head``'s fields."""
    meta = json.loads((src / "subspace_bases.json").read_text())
    alloc = meta["allocation"] | dict(window=window, sinks=sinks)
    alloc["heads"][1][1] = alloc["heads"][1][1] | head
    return edited(src, dest, allocation=alloc)


@pytest.mark.parametrize(
    "edit,match",
    [
        (dict(key_basis="pre_rope"), "layer 1 head 1 has a pre-RoPE key basis"),
        (dict(bits_k=4, bits_v=4), "layer 1 head 1 stores 4/4-bit key/value coefficients"),
        (dict(bits_k=16, bits_v=8), "layer 1 head 1 stores 16/8-bit"),
        (dict(window=32), "exact window of 32 tokens"),
        (dict(sinks=4), "and 4 sinks"),
        (dict(key_basis="identity", rank_k=64), r"keeps keys \(identity\) or values \(subspace\) at their full size"),
    ],
    ids=["pre-rope", "int4", "int8-values", "window", "sinks", "identity-keys"],
)
def test_allocations_the_cache_cannot_hold_are_refused(shipped_model, allocated, tmp_path, edit, match):
    refused(shipped_model, match, additional_config=bases(allocation_edit(allocated, tmp_path / "b", **edit)))


def test_int8_coefficients_are_refused(shipped_model, r32, tmp_path):
    refused(shipped_model, "coefficient_bits=8", additional_config=bases(edited(r32, tmp_path / "b", coefficient_bits=8)))


def test_int4_coefficients_option_is_refused(shipped_model, r32):
    refused(shipped_model, "subspace_coefficients='int4'.*low-bit", additional_config=bases(r32) | {"subspace_coefficients": "int4"})


def test_fp8_cache_is_refused(shipped_model, r32):
    refused(shipped_model, "kv_cache_dtype='fp8'", additional_config=bases(r32), kv_cache_dtype="fp8")


def test_exact_window_is_refused(shipped_model, r32):
    refused(shipped_model, "subspace_window=64.*exact window", additional_config=bases(r32) | {"subspace_window": 64})


def test_sinks_are_refused(shipped_model, r32):
    refused(shipped_model, "subspace_sinks=4.*sinks", additional_config=bases(r32) | {"subspace_sinks": 4})


def test_adaptive_state_is_refused(shipped_model, r32):
    refused(shipped_model, "subspace_state='adaptive'.*adaptive and rotating", additional_config=bases(r32) | {"subspace_state": "adaptive"})


def test_rotating_artifact_is_refused(shipped_model, r32, tmp_path):
    refused(shipped_model, "kind 'rotating'", additional_config=bases(edited(r32, tmp_path / "b", kind="rotating")))


def test_different_key_and_value_ranks_are_refused_on_cpu_unless_padded(shipped_model, tmp_path):
    src = random_bases(shipped_model, tmp_path / "b", 32, 16)
    message = refused(shipped_model, "key/value ranks differ", additional_config=bases(src))
    assert "layer 0: 32/16" in message and "subspace_pad" in message
    plan = plugin.plan_for(engine_config(shipped_model, additional_config=bases(src) | {"subspace_pad": True}))
    assert (plan.rank, plan.width, plan.pack, plan.capacity_ratio) == (32, 32, 1, 2.0)


def test_energy_ranks_of_the_calibrate_cli_are_refused_unless_padded(shipped_model):
    from _vllm_support import bases_dir

    refused(shipped_model, "key/value ranks differ.*subspace_pad=true to zero-pad all to", additional_config=bases(bases_dir("shipped_energy")))


def test_the_calibrate_cli_default_allocator_artifact_is_refused(shipped_model):
    """`subspace-kv calibrate` (rule allocator) mixes int8/int4, pre-RoPE and identity heads."""
    from _vllm_support import bases_dir

    refused(shipped_model, "layer 0 head 0 stores 8/4-bit key/value coefficients", additional_config=bases(bases_dir("shipped_allocator")))


def test_an_uncompressed_layer_is_refused_unless_padded(shipped_model, tmp_path):
    src = random_bases(shipped_model, tmp_path / "b", 32, 32, none_layers=(2,))
    refused(shipped_model, "layer 2 has no bases", additional_config=bases(src))
    plan = plugin.plan_for(engine_config(shipped_model, additional_config=bases(src) | {"subspace_pad": True}))
    assert (plan.rank, plan.width, plan.capacity_ratio) == (64, 64, 1.0)


def test_a_rank_no_kernel_head_size_holds_is_refused(shipped_model, tmp_path):
    # a head of 768: rank 600 is above the CPU kernel's largest head size, 512
    model = config_only(tmp_path / "m", shipped_model, head_dim=768, num_hidden_layers=1, hidden_size=256)
    refused(model, "rank 600 exceeds every head size", additional_config=bases(random_bases(model, tmp_path / "b", 600, 600)))


def test_unknown_key_is_refused(shipped_model, r32):
    refused(shipped_model, "unknown additional_config key 'subspace_base'", additional_config={"subspace_base": str(r32)})


# --- bad input


def test_bases_for_another_model_are_refused(shipped_model, r32, tmp_path):
    model = config_only(tmp_path / "m", shipped_model, num_hidden_layers=2)
    message = refused(model, "bases for another model", additional_config=bases(r32))
    assert "calibrated for config hash" in message and "the served model has" in message


def test_a_missing_directory_is_refused(shipped_model, tmp_path):
    refused(shipped_model, "no such directory", additional_config=bases(tmp_path / "nowhere"))


def test_a_directory_without_bases_is_refused(shipped_model, tmp_path):
    refused(shipped_model, "holds no subspace_bases.json", additional_config=bases(tmp_path))


def test_a_corrupt_directory_is_refused(shipped_model, r32, tmp_path):
    src = shutil.copytree(r32, tmp_path / "b")
    tensors = src / "subspace_bases.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:1000])
    refused(shipped_model, "is corrupt", additional_config=bases(src))


def test_corrupt_json_is_refused(shipped_model, r32, tmp_path):
    src = shutil.copytree(r32, tmp_path / "b")
    (src / "subspace_bases.json").write_text("{ not json")
    refused(shipped_model, "not readable JSON", additional_config=bases(src))


def test_tp_not_dividing_the_kv_heads_is_refused(shipped_model, tmp_path):
    # 12 query heads split over 4 ranks, but 6 KV heads neither split over 4 nor replicate evenly
    model = config_only(tmp_path / "m", shipped_model, num_attention_heads=12, num_key_value_heads=6, hidden_size=768)
    refused(model, "tensor_parallel_size 4 does not divide the model's 6 KV heads", additional_config=bases(random_bases(model, tmp_path / "b", 32, 32)), tensor_parallel_size=4)


def test_tp_not_dividing_the_query_heads_is_refused(shipped_model, r32):
    # vLLM's own check comes first and names the heads
    refused(shipped_model, r"attention heads \(4\) must be divisible by tensor parallel size \(3\)", additional_config=bases(r32), tensor_parallel_size=3)


def test_a_sliding_window_model_is_refused(shipped_model, tmp_path):
    model = config_only(tmp_path / "m", shipped_model, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=16)
    refused(model, "sliding-window layers", additional_config=bases(random_bases(model, tmp_path / "b", 32, 32)))


def test_a_gpu_platform_is_refused(shipped_model, r32, monkeypatch):
    from vllm.platforms import current_platform

    config = engine_config(shipped_model)
    config.additional_config = bases(r32)
    monkeypatch.setattr(plugin, "_plans", {})
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    with pytest.raises(ValueError, match="built on the CPU paged kernel only"):
        plugin.plan_for(config)


def test_the_refusal_comes_from_llm_itself(shipped_model, tmp_path):
    from vllm import LLM

    with pytest.raises(ValueError, match="subspace_ref.vllm: subspace_bases: no such directory"):
        LLM(model=shipped_model, skip_tokenizer_init=True, additional_config=bases(tmp_path / "nowhere"))


# --- accepted configurations


def test_no_bases_leaves_the_attention_selection_alone(shipped_model):
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import AttentionSelectorConfig

    config = engine_config(shipped_model)
    assert plugin.plan_for(config) is None
    with set_current_vllm_config(config):
        path = current_platform.get_attn_backend_cls(None, AttentionSelectorConfig(64, config.model_config.dtype, "auto", None))
    assert path == "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"


def test_the_default_place_and_turning_it_off(shipped_model, r32, tmp_path):
    model = model_copy(shipped_model, tmp_path / "m", r32)
    plan = plugin.plan_for(engine_config(model))
    assert plan is not None and plan.directory == str(model / "subspace_bases")
    assert plugin.plan_for(engine_config(model, additional_config={"subspace_bases": None})) is None
