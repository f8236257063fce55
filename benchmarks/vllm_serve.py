"""Throughput and KV capacity of vLLM serving with the subspace plugin against stock vLLM
(docs/vllm.md). Run it in the vLLM venv (.ci/vllm builds one):

    .venv-vllm/bin/python benchmarks/vllm_serve.py [--setting shipped|llama128|all] [--rounds 3] [--out FILE.json]

Settings:

* ``shipped``: the shipped byte-level Llama (4 layers, 2 KV heads of 64, float32), stock
  against bases at r = 32 and r = 16 (two heads of 16 packed per cache head of 32); a batch of
  16 prompts of 960 tokens, 64 new tokens each (1k context).
* ``llama128``: a random-init Llama with heads of 128 (8 query / 8 KV heads, 4 layers, hidden
  1024, float32, weights drawn by NumPy), stock against bases at r = 32; a batch of 16 at 1k
  context and a batch of 4 at 8k context.

Bases are random orthonormal (speed and capacity do not depend on their values; accuracy is the
tests' business: tests/vllm). Each round gives every engine new random prompts: a cold prefill
(timed: prefill tokens/s), then the same prompts again with ``max_tokens`` new tokens, which
vLLM's prefix cache serves without recomputing the prompt (timed: decode tokens/s). ``--compile`` runs vLLM's default torch.compile mode; without it
both engines run eagerly (``enforce_eager=True``, as the tests). The engines
of a setting stay up together and take turns, in alternating order, so load on a shared machine
hits both; the median over rounds is reported, with the ratio to stock. KV capacity is what
vLLM reports (its KV cache size in tokens) for ``VLLM_CPU_KVCACHE_SPACE`` GiB.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

SETTINGS = {
    "shipped": dict(ranks=(32, 16), runs=[dict(batch=16, context=1024, new_tokens=64)]),
    "llama128": dict(ranks=(32,), runs=[dict(batch=16, context=1024, new_tokens=64), dict(batch=4, context=8192, new_tokens=64)]),
}
LLAMA128 = dict(heads=8, kv_heads=8, head_dim=128, layers=4, seed=0, context=8192 + 64)


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), platform.processor())
    import torch
    import vllm

    return dict(
        date=datetime.datetime.now().isoformat(timespec="minutes"),
        cpu=cpu,
        cores=len(os.sched_getaffinity(0)),
        load_average=os.getloadavg(),
        python=platform.python_version(),
        torch=torch.__version__,
        vllm=vllm.__version__,
        kv_cache_space_gib=int(os.environ["VLLM_CPU_KVCACHE_SPACE"]),
    )


def prompts(rng, batch: int, length: int) -> list[list[int]]:
    # printable bytes: the models' tokens are bytes; no two prompts share a prefix block
    return [rng.integers(32, 127, size=length).tolist() for _ in range(batch)]


def timed_round(llm, batch: int, context: int, new_tokens: int, rng) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = [TokensPrompt(prompt_token_ids=p) for p in prompts(rng, batch, context - new_tokens)]
    one = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)
    many = SamplingParams(max_tokens=new_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(ids, one, use_tqdm=False)
    t1 = time.perf_counter()
    outs = llm.generate(ids, many, use_tqdm=False)
    t2 = time.perf_counter()
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return dict(prefill_tok_s=batch * (context - new_tokens) / (t1 - t0), decode_tok_s=batch * new_tokens / (t2 - t1))


def kv_capacity(llm) -> int:
    cache = llm.llm_engine.vllm_config.cache_config
    return cache.num_gpu_blocks * cache.block_size


def run_setting(name: str, model: str, bases: dict, rounds: int, max_len: int, compile: bool = False) -> list[dict]:
    """Start stock and one engine per bases directory, alternate the timed rounds between them."""
    from _vllm_support import running

    spec = SETTINGS[name]
    rows = []
    options = dict(multiprocessing=True, max_model_len=max_len, enable_prefix_caching=True, max_num_seqs=16, enforce_eager=not compile)
    with contextlib.ExitStack() as stack:
        engines = {"stock": stack.enter_context(running(model, **options))}
        for label, directory in bases.items():
            engines[label] = stack.enter_context(running(model, **options, additional_config={"subspace_bases": str(directory)}))
        capacity = {label: kv_capacity(llm) for label, llm in engines.items()}
        for run in spec["runs"]:
            results = {label: [] for label in engines}
            for i in range(rounds + 1):  # round 0 warms up each engine and is dropped
                order = list(engines) if i % 2 == 0 else list(reversed(engines))
                for label in order:
                    rng = np.random.default_rng([i, run["context"]])  # the same prompts for every engine of the round
                    r = timed_round(engines[label], rng=rng, **run)
                    if i:
                        results[label].append(r)
                    print(f"  {name} {run} {label} round {i}: prefill {r['prefill_tok_s']:.0f} tok/s, decode {r['decode_tok_s']:.1f} tok/s", flush=True)
            for label, rs in results.items():
                prefill = statistics.median(r["prefill_tok_s"] for r in rs)
                decode = statistics.median(r["decode_tok_s"] for r in rs)
                rows.append(dict(setting=name, cache=label, compiled=compile, **run, prefill_tok_s=prefill, decode_tok_s=decode, kv_capacity_tokens=capacity[label], rounds=[r for r in rs]))
    stock = {(r["batch"], r["context"]): r for r in rows if r["cache"] == "stock"}
    for r in rows:
        s = stock[(r["batch"], r["context"])]
        r |= dict(prefill_vs_stock=r["prefill_tok_s"] / s["prefill_tok_s"], decode_vs_stock=r["decode_tok_s"] / s["decode_tok_s"], capacity_vs_stock=r["kv_capacity_tokens"] / s["kv_capacity_tokens"])
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", choices=[*SETTINGS, "all"], default="all")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="vLLM's default torch.compile mode (else enforce_eager=True, as the tests)")
    parser.add_argument("--out", type=Path, default=None, help="write the rows and the machine facts as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from _vllm_support import numpy_llama, random_bases

    from subspace_ref.models.default_model import default_model_dir

    facts = machine()
    print(f"machine: {facts}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.setting in ("shipped", "all"):
            model = str(default_model_dir())
            bases = {f"r={r}": random_bases(model, tmp / f"shipped_r{r}", r, r) for r in SETTINGS["shipped"]["ranks"]}
            rows += run_setting("shipped", model, bases, args.rounds, 1024, args.compile)
        if args.setting in ("llama128", "all"):
            model = str(numpy_llama(tmp / "llama128", **LLAMA128))
            bases = {f"r={r}": random_bases(model, tmp / f"llama128_r{r}", r, r) for r in SETTINGS["llama128"]["ranks"]}
            rows += run_setting("llama128", model, bases, args.rounds, LLAMA128["context"], args.compile)
    facts["load_average_after"] = os.getloadavg()
    print(f"\n{'compiled' if args.compile else 'eager'} (enforce_eager={not args.compile})")
    print(f"{'setting':9} {'cache':6} {'batch':>5} {'context':>7} {'prefill tok/s':>14} {'decode tok/s':>13} {'KV tokens':>10}  vs stock (prefill, decode, capacity)")
    for r in rows:
        print(
            f"{r['setting']:9} {r['cache']:6} {r['batch']:5d} {r['context']:7d} {r['prefill_tok_s']:14.0f} {r['decode_tok_s']:13.1f} {r['kv_capacity_tokens']:10d}  "
            f"{r['prefill_vs_stock']:.2f}x, {r['decode_vs_stock']:.2f}x, {r['capacity_vs_stock']:.2f}x"
        )
    print(f"load average before {facts['load_average']}, after {facts['load_average_after']}")
    if args.out:
        args.out.write_text(json.dumps(dict(machine=facts, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
