"""Generation with the subspace cache at full rank equals the stock ``DynamicCache`` (issue 17).

Matrix: tiny random-init Llama (GQA), Qwen2, Qwen3, Mistral (sliding window, compressed),
Phi3, Gemma, Gemma2 (hybrid: sliding layers kept stock, soft-capping) x {greedy, sampling,
beam=2, left-padded batch of 3, two successive generate calls, prompt-lookup decoding} x
{float32, bfloat16}. The default suite runs every family and mode in float32 and in bfloat16 on
Llama, Gemma2 and Mistral (GQA, hybrid + soft-capping, compressed sliding window); the rest of
the bfloat16 matrix is marked slow (all 88 take ~20 s alone).

Tolerance (tests/differential/tolerance.py's rule applied to a whole model). The oracle is the
model run in float64 with the stock cache. The reference error is how far the stock model run in
the test dtype lands from that oracle: the largest over the plain cast and SAMPLES copies whose
weights are moved by 0 or +-1 ulp at random (other, equally valid roundings of the same
weights). The subspace cache passes when its logits lie within FACTOR x that error + FLOOR_ULPS
ulps of the largest logit of the oracle: twice what transformers' own path errs in the dtype.

Tokens: equal to the stock tokens up to the first step where the two runs diverge; there the
logits (computed from identical prefixes) must still agree within the tolerance, and for greedy
choices the stock top-2 margin must lie within twice the tolerance (a rounding-level tie).
A divergence at a step with a clear margin, or logits outside the tolerance, fails. Beam
search: equal sequences, or (a tie between beams) sequences the stock model itself rates within
4 x tolerance of its own (mean log-probability of the new tokens; each log-softmax moves by at
most twice the logit error).
"""

from __future__ import annotations

import math

import copy

import pytest
import torch

from subspace_ref.hf_requirements import MIN_TRANSFORMERS

pytest.importorskip("transformers", minversion=MIN_TRANSFORMERS)  # older: generate has no cache= (skipped, both versions named)

import transformers  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from tests.differential.tolerance import EPS, FACTOR, FLOOR_ULPS, SAMPLES  # noqa: E402
from subspace_ref.hf import compress, full_rank_states  # noqa: E402

torch.set_num_threads(1)
VOCAB = 96
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2")
MODES = ("greedy", "sample", "beam2", "padded3", "twice", "lookup")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FAST_BF16 = ("llama", "gemma2", "mistral")
NEW = 6


def make_config(family: str):
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        initializer_range=0.2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
    )
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
        "phi3": transformers.Phi3Config,
        "gemma": transformers.GemmaConfig,
        "gemma2": transformers.Gemma2Config,
    }[family]
    extra = {}
    if family in ("qwen3", "gemma", "gemma2"):
        extra["head_dim"] = 16
    if family in ("mistral", "gemma2"):
        extra["sliding_window"] = 8  # shorter than prompt + generation: the window really slides
    return cls(**common, **extra)


_MODELS: dict = {}


def model_for(family: str, dtype: str = "float32"):
    key = (family, dtype)
    if key not in _MODELS:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(make_config(family)).eval()
        _MODELS[key] = model.to(DTYPES[dtype])
    return _MODELS[key]


def cache_options(family: str) -> dict:
    # Mistral's layers are all sliding: compress them (the sliding mask acts on coefficient
    # logits); Gemma2 keeps its sliding layers stock and compresses the full ones
    return {"sliding": "compress"} if family == "mistral" else {}


