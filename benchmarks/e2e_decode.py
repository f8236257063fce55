"""End-to-end decode with transformers: tokens/s and cache bytes of the subspace cache against
the stock ``DynamicCache`` and HF's ``QuantizedCache`` (quanto backend, int4 and int2, where
optimum-quanto is installed), measured in the same run, on CPU with one thread (docs/hf.md).

Two settings:

* ``shipped``: the shipped byte-level Llama (4 layers, 2 KV heads of 64, float32) at contexts
  up to its 1024 limit. The prompt is prefilled through the model with each cache (real keys
  and values; static bases calibrated on other text at r = r_v = 16 of 64; the uniform pre-RoPE
  row of docs/baselines.md; the allocator's states at 25% and 12.5%, calibrated as
  ``subspace-kv calibrate --compression-ratio R`` does, and again with ``--key-bases
  post_rope,plane,identity`` and with ``--max-pre-rope-rank none``), then ``--steps`` greedy decode steps
  are timed. Then, per allocation with pre-RoPE keys and context, the least time its key
  rebuild can take a step (:func:`rebuild_fmas` at this core's sgemm rate, measured in the
  same run) beside the stock cache's append and SDPA.
* ``llama128``: a random-init Llama with head size 128 (hidden 1024, 8 query / 8 KV heads,
  ``--layers`` layers) at 8k-16k tokens, subspace caches with float, int8 and int4 coefficients. Prefilling 16k tokens through the model on one CPU
  thread would take minutes per cache, so every cache is filled with the same random keys and
  values of the context length (what decode reads is then the same amount of data); the decode
  steps run the whole model. Bases: random orthonormal, r = r_v = 32 of 128 (speed and bytes do
  not depend on which subspace). Rows with pre-RoPE bases: uniform int4 with 4 sinks and 32
  exact tokens, and the allocator's states at 25% (:func:`random_model_allocation`).

* ``prefill``: seconds to prefill a 1000-token prompt through the shipped model (static,
  static + window, adaptive, adaptive + window states), alternating rounds, median.

Usage: ``python benchmarks/e2e_decode.py [--setting shipped|llama128|both|prefill] [--steps N] [--rounds N] [--json PATH]``.
Prints one table per setting; ratios are against DynamicCache in the model's dtype, same run.
Decode steps of the caches of one context are timed in turn, one step of each (median per
cache), so that a shared machine's load falls on all of them alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

import subspace_ref as sr
from subspace_ref.hf import SubspaceCache, compress, static_states
from subspace_ref.workloads import random_static_bases


def quantized_cache_reason() -> str | None:
    """None when transformers' QuantizedCache has its quanto backend here, else why not."""
    try:
        import optimum.quanto  # noqa: F401
    except ImportError:
        return "QuantizedCache needs optimum-quanto: pip install -c constraints.txt 'subspace_ref[quantized-cache]' (docs/hf.md)"
    return None


def quantized_caches(config) -> dict:
    """HF's QuantizedCache (quanto backend) at 4 and 2 bits, transformers' defaults otherwise
    (groups of 64 channels, the last 128 tokens kept unquantised), when installed."""
    if quantized_cache_reason() is not None:
        return {}
    from transformers import QuantizedCache

    return {f"QuantizedCache int{bits}": (lambda bits=bits: QuantizedCache(backend="quanto", config=config, nbits=bits)) for bits in (4, 2)}


def tensor_nbytes(x) -> int:
    """Bytes of a tensor, a quanto tensor subclass counted by its inner tensors (codes, scales, shifts)."""
    if type(x) is torch.Tensor or not hasattr(x, "__tensor_flatten__"):
        return x.nbytes
    names, _ = x.__tensor_flatten__()
    return sum(tensor_nbytes(getattr(x, name)) for name in names)


def cache_bytes(cache) -> int:
    """Bytes a cache holds: a subspace cache's own count (bases included), else its layers' tensors."""
    if hasattr(cache, "nbytes"):  # SubspaceCache, GraphSubspaceCache
        return cache.nbytes
    held = ("keys", "values", "_quantized_keys", "_quantized_values")
    return sum(tensor_nbytes(x) for layer in cache.layers for x in (getattr(layer, name, None) for name in held) if isinstance(x, torch.Tensor))


