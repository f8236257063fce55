"""The plugin's hooks into vLLM (imported by :func:`subspace_ref.vllm.register`, in every vLLM
process: the front end, the engine core, each worker, each Ray node).

* ``register_backend("SUBSPACE_CPU_ATTN", ...)`` names the backend in vLLM's registry.
* The platform's ``check_and_update_config`` runs the plugin's checks after vLLM's own, in the
  process that builds the config, so a configuration the paged cache cannot hold fails
  ``LLM(...)`` / ``vllm serve`` at start-up with a :class:`SubspaceConfigError` naming it.
* The platform's ``get_attn_backend_cls`` returns the subspace backend for the model's
  attention layers when bases are configured (on CPU vLLM always picks CPU_ATTN otherwise);
  without bases it is vLLM's own function, untouched.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from subspace_ref.vllm.config import (
    PAD_KEY,
    Plan,
    SubspaceConfigError,
    bases_directory,
    check_tensor_parallel,
    make_plan,
    options,
    read_bases,
)

NAME = "SUBSPACE_CPU_ATTN"
PATH = "subspace_ref.vllm.backend.SubspaceCPUAttentionBackend"

logger = logging.getLogger("vllm.plugins.subspace_ref")  # under vLLM's logger, so its handlers print it
_installed = False
#: Plans already built in this process, by what they depend on (every process builds its own).
_plans: dict[tuple, Plan | None] = {}
#: The plan of the model this process serves (a worker serves one model).
_current: Plan | None = None


def install() -> None:
    """Register the backend and wrap the platform's two hooks; idempotent.

    :func:`subspace_ref.vllm.register` calls it (example there).

    Returns
    -------
    None
    """
    global _installed
    if _installed:
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if NAME not in AttentionBackendEnum.__members__:
        register_backend(NAME, PATH)
    platform_cls = type(current_platform)
    check = platform_cls.check_and_update_config
    select = platform_cls.get_attn_backend_cls

    def check_and_update_config(cls, vllm_config) -> None:
        check(vllm_config)
        plan = plan_for(vllm_config)
        if plan is not None:
            logger.info("%s", plan.summary())
        # vLLM caches backend selections per process; one that builds engines one after another (in-process engines) must not reuse another's
        from vllm.v1.attention.selector import _cached_get_attn_backend

        _cached_get_attn_backend.cache_clear()

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None, **kwargs: Any) -> str:
        plan = current_plan()
        if plan is None:
            return select(selected_backend, attn_selector_config, num_heads, **kwargs)
        refuse_layer(attn_selector_config)
        return PATH

    platform_cls.check_and_update_config = classmethod(check_and_update_config)
    platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    _installed = True


def refuse_layer(sel) -> None:
    """Attention layers of a kind the subspace backend does not serve (each named)."""
    reasons = []
    if sel.use_mla or sel.use_sparse:
        reasons.append("MLA / sparse attention (no per-head K/V to project)")
    if str(getattr(sel.attn_type, "value", sel.attn_type)) != "decoder":
        reasons.append(f"attention type {sel.attn_type!r} (decoder self-attention only)")
    if sel.has_sink:
        reasons.append("the model's attention sinks (s_aux; the library refuses them too)")
    if sel.has_sliding_window:
        reasons.append("sliding-window layers (not built: the CPU kernel's window over coefficients is untested against the library)")
    if sel.kv_cache_dtype not in (None, "auto"):
        reasons.append(f"kv_cache_dtype={sel.kv_cache_dtype!r} (low-bit coefficients)")
    if reasons:
        raise SubspaceConfigError("bases are configured but a layer needs " + "; ".join(reasons))


def plan_for(vllm_config) -> Plan | None:
    """The :class:`Plan` this config serves with, None for stock vLLM; refusals raise.

    Built once per process for each (bases, model, additional_config, TP degree, cache dtype).

    Parameters
    ----------
    vllm_config : vllm.config.VllmConfig
        The engine's config.

    Returns
    -------
    Plan or None
        None when no bases are configured.

    Raises
    ------
    SubspaceConfigError
        For anything the plugin cannot serve (docs/vllm.md).

    Examples
    --------
    In the vLLM venv, with ``bases/`` written by ``CalibratedBases.save_pretrained``::

        from vllm.engine.arg_utils import EngineArgs
        from subspace_ref.vllm.plugin import plan_for

        config = EngineArgs(model="subspace_ref/data/stdlib_llama", skip_tokenizer_init=True, dtype="float32",
                            additional_config={"subspace_bases": "bases/"}).create_engine_config()
        plan_for(config).summary()       # 'subspace bases bases: key/value ranks per layer 16/16, ...'
    """
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return None
    extra = vllm_config.additional_config
    directory = bases_directory(extra, model_config.model)
    if directory is None:
        return None
    parallel = vllm_config.parallel_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    key = (str(directory.resolve()), model_config.model, json.dumps(extra, sort_keys=True, default=str), parallel.tensor_parallel_size, str(cache_dtype))
    if key not in _plans:
        _plans[key] = _build(vllm_config, directory, options(extra))
    return _plans[key]


def _build(vllm_config, directory, opts: dict) -> Plan:
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    if not current_platform.is_cpu():
        raise SubspaceConfigError(
            f"bases are configured ({directory}) but this is vLLM's {current_platform.device_name} platform: the plugin's backend is built "
            "on the CPU paged kernel only (docs/vllm.md says what a GPU backend would use)"
        )
    if model_config.use_mla:
        raise SubspaceConfigError("the model uses MLA (latent KV): the bases project per-head keys and values")
    window = model_config.get_sliding_window()
    layer_types = getattr(model_config.hf_text_config, "layer_types", None) or ()
    if window is not None or any(t != "full_attention" for t in layer_types):
        raise SubspaceConfigError(f"the model has sliding-window layers (sliding_window={window}): not built for the paged cache (windows/sinks)")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, name, 1) > 1:
            raise SubspaceConfigError(f"{name}={getattr(parallel, name)}: context parallelism is not supported with bases")
    if vllm_config.speculative_config is not None:
        raise SubspaceConfigError("speculative decoding: the draft model's layers would be served with the target's bases")
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    text = model_config.hf_text_config
    check_tensor_parallel(int(text.num_attention_heads), model_config.get_total_num_kv_heads(), parallel.tensor_parallel_size)
    bases = read_bases(directory, checkpoint_config(model_config))
    head_size = model_config.get_head_size()
    return make_plan(
        bases,
        directory=str(directory),
        num_layers=model_config.get_total_num_hidden_layers(),
        num_heads=int(text.num_attention_heads),
        num_kv_heads=model_config.get_total_num_kv_heads(),
        head_size=head_size,
        head_size_v=int(getattr(text, "v_head_dim", None) or head_size),
        supported_widths=CPUAttentionBackend.get_supported_head_sizes(),
        pad=bool(opts.get(PAD_KEY, False)),
        tp_size=parallel.tensor_parallel_size,
        kv_cache_dtype=vllm_config.cache_config.cache_dtype,
    )


def checkpoint_config(model_config):
    """The checkpoint's config as transformers reads it, which is what calibration hashed
    (vLLM's own copy gains fields, e.g. ``architectures`` when config.json has none)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_config.model, revision=model_config.revision, trust_remote_code=model_config.trust_remote_code)
    except (OSError, ValueError) as e:
        logger.warning("subspace_ref.vllm: transformers cannot read %s's config (%s); hashing vLLM's copy", model_config.model, e)
        return model_config.hf_config


def current_plan() -> Plan | None:
    """The plan of the config vLLM is building the model under (None outside one, or without
    bases); remembered for the hooks vLLM calls later without a current config."""
    global _current
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    if cfg is None or getattr(cfg, "model_config", None) is None:
        return _current
    _current = plan_for(cfg)
    return _current


def describe_attention(model) -> list[dict]:
    """Per attention layer of a loaded model: its name, backend, implementation class and KV
    cache shape (for ``LLM.apply_model``: which attention a worker really runs).

    Parameters
    ----------
    model : torch.nn.Module
        A worker's model (``LLM.apply_model`` passes it).

    Returns
    -------
    list of dict
        ``layer``, ``backend``, ``impl`` and ``cache_shape`` (None before the cache exists).

    Examples
    --------
    In the vLLM venv (``LLM.apply_model`` needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``; a
    small machine, ``VLLM_CPU_KVCACHE_SPACE=1``)::

        from vllm import LLM
        from subspace_ref.vllm.plugin import describe_attention

        if __name__ == "__main__":
            llm = LLM(model="subspace_ref/data/stdlib_llama", skip_tokenizer_init=True, dtype="float32",
                      max_model_len=1024, enforce_eager=True, additional_config={"subspace_bases": "bases/"})
            print(llm.apply_model(describe_attention)[0][0]["backend"])   # SUBSPACE_CPU_ATTN
    """
    import torch
    from vllm.model_executor.layers.attention import Attention

    out = []
    for module in model.modules():
        if isinstance(module, Attention):
            cache = module.kv_cache[0] if isinstance(module.kv_cache, (list, tuple)) and module.kv_cache else module.kv_cache
            shape = tuple(cache.shape) if isinstance(cache, torch.Tensor) else None
            out.append(dict(layer=module.layer_name, backend=module.attn_backend.get_name(), impl=type(module.impl).__name__, cache_shape=shape))
    return out


__all__ = ["NAME", "PATH", "current_plan", "describe_attention", "install", "plan_for"]