# --------------------------------------------------------------------------- tolerance
def nudged(model, seed: int):
    """A copy of ``model`` whose weights are moved by 0 or +-1 ulp of their dtype at random."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
    with torch.no_grad():
        for p in out.parameters():
            step = torch.randint(-1, 2, p.shape, generator=gen).to(as_int[p.dtype])
            p.copy_((p.view(as_int[p.dtype]) + step).view(p.dtype))
    return out


def prompt_ids(batch: int = 2, length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def stock_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, cache=DynamicCache(config=model.config)).logits.double()


_TOL: dict = {}


def tolerance(family: str, dtype: str) -> float:
    """FACTOR x (largest error of the stock model in ``dtype`` against float64) + FLOOR_ULPS ulps."""
    if (family, dtype) not in _TOL:
        ids = prompt_ids(length=20)
        oracle = stock_logits(copy.deepcopy(model_for(family)).to(torch.float64), ids)
        model = model_for(family, dtype)
        runs = [model] + [nudged(model, seed) for seed in range(SAMPLES)]
        ref = max(float((stock_logits(m, ids) - oracle).abs().max()) for m in runs)
        _TOL[family, dtype] = FACTOR * ref + FLOOR_ULPS * EPS[dtype] * float(oracle.abs().max())
    return _TOL[family, dtype]


# --------------------------------------------------------------------------- generation
def generate(model, mode: str, cache_factory) -> list:
    """The generate calls of one mode: a list of outputs (one per call; "twice" makes two)."""
    kw = dict(max_new_tokens=NEW, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    ids = prompt_ids()
    if mode == "greedy":
        return [model.generate(ids, do_sample=False, cache=cache_factory(), **kw)]
    if mode == "sample":
        torch.manual_seed(7)
        return [model.generate(ids, do_sample=True, top_k=0, cache=cache_factory(), **kw)]
    if mode == "beam2":
        return [model.generate(ids, do_sample=False, num_beams=2, output_scores=True, cache=cache_factory(), **kw)]
    if mode == "padded3":
        ids = prompt_ids(batch=3, length=11, seed=3)
        mask = torch.ones_like(ids)
        for row, pad in enumerate((5, 0, 2)):
            ids[row, :pad], mask[row, :pad] = 0, 0
        return [model.generate(ids, attention_mask=mask, do_sample=False, cache=cache_factory(), **kw)]
    if mode == "twice":
        cache = cache_factory()
        first = model.generate(ids, do_sample=False, cache=cache, **kw)
        more = torch.cat([first.sequences, prompt_ids(length=3, seed=9)], dim=1)
        return [first, model.generate(more, do_sample=False, cache=cache, **kw)]
    assert mode == "lookup"
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
    return [model.generate(ids, do_sample=False, prompt_lookup_num_tokens=3, cache=cache_factory(), **kw)]


def mean_logprob(model, sequences: torch.Tensor, new: int) -> torch.Tensor:
    """Per row, the stock model's mean log-probability of the last ``new`` tokens."""
    with torch.no_grad():
        logp = torch.log_softmax(model(sequences).logits.double(), -1)
    picked = logp[:, -new - 1 : -1].gather(-1, sequences[:, -new:, None])[..., 0]
    return picked.mean(-1)


def check_call(where: str, model, stock, ours, greedy: bool, beams: bool, tol: float) -> bool:
    """Check one generate call; True when its tokens are equal (the next call may be compared)."""
    same = stock.sequences.shape == ours.sequences.shape and torch.equal(stock.sequences, ours.sequences)
    if beams:
        if not same:  # a tie between beams: the stock model rates our sequences as well as its own
            gap = mean_logprob(model, stock.sequences, NEW) - mean_logprob(model, ours.sequences, NEW)
            assert float(gap.max()) <= 4 * tol, f"{where}: beam sequences differ and ours score {float(gap.max()):.3g} lower"
        return same
    start = stock.sequences.shape[1] - len(stock.logits)
    for step, (a, b) in enumerate(zip(stock.logits, ours.logits)):
        gap = float((a.double() - b.double()).abs().max())
        assert gap <= tol, f"{where}: step {step} logits differ by {gap:.3g} > tolerance {tol:.3g}"
        if not torch.equal(stock.sequences[:, start + step], ours.sequences[:, start + step]):
            if greedy:
                top2 = a.double().topk(2, dim=-1).values
                margin = float((top2[:, 0] - top2[:, 1]).min())
                assert margin <= 2 * tol, f"{where}: tokens differ at step {step} with a clear stock margin {margin:.3g}"
            return False
    assert same, f"{where}: sequences differ although every step's tokens agree:\n{stock.sequences}\n{ours.sequences}"
    return True


def check_same_generation(family: str, dtype: str, mode: str, states=None) -> None:
    model = model_for(family, dtype)
    tol = tolerance(family, dtype)
    stock_calls = generate(model, mode, lambda: DynamicCache(config=model.config))
    with compress(model, states or full_rank_states(), **cache_options(family)) as kv:
        our_calls = generate(model, mode, kv.cache)
    for i, (stock, ours) in enumerate(zip(stock_calls, our_calls)):
        if not check_call(f"{family}/{dtype}/{mode}/call {i}", model, stock, ours, mode != "sample", mode == "beam2", tol):
            break


def matrix():
    for family in FAMILIES:
        for dtype in DTYPES:
            marks = [pytest.mark.slow] if dtype == "bfloat16" and family not in FAST_BF16 else []
            yield pytest.param(family, dtype, id=f"{family}-{dtype}", marks=marks)