@torch.no_grad()
def decode_seconds(model, caches: dict, first_tokens: dict, steps: int) -> dict:
    """Median seconds of one greedy decode step (batch 1) per cache, the caches stepped in turn
    (one step of each, then the next), so that load from other processes on a shared machine
    falls on all of them alike; two untimed steps each first. Under ``no_grad``, as ``generate``
    runs them."""
    tokens = dict(first_tokens)
    times = {name: [] for name in caches}
    for step in range(2 + steps):
        for name, cache in caches.items():
            start = time.perf_counter()
            tokens[name] = model(tokens[name], cache=cache).logits[:, -1:].argmax(-1)
            if step >= 2:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def fill(cache, keys: list, values: list) -> None:
    """Put the same keys/values (per layer (1, H, T, d)) into any cache, as prefill would."""
    for i in range(len(cache.layers)):
        layer = cache.layers[i]
        if not hasattr(layer, "attend_pending"):
            layer.update(keys[i], values[i])
            continue
        if not layer.is_initialized:
            layer.lazy_initialization(keys[i], values[i])
            layer = cache.layers[i]  # a layer state with head groups makes it a GroupedLayer
        groups = [(layer, None)] if not hasattr(layer, "children") else list(zip(layer.children, layer._index))
        for child, index in groups:
            k, v = (keys[i], values[i]) if index is None else (keys[i].index_select(1, index), values[i].index_select(1, index))
            child._append(k, v)


def rows_for(model, contexts, steps, make_caches, prefill) -> list[dict]:
    rows = []
    for T in contexts:
        caches = {name: make() for name, make in make_caches.items()}
        firsts = {name: prefill(cache, T) for name, cache in caches.items()}
        seconds = decode_seconds(model, caches, firsts, steps)
        base = None
        for name, cache in caches.items():
            row = dict(context=T, cache=name, tokens_per_s=1.0 / seconds[name], bytes=cache_bytes(cache))
            if base is None:
                base = row
            row["speed_ratio"] = row["tokens_per_s"] / base["tokens_per_s"]
            row["bytes_ratio"] = row["bytes"] / base["bytes"]
            rows.append(row)
            speed, size = f"{row['tokens_per_s']:8.2f} tok/s ({row['speed_ratio']:.2f}x)", f"{row['bytes'] / 2**20:9.2f} MiB ({row['bytes_ratio']:.3f}x)"
            print(f"  T={T:6d} {name:22s} {speed}  {size}", flush=True)
        del caches
    return rows


FAST_KEY_BASES = ("post_rope", "plane", "identity")


def rebuild_fmas(allocation, d: int, T: int) -> int:
    """Fmas one decode step (batch 1) spends rebuilding pre-RoPE keys at context T: r_k d per
    token and pre-RoPE KV head (spec/rope.md P3), whatever the kernel."""
    return sum(h.rank_k * d * T for layer in allocation.heads for h in layer if h.key_basis == "pre_rope")


def sgemm_fma_rate(n: int = 512, repeats: int = 20) -> float:
    """This core's float32 fmas per second in an n x n matrix product (one thread, the best of
    ``repeats``): a ceiling for the rebuild's fma rate, measured in the same run."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return n**3 / best


def stock_attention_seconds(config, T: int, dtype: torch.dtype, repeats: int = 200) -> float:
    """Seconds of what the stock cache's decode step spends on attention at context T, every
    layer: DynamicCache's append (a ``torch.cat`` of keys and of values) and SDPA (median)."""
    import torch.nn.functional as F

    d, hq, h = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    q, k, v, new = (torch.randn(1, heads, n, d, dtype=dtype) for heads, n in ((hq, 1), (h, T - 1), (h, T - 1), (h, 1)))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        keys, values = torch.cat([k, new], dim=2), torch.cat([v, new], dim=2)
        F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * config.num_hidden_layers


def print_rebuild_floors(config, allocations: dict, contexts, dtype: torch.dtype) -> None:
    """Per allocation with pre-RoPE keys: the least time its key rebuild can take a step at this
    core's sgemm rate, beside the stock cache's whole attention (docs/hf.md, "Decode speed")."""
    rate = sgemm_fma_rate()
    for T in contexts:
        stock = stock_attention_seconds(config, T, dtype)
        for name, allocation in allocations.items():
            fmas = rebuild_fmas(allocation, config.head_dim, T)
            if fmas:
                print(f"  T={T:6d} {name}: its pre-RoPE keys' rebuild takes >= {1e6 * fmas / rate:.0f} us a step ({fmas / 1e6:.1f} M fmas at "
                      f"this core's sgemm rate, {rate / 1e9:.1f} G fmas/s); the stock cache's append and SDPA take {1e6 * stock:.0f} us a step", flush=True)


