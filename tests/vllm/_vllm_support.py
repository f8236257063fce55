"""Helpers of the vLLM plugin tests and of make_reference.py: prompts, the stored fixture,
engine start-up and shut-down, greedy decoding, capacity, config-only and random-init
checkpoints built with NumPy alone (the same bytes in both venvs), random bases."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parent / "data"
REFERENCE = DATA / "reference.json"

#: Byte prompts of the greedy comparisons (the shipped model's tokens are bytes).
PROMPTS = [
    b"def main():\n    ",
    b"import os\nimport sys\n\n",
    b"class Foo(object):\n    def __init__(self",
    b"    return self._",
    b"for i in range(len(",
    b'"""Return the',
    b"    if not isinstance(value, ",
    b"        raise ValueError(",
]
NEW_TOKENS = 64
#: The shipped model's ranks under test (r_k = r_v), and the bases directory of each in data/.
RANKS = (32, 16)
#: The random-init model whose one KV head TP = 2 replicates (built by :func:`numpy_llama`).
REPLICATED = dict(heads=4, kv_heads=1, head_dim=64, layers=2, seed=0)


def bases_dir(name: str) -> Path:
    return DATA / name


def with_allocation(src: Path, dest: Path) -> Path:
    """A copy of the bases directory ``src`` carrying an allocation (``Allocation.to_dict()``'s
    format) that gives every head what the bases hold: float coefficients, post-RoPE keys,
    subspace values, its ranks; no window or sinks. ``compress`` then builds ``allocated_states``."""
    shutil.copytree(src, dest)
    path = dest / "subspace_bases.json"
    meta = json.loads(path.read_text())
    head = dict(bits_k=16, bits_v=16, key_basis="post_rope", value_basis="subspace")
    heads = [[head | dict(rank_k=k, rank_v=v) for k, v in zip(layer["rank_k"], layer["rank_v"])] for layer in meta["layers"]]
    meta["allocation"] = dict(version=1, heads=heads, group=32, budget_bytes_per_token=0.0, window=0, sinks=0, calibration_loss=float("nan"), meta={})
    path.write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return dest


def engine_kwargs(**overrides):
    """LLM(...) arguments for the byte-level models: no tokenizer, float32, eager."""
    return dict(skip_tokenizer_init=True, dtype="float32", max_model_len=1024, enforce_eager=True) | overrides


def greedy(llm, prompts=PROMPTS, new_tokens=NEW_TOKENS) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def capacity(llm) -> int:
    """Tokens vLLM's KV cache holds (what it logs as the CPU KV cache size)."""
    cache = llm.llm_engine.vllm_config.cache_config
    return cache.num_gpu_blocks * cache.block_size


def attention_layers(llm) -> list[dict]:
    from subspace_ref.vllm.plugin import describe_attention

    return [row for per_worker in llm.apply_model(describe_attention) for row in per_worker]


def thread_binding(workers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for ``workers`` CPU workers on one NUMA node (vLLM's automatic
    binding wants a node per worker and refuses otherwise): a share of the allowed cores each,
    round robin when there are fewer cores than workers."""
    cpus = sorted(os.sched_getaffinity(0))
    share = max(1, len(cpus) // workers)
    lists = [cpus[i * share : (i + 1) * share] if len(cpus) >= workers else [cpus[i % len(cpus)]] for i in range(workers)]
    return "|".join(",".join(map(str, cores)) for cores in lists)


@contextlib.contextmanager
def environment(values: dict):
    """``values`` in os.environ for the block, vLLM's cache of its variables dropped first
    (an in-process engine caches them when it starts)."""
    import vllm.envs

    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    vllm.envs.disable_envs_cache()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def running(model, *, multiprocessing: bool = False, **kwargs):
    """An LLM for the block, shut down after it (each holds a KV cache, and workers beyond one).

    ``multiprocessing=False`` runs vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0):
    a start-up of seconds instead of tens of seconds on two cores; True is vLLM's default, the
    engine core in a process of its own. Tensor parallel workers are processes either way."""
    from vllm import LLM

    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0"}
    workers = kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1)
    if workers > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = thread_binding(workers)
    with environment(env):
        llm = LLM(model=str(model), **engine_kwargs(**kwargs))
    try:
        yield llm
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def engine_config(model, **kwargs):
    """The VllmConfig ``LLM(model, **kwargs)`` would start with: vLLM's checks and the plugin's
    run here, and no engine starts."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), **engine_kwargs(**kwargs)).create_engine_config()


def config_only(dest: Path, base_config: str, **overrides) -> Path:
    """A checkpoint directory holding only config.json (``base_config``'s with ``overrides``):
    enough for vLLM's and the plugin's start-up checks."""
    dest.mkdir(parents=True, exist_ok=True)
    config = json.loads(Path(base_config, "config.json").read_text()) | overrides
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def model_copy(model_dir: str, dest: Path, bases=None) -> Path:
    """A checkpoint directory linking ``model_dir``'s files, with the bases directory ``bases``
    copied to its default place ``subspace_bases/`` when given."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(model_dir):
        if name.endswith((".json", ".safetensors")):
            os.symlink(os.path.join(model_dir, name), dest / name)
    if bases is not None:
        shutil.copytree(bases, dest / "subspace_bases")
    return dest


def numpy_llama(dest: Path, *, heads: int, kv_heads: int, head_dim: int = 64, layers: int = 2, seed: int = 0, init: float = 0.2, context: int = 1024) -> Path:
    """A random-init byte-level Llama checkpoint (vocabulary 256, no BOS/EOS), weights drawn
    by NumPy with ``seed`` (the same bytes in any venv) at standard deviation ``init`` (large
    enough that greedy choices are not near-ties), written as config.json + model.safetensors."""
    from safetensors.numpy import save_file

    hidden = heads * head_dim
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        attention_bias=False,
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        dtype="float32",
        head_dim=head_dim,
        hidden_act="silu",
        hidden_size=hidden,
        initializer_range=init,
        intermediate_size=2 * hidden,
        max_position_embeddings=context,
        mlp_bias=False,
        num_attention_heads=heads,
        num_hidden_layers=layers,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        rope_parameters=dict(rope_theta=10000.0, rope_type="default"),
        tie_word_embeddings=False,
        use_cache=True,
        vocab_size=256,
    )
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return (init * rng.standard_normal(shape)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(256, hidden), "lm_head.weight": normal(256, hidden), "model.norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": normal(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": normal(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": normal(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": normal(2 * hidden, hidden),
            p + "mlp.up_proj.weight": normal(2 * hidden, hidden),
            p + "mlp.down_proj.weight": normal(hidden, 2 * hidden),
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
        }
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def random_bases(model_dir, out: Path, rank_k: int, rank_v: int, *, seed: int = 0, none_layers=(), **artifact) -> Path:
    """Random orthonormal static bases for ``model_dir``'s config (its hash), saved to ``out``;
    ``none_layers`` are left uncompressed, ``artifact`` goes to CalibratedBases."""
    from transformers import AutoConfig

    from subspace_ref import StaticBasis
    from subspace_ref.hf import CalibratedBases

    config = AutoConfig.from_pretrained(model_dir)
    rng = np.random.default_rng(seed)
    H, d = config.num_key_value_heads, config.head_dim

    def orthonormal(r):
        return np.swapaxes(np.linalg.qr(rng.standard_normal((H, d, r)))[0], -1, -2)

    layers = [None if i in none_layers else StaticBasis.from_bases(orthonormal(rank_k), orthonormal(rank_v), 1.0) for i in range(config.num_hidden_layers)]
    CalibratedBases.for_model(config, layers, **artifact).save_pretrained(out)
    return out
