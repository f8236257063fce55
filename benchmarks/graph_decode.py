"""transformers ``generate`` decode speed through a captured graph (issue 38 item 5; docs/hf.md,
"Graph-captured decode"): tokens/s of the :class:`~subspace_ref.hf.GraphSubspaceCache` as
``generate`` compiles it, against ``DynamicCache`` + SDPA (eager, the stock path) and
transformers' own ``StaticCache`` compiled the same way, measured in the same run.

Model: a random-init Llama with head size 128 (``--hidden``, ``--heads`` query heads over
``--kv-heads``, ``--layers``), in bfloat16 on CUDA and float32 on the CPU. Bases: random
orthonormal, r = r_v = ``--rank`` (speed does not depend on which subspace), with float, int8
and int4 coefficients, post-RoPE or pre-RoPE (``--coefficients``, ``pre-rope-`` prefixed; quantised
and pre-RoPE ones decode through the Triton kernel operator where it runs, spec/models.md M11.6
and M11.10, and by SDPA over the read-back capacity on the CPU), and ``BEST``, pre-RoPE int4 with
4 sinks and 32 exact recent tokens (M11.14). Each row prefills
a random prompt of T tokens, then decodes ``--steps`` greedy tokens; a logits processor stamps
the time of every step (after a device synchronisation), and the row reports the median step.
Compiled rows run ``generate`` once untimed first (the compile and the graph capture), on the
same cache after ``reset()`` (fixed addresses, so the captured graph is replayed).

On CUDA ``generate`` compiles the graph cache by default (``mode="reduce-overhead"``: CUDA
graphs). On the CPU the compiled rows use ``CompileConfig._compile_all_devices`` (inductor, no
graphs), so CPU figures time the same code path without capture.

Usage: ``python benchmarks/graph_decode.py [--device cuda|cpu] [--contexts T ...] [--steps N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch
from e2e_decode import cache_bytes


# docs/baselines.md's best single state at 25% of the bytes: pre-RoPE int4 keys and values, 4 sinks, 32 exact recent tokens
BEST = "pre-rope-int4-sinks4-window32"


class StepClock:
    """A transformers logits processor that records the time of every decode step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())
        return scores

    def median_step(self, skip: int = 2) -> float:
        steps = np.diff(self.stamps)[skip:]
        return float(statistics.median(steps))


def make_model(args, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.75),
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=128,
        max_position_embeddings=max(args.contexts) + args.steps + 8,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.eval().to(dtype)


def time_generate(model, ids, make_cache, steps: int, compile_config, warm: bool) -> tuple[float, int]:
    """Median seconds of one decode step and the cache's bytes; ``warm``: one untimed run first
    on the same cache (reset between)."""
    from transformers import LogitsProcessorList

    cache = make_cache()
    options = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, cache=cache)
    options |= dict(compile_config=compile_config) if compile_config is not None else dict(disable_compile=True)
    if warm:
        model.generate(ids, **options)
        cache.reset()
    clock = StepClock(ids.device)
    model.generate(ids, logits_processor=LogitsProcessorList([clock]), **options)
    return clock.median_step(), cache_bytes(cache)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rank", type=int, default=32)
    formats = ["float", "int8", "int4", "int2"]
    formats += [f"pre-rope-{f}" for f in formats] + [BEST]
    p.add_argument("--coefficients", nargs="+", default=["float", "int8", "int4", "pre-rope-float", "pre-rope-int4", BEST], choices=formats)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from subspace_ref.hf_requirements import require_cache_api

    try:  # every row passes generate's cache=: one message, not one failure per row
        require_cache_api("benchmarks/graph_decode.py")
    except ImportError as err:
        sys.exit(str(err))

    from transformers import CompileConfig, DynamicCache, StaticCache

    from subspace_ref.hf import GraphSubspaceCache, SubspaceCache, static_states, use_subspace_attention
    from subspace_ref.rope import RopeParams
    from subspace_ref.workloads import random_static_bases

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.set_num_threads(1) if device.type == "cpu" else None
    model = make_model(args, device, dtype)
    bases = random_static_bases(args.layers, args.kv_heads, 128, args.rank)
    rope = RopeParams.from_config(model.config)
    factories = {}
    for coef in args.coefficients:
        exact = dict(sinks=4, window=32) if coef == BEST else {}
        factories[coef] = static_states(bases, coefficients=coef.removeprefix("pre-rope-").removesuffix("-sinks4-window32"),
                                        rope=rope if coef.startswith("pre-rope-") else None, **exact)
    compiled = CompileConfig()  # transformers' default: inductor, mode="reduce-overhead" (CUDA graphs on CUDA)
    compiled._compile_all_devices = device.type != "cuda"
    backend = "triton" if device.type == "cuda" else "torch"
    print(f"{device} {torch.cuda.get_device_name(device) if device.type == 'cuda' else ''}: random-init Llama, {args.layers} layers, "
          f"{args.heads} query / {args.kv_heads} KV heads of 128, {str(dtype)[6:]}, r = r_v = {args.rank}, {args.steps} greedy steps, median step")
    rows = []
    for T in args.contexts:
        capacity = T + args.steps
        ids = torch.randint(0, args.vocab, (1, T), generator=torch.Generator().manual_seed(T)).to(device)
        runs = {
            "DynamicCache + SDPA (eager)": (lambda: DynamicCache(config=model.config), None, False, "sdpa"),
            "StaticCache (compiled)": (lambda: StaticCache(config=model.config, max_cache_len=capacity), compiled, True, "sdpa"),
        }
        for coef, factory in factories.items():
            graph_cache = lambda factory=factory: GraphSubspaceCache(model.config, factory, max_cache_len=capacity)  # noqa: E731
            runs[f"GraphSubspaceCache r={args.rank} {coef} (compiled)"] = (graph_cache, compiled, True, None)
            if coef == "float":  # the step's host overhead, which the graph removes
                runs[f"GraphSubspaceCache r={args.rank} {coef} (eager)"] = (graph_cache, None, False, None)
            runs[f"SubspaceCache r={args.rank} {coef} ({backend}, eager)"] = (lambda factory=factory: SubspaceCache(model.config, factory, backend=backend), None, False, None)
        base = None
        for name, (make, config, warm, impl) in runs.items():
            model.set_attn_implementation(impl) if impl else use_subspace_attention(model)
            torch._dynamo.reset()
            try:
                seconds, nbytes = time_generate(model, ids, make, args.steps, config, warm)
            except Exception as exc:  # one failing row must not lose the others
                print(f"  T={T:6d} {name:44s} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                rows.append(dict(context=T, cache=name, error=f"{type(exc).__name__}: {exc}"))
                continue
            row = dict(context=T, cache=name, step_us=seconds * 1e6, tokens_per_s=1.0 / seconds, bytes=nbytes)
            base = row if name.startswith("DynamicCache") else base
            ratio = ""
            if base is not None:  # against DynamicCache + SDPA of the same run, when it ran
                row["speed_ratio"] = row["tokens_per_s"] / base["tokens_per_s"]
                ratio = f"({row['speed_ratio']:.2f}x)"
            rows.append(row)
            print(f"  T={T:6d} {name:44s} {row['step_us']:9.1f} us/step {row['tokens_per_s']:8.1f} tok/s {ratio:8s}"
                  f"  cache {nbytes / 2**20:8.1f} MiB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(device), args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