def shipped(steps: int, contexts=(256, 512, 1008)) -> list[dict]:
    from transformers import DynamicCache

    from subspace_ref.hf import capture
    from subspace_ref.hf.calibrate_checkpoint import calibrate_checkpoint
    from subspace_ref.models import default_model as dm

    model, _ = dm.load_model("default")
    from pathlib import Path

    here = Path(sr.__file__).parent
    text = (here / "state.py").read_text(encoding="utf-8")
    calib = dm.encode(text[:4096])[None, :1024]
    bases = capture(model, calib, queries=True).calibrate(rank_k=16, rank_v=16, gamma="mse")
    prompt_text = (here / "calibration.py").read_text(encoding="utf-8")
    ids = dm.encode(prompt_text)[None]

    def prefill(cache, T):
        with torch.no_grad():
            return model(ids[:, :T], cache=cache).logits[:, -1:].argmax(-1)

    # docs/baselines.md's uniform pre-RoPE row at 25% of the fp16 bytes: pre-RoPE key bases
    # (spec/rope.md P2), int4 coefficients, 4 sinks and 32 exact recent tokens
    from subspace_ref.rope import RopeParams

    pre = capture(model, calib, queries=True, rope=False).calibrate(rank_k=37, rank_v=36, gamma="mse")
    pre_states = static_states(pre, coefficients="int4", rope=RopeParams.from_config(model.config), sinks=4, window=32)
    # the front door's allocations (`subspace-kv calibrate --compression-ratio R`: sinks and window chosen by its loss)
    calibrated = {ratio: calibrate_checkpoint("default", ratio) for ratio in (0.25, 0.125)}
    # the same without pre-RoPE keys (`--key-bases post_rope,plane,identity`, spec/layer_state.md L6.3)
    fast = {ratio: calibrate_checkpoint("default", ratio, key_bases=FAST_KEY_BASES) for ratio in (0.25, 0.125)}
    # and with pre-RoPE keys of any rank (`--max-pre-rope-rank none`; the default caps them at d/4, L6.4)
    uncapped = {ratio: calibrate_checkpoint("default", ratio, max_pre_rope_rank=None) for ratio in (0.25, 0.125)}

    print(f"shipped model, float32, r = r_v = 16 of 64, {steps} decode steps after a real prefill")
    with compress(model, static_states(bases)) as kv:
        caches = {
            "DynamicCache": lambda: DynamicCache(config=model.config),
            "SubspaceCache r=16": kv.cache,
            "pre-RoPE r=37/36 int4 + sinks 4 + window 32": lambda: SubspaceCache(model.config, pre_states),
            **{f"allocator {ratio:.1%} (sinks {c.allocation.sinks}, window {c.allocation.window})": lambda c=c: SubspaceCache(model.config, c.states(model.config))
               for ratio, c in calibrated.items()},
            **{f"allocator {ratio:.1%}, no pre-RoPE keys (sinks {c.allocation.sinks}, window {c.allocation.window})":
               lambda c=c: SubspaceCache(model.config, c.states(model.config)) for ratio, c in fast.items()},
            **{f"allocator {ratio:.1%}, pre-RoPE rank uncapped (sinks {c.allocation.sinks}, window {c.allocation.window})":
               lambda c=c: SubspaceCache(model.config, c.states(model.config)) for ratio, c in uncapped.items()},
            **quantized_caches(model.config),
        }
        rows = rows_for(model, contexts, steps, caches, prefill)
    floors = {f"allocator {ratio:.1%}": c.allocation for ratio, c in calibrated.items()}
    floors |= {f"allocator {ratio:.1%}, pre-RoPE rank uncapped": c.allocation for ratio, c in uncapped.items()}
    print_rebuild_floors(model.config, floors, contexts, model.dtype)
    return rows


def prefill_rows(rounds: int, length: int = 1000) -> list[dict]:
    """Seconds to prefill a ``length``-token prompt through the shipped model with each cache,
    alternating the caches ``rounds`` times (median), against DynamicCache in the same run."""
    from pathlib import Path

    from transformers import DynamicCache

    from subspace_ref.hf import adaptive_states, capture
    from subspace_ref.models import default_model as dm

    model, _ = dm.load_model("default")
    here = Path(sr.__file__).parent
    bases = capture(model, dm.encode((here / "state.py").read_text(encoding="utf-8")[:4096])[None, :1024]).calibrate(rank_k=16, rank_v=16)
    ids = dm.encode((here / "calibration.py").read_text(encoding="utf-8"))[None, :length]
    factories = {
        "static r=16": static_states(bases),
        "static r=16 + window 64": static_states(bases, window=64),
        "adaptive r=16": adaptive_states(rank_k=16, rank_v=16),
        "adaptive r=16 + window 64": adaptive_states(rank_k=16, rank_v=16, window=64),
    }
    times: dict[str, list[float]] = {"DynamicCache": [], **{name: [] for name in factories}}
    print(f"shipped model, float32, {ids.shape[1]}-token prefill, {rounds} alternating rounds (median)")
    with compress(model, static_states(bases)) as kv, torch.no_grad():
        for _ in range(rounds):
            for name in times:
                cache = DynamicCache(config=model.config) if name == "DynamicCache" else SubspaceCache(model.config, factories[name])
                start = time.perf_counter()
                model(ids, cache=cache)
                times[name].append(time.perf_counter() - start)
        del kv
    base = float(np.median(times["DynamicCache"]))
    rows = []
    for name, sec in times.items():
        row = dict(context=int(ids.shape[1]), cache=name, prefill_s=float(np.median(sec)), time_ratio=float(np.median(sec)) / base)
        rows.append(row)
        print(f"  {name:28s} {row['prefill_s']:7.3f} s  ({row['time_ratio']:.2f}x DynamicCache's time)", flush=True)
    return rows