@pytest.mark.parametrize("family, dtype", list(matrix()))
@pytest.mark.parametrize("mode", MODES)
def test_full_rank_generation_equals_dynamic_cache(family, dtype, mode):
    check_same_generation(family, dtype, mode)


@pytest.mark.parametrize("family, dtype", [("llama", "float32"), ("llama", "bfloat16"), ("gemma2", "bfloat16"), ("mistral", "float32")])
def test_full_rank_logits_within_derived_tolerance(family, dtype):
    """Prefill of 8 tokens then 12 one-token steps (two sequences): every logit within the
    derived tolerance of the float64 oracle's (the stock model itself is within half of it)."""
    model = model_for(family, dtype)
    ids = prompt_ids(length=20)
    oracle = stock_logits(copy.deepcopy(model_for(family)).to(torch.float64), ids)
    with compress(model, full_rank_states(), **cache_options(family)) as kv, torch.no_grad():
        cache = kv.cache()
        parts = [model(ids[:, :8], cache=cache).logits]
        parts += [model(ids[:, t : t + 1], cache=cache).logits for t in range(8, 20)]
    ours = torch.cat(parts, 1).double()
    gap = float((ours - oracle).abs().max())
    assert gap <= tolerance(family, dtype), f"{family}/{dtype}: {gap:.3g} > {tolerance(family, dtype):.3g}"


def full_rank_windowed(spec):
    """Identity bases (the compressed part stores keys and values exactly) with an exact window
    of 3 and one sink: tokens leave the window every step, through the compressed part."""
    from subspace_ref.hf import identity_bases, static_states
    from subspace_ref.calibration import StaticBasis

    eye = identity_bases(spec.heads, spec.head_dim)
    return static_states([StaticBasis.from_bases(eye, eye, 1.0)] * (spec.layer_idx + 1), window=3, sinks=1)(spec)


# Full-rank adaptive states are exact only while their compressed tokens lie in the warm-up
# span (full_rank_states' docstring): with a window of 2 the compressed part holds at most 16
# tokens here (prompts of <= 13, 6 new), all within the warm-up of d = 16 rows.
OTHER_STATES = {"windowed": full_rank_windowed, "adaptive+window": full_rank_states("adaptive", window=2)}


@pytest.mark.parametrize("states", list(OTHER_STATES))
@pytest.mark.parametrize("mode", ["beam2", "lookup", "padded3"])
def test_beams_and_assisted_decoding_with_windowed_and_adaptive_states(mode, states):
    """Beam search (reorder_cache of every state array) and prompt-lookup decoding (crop back
    to the restore point of the verifying forward) with a windowed and an adaptive state at
    full rank equal DynamicCache, as the matrix above checks it."""
    check_same_generation("llama", "float32", mode, OTHER_STATES[states])


def test_prompt_lookup_with_a_compressing_adaptive_state_equals_its_greedy_decoding():
    """Assisted decoding is lossless: with an adaptive state at rank 6 of 16 that opens chunks
    (not exact, so DynamicCache is no reference), prompt lookup (verifying forwards of up to 4
    tokens, crops back to their restore points) gives the tokens of greedy decoding with the
    same state kind, and logits within the tolerance. In float64: the two runs feed the state
    keys from forwards of different lengths (13 prompt tokens, or 13 + 3 candidates), rounding
    apart, and the FD sketch's SVDs amplify that in float32 beyond the stock model's own
    error (measured 5.5e-5 against 1.9e-5); in float64 it stays ~1e-12, far inside the float32
    tolerance used as the bound, while a wrongly restored state errs by 0.1-1."""
    from subspace_ref.hf import adaptive_states

    model = copy.deepcopy(model_for("llama")).to(torch.float64)
    # many chunks on purpose: the uncapped policy (the factory's byte ceiling would keep few)
    factory = adaptive_states(rank_k=6, rank_v=6, tau_k=0.05, tau_v=0.05, max_chunk=4, warmup=2, byte_ceiling=math.inf)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
    kw = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    with compress(model, factory) as kv:
        greedy = model.generate(ids, cache=kv.cache(), **kw)
        cache = kv.cache()
        lookup = model.generate(ids, prompt_lookup_num_tokens=3, cache=cache, **kw)
    assert int(cache.states[0].num_chunks.min()) >= 3
    assert check_call("llama/adaptive/lookup", model, greedy, lookup, True, False, tolerance("llama", "float32"))