def llama128(steps: int, layers: int, contexts=(8192, 16384), dtype=torch.float32) -> list[dict]:
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from subspace_ref.rope import RopeParams

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=max(contexts) + 64,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().to(dtype)
    bases = random_static_bases(layers, 8, 128, 32)
    rope = RopeParams.from_config(config)
    allocated = random_model_allocation(model, 0.25)
    gen = torch.Generator().manual_seed(1)

    def prefill(cache, T):
        keys = [torch.randn((1, 8, T, 128), generator=gen).to(dtype) for _ in range(layers)]
        values = [torch.randn((1, 8, T, 128), generator=gen).to(dtype) for _ in range(layers)]
        fill(cache, keys, values)
        return torch.tensor([[7]])

    print(f"random-init Llama, head 128, {layers} layers, 8 KV heads, {str(dtype)[6:]}, r = r_v = 32 of 128, caches filled with random K/V, {steps} steps")
    with compress(model, static_states(bases)) as kv:
        caches = {
            "DynamicCache": lambda: DynamicCache(config=model.config),
            "SubspaceCache r=32": kv.cache,
            # quantised coefficients (spec A10, spec/quantization.md Q2): on a CPU the torch backend's
            # kernels read them without dequantising (spec R14)
            **{
                f"SubspaceCache r=32 {fmt}": lambda fmt=fmt: SubspaceCache(model.config, static_states(bases, coefficients=fmt))
                for fmt in ("int8", "int4")
            },
            "pre-RoPE r=32 int4 + sinks 4 + window 32": lambda: SubspaceCache(model.config, static_states(bases, coefficients="int4", rope=rope, sinks=4, window=32)),
            f"allocator 25% (sinks {allocated.allocation.sinks}, window {allocated.allocation.window})": lambda: SubspaceCache(model.config, allocated.states(model.config)),
            **quantized_caches(model.config),
        }
        rows = rows_for(model, contexts, steps, caches, prefill)
    print_rebuild_floors(model.config, {"allocator 25%": allocated.allocation}, contexts, model.dtype)
    return rows


def random_model_allocation(model, ratio: float, tokens: int = 1024, window_tokens: int = 512):
    """The allocator's states for a random-init model (public API, as ``subspace-kv calibrate``:
    :func:`~subspace_ref.hf.calibration_losses` on random token windows, then ``allocate_best``
    at ``ratio`` under the default pre-RoPE rank cap); speed depends on the ranks, formats, basis kinds and exact tokens chosen, not
    on what they are fitted to."""
    from subspace_ref.hf import CalibratedBases, calibration_losses
    from subspace_ref.hf.calibrate_checkpoint import AUTO_PRE_ROPE_RANK, resolve_pre_rope_rank

    ids = np.random.default_rng(2).integers(0, model.config.vocab_size, size=(tokens // window_tokens, window_tokens))
    cal = calibration_losses(model, ids, ranks=range(0, model.config.head_dim + 1, 16), batch=1)
    cap = resolve_pre_rope_rank(AUTO_PRE_ROPE_RANK, model.config.head_dim)  # the front door's default (L6.4)
    allocation = cal.allocate_best(model, compression_ratio=ratio, max_pre_rope_rank=cap)
    return CalibratedBases.for_model(model.config, cal.bases(allocation), allocation=allocation)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setting", choices=("shipped", "llama128", "both", "prefill"), default="both")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of the prefill setting (default 3)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--layers", type=int, default=4, help="layers of the random head-128 Llama (default 4)")
    p.add_argument("--contexts", type=int, nargs="*", default=None,
                   help="contexts (default: 256 512 1008 for the shipped setting, whose model holds 1024 positions; 8192 16384 for llama128)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="dtype of the llama128 setting (default float32)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    reason = quantized_cache_reason()
    print(f"torch {torch.__version__}, 1 thread; QuantizedCache: {reason or 'available'}")
    out = {"threads": 1, "quantized_cache": reason or "available"}
    if args.setting == "prefill":
        out["prefill"] = prefill_rows(args.rounds)
    if args.setting in ("shipped", "both"):
        out["shipped"] = shipped(args.steps, tuple(args.contexts or (256, 512, 1008)))
    if args.setting in ("llama128", "both"):
        out["llama128"] = llama128(args.steps, args.layers, tuple(args.contexts or (8192, 16384)), getattr(torch, args.dtype))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
