"""The transformers integration (subspace_ref.hf, spec/models.md) on tiny random models.

Families: Llama (RoPE, grouped-query attention 4 query / 2 KV heads, head 16), GPT-NeoX (partial
rotary, 1/4 of the head rotates, head 16) and GPT-2 (no RoPE, fused c_attn, per-layer inverse
scaling, head 32); hidden 64, 2 layers, vocabulary 128. Models run in float64.

Tolerances (derivation). Two computations of the same real function differ only by rounding.
A float64 sum or dot product of n terms errs by at most gamma_n * sum|terms| with
gamma_n ~ n u, u = 2^-53 (Higham, Accuracy and Stability, Thm 3.1); the longest reductions
here have n <= 128 (the MLP width), so gamma_n <= 1.5e-14 relative to the magnitudes
involved. A layer chains a handful of such reductions and multiplies an input perturbation by
its gain G; for these nets (init std 0.2, 2 layers) G <= 10 is generous (measured: the largest
attention-output gap, ~2e-14, reaches the logits as <= 1e-14). Bound: gamma_n G^L |logits| =
1.5e-14 * 100 * |logits| = 1.5e-12 |logits|; we assert 1e-10 |logits| (about 70x margin).
Llama is special: its RMSNorm computes in float32 even in a float64 model
(``LlamaRMSNorm.forward`` casts to float32), so a float64 gap either vanishes (most often:
identical logits) or flips one float32 rounding, a relative jump of 2^-24 = 6e-8, amplified by
at most G^L = 100: we assert 1e-5 |logits| there. Greedy tokens are compared exactly, after
checking that the stock top-2 margin at every step exceeds the tolerance (else the comparison
would be meaningless).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from subspace_ref.hf_requirements import MIN_TRANSFORMERS

pytest.importorskip("transformers", minversion=MIN_TRANSFORMERS)  # older: generate has no cache= (skipped, both versions named)

from transformers import (  # noqa: E402
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

import subspace_ref as sr  # noqa: E402
from subspace_ref.hf import (  # noqa: E402
    SubspaceCache,
    adaptive_states,
    capture,
    causal_attention,
    decode_token_by_token,
    full_rank_states,
    prefix_view,
    rotating_states,
    static_states,
    subspace_attention_enabled,
    teacher_forced,
    use_subspace_attention,
)
from subspace_ref.hf.state_factories import StateSpec  # noqa: E402

torch.set_num_threads(1)
VOCAB = 128
FAMILIES = ("llama", "neox", "gpt2")


def make_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    if family == "llama":
        cfg = LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            initializer_range=0.2,
            max_position_embeddings=128,
        )
        model = LlamaForCausalLM(cfg)
    elif family == "neox":
        cfg = GPTNeoXConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=VOCAB,
            initializer_range=0.2,
            rotary_pct=0.25,
            max_position_embeddings=128,
        )
        model = GPTNeoXForCausalLM(cfg)
    else:
        cfg = GPT2Config(
            n_embd=64,
            n_layer=2,
            n_head=2,
            vocab_size=VOCAB,
            n_positions=128,
            initializer_range=0.2,
            scale_attn_by_inverse_layer_idx=True,
            bos_token_id=None,
            eos_token_id=None,
        )
        model = GPT2LMHeadModel(cfg)
    return model.eval().to(torch.float64)


_MODELS: dict = {}


def model_for(family: str):
    if family not in _MODELS:
        _MODELS[family] = make_model(family)
    return _MODELS[family]


def rel_tol(family: str) -> float:
    return 1e-5 if family == "llama" else 1e-10


def distinct_ids(n: int, seed: int) -> torch.Tensor:
    """Distinct token ids: the first d keys/values of every head then span R^d (a repeated
    token gives a repeated layer-0 value, since values carry no position)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(VOCAB, generator=g)[:n][None]


def assert_logits_close(a: torch.Tensor, b: torch.Tensor, family: str):
    scale = float(b.detach().abs().max())
    gap = float((a - b).detach().abs().max())
    assert gap <= rel_tol(family) * scale, f"max |gap| {gap:.3e} > {rel_tol(family):g} * {scale:.3f}"


# --------------------------------------------------------------------------- full rank = stock
FULL_KINDS = {"static": {}, "adaptive": {}, "rotating": {"refresh_every": 3}}


@pytest.mark.parametrize("kind", list(FULL_KINDS))
@pytest.mark.parametrize("family", FAMILIES)
def test_full_rank_cache_reproduces_dynamic_cache(family, kind):
    """Prefill (teacher-forced) logits and greedy generation (prefill + decode through
    subspace_ref.attend) with full-rank states equal the stock model with a DynamicCache."""
    model = model_for(family)
    # distinct ids, and a prompt longer than the head size (16; GPT-2: 32): the warm-up of
    # adaptive/rotating states (W = rank = head size) then sees d independent keys and values and
    # completes a full basis inside the prompt. (A repeated token in the first W gives a repeated layer-0
    # value, a zero warm-up row, and a lossy basis afterwards: full rank is exact only then.)
    ids = distinct_ids(40, seed=1)
    factory = full_rank_states(kind, **FULL_KINDS[kind])
    stock = teacher_forced(model, ids, None, keep_logits=True)
    ours = teacher_forced(model, ids, factory, keep_logits=True)
    assert_logits_close(ours.logits, stock.logits, family)

    prompt = ids[:, :34]
    ref = model.generate(
        prompt, max_new_tokens=6, do_sample=False, cache=DynamicCache(config=model.config), output_scores=True, return_dict_in_generate=True
    )
    with subspace_attention_enabled(model):
        cache = SubspaceCache(model.config, factory, backend="torch")
        got = model.generate(prompt, max_new_tokens=6, do_sample=False, cache=cache, output_scores=True, return_dict_in_generate=True)
    tol = rel_tol(family) * max(float(s.abs().max()) for s in ref.scores)
    for s in ref.scores:
        top2 = s[0].topk(2).values
        assert float(top2[0] - top2[1]) > 10 * tol
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.scores, ref.scores):
        assert float((a - b).abs().max()) <= tol
    assert cache.get_seq_length() == prompt.shape[1] + 6 - 1  # the last token is never fed back
    if kind == "rotating":
        assert cache.get_seq_length() > 3 + cache.states[0].policy.warmup  # refreshes happened


def test_model_keeps_stock_behaviour_without_subspace_cache():
    """The registered implementation without a SubspaceCache is transformers' sdpa."""
    model = make_model("llama", seed=3)
    ids = distinct_ids(10, seed=3)
    before = teacher_forced(model, ids, None, keep_logits=True).logits
    with subspace_attention_enabled(model):
        during = teacher_forced(model, ids, None, keep_logits=True).logits
        assert model.config._attn_implementation == "subspace_ref"
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(before, during)


# --------------------------------------------------------------------------- teacher forced = decoding
def compressing_factories(model_family: str):
    return {
        "static": None,  # calibrated in the test
        # small tau: several chunks per head within 24 tokens (no ceiling: spec A7.3 charges the
        # sketches, which outweigh 24 tokens' full cache, so a capped state opens none that soon)
        "adaptive": adaptive_states(rank_k=4, rank_v=6, tau_k=0.05, tau_v=0.05, max_chunk=7, warmup=2, byte_ceiling=math.inf),
        # refresh every 3 tokens: past coefficients rotate many times
        "rotating": rotating_states(rank_k=4, rank_v=6, refresh_every=3, warmup=2),
    }


def calibrated_bases(model, seed: int, energy: float = 0.9, **kwargs):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (1, 24), generator=g) for _ in range(3)]
    return capture(model, seqs).calibrate(energy=energy, **kwargs)


@pytest.mark.parametrize("kind", ["static", "adaptive", "rotating"])
@pytest.mark.parametrize("family", FAMILIES)
def test_teacher_forced_equals_token_by_token_decoding(family, kind):
    """One forward over the sequence (each position attending the compressed tokens <= itself
    as decoding sees them) equals T one-token forwards, whose attention is subspace_ref.attend."""
    model = model_for(family)
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(7))
    factory = compressing_factories(family)[kind]
    if factory is None:
        factory = static_states(calibrated_bases(model, seed=11, gamma="mse"))
    stock = teacher_forced(model, ids, None, keep_logits=True).logits
    tf = teacher_forced(model, ids, factory, keep_logits=True)
    dec = decode_token_by_token(model, ids, factory)
    assert_logits_close(tf.logits, dec, family)
    assert float((tf.logits - stock).abs().max()) > 1e-3  # compression is active
    # the cut-up variants compute the same thing
    blocks = teacher_forced(model, ids, factory, keep_logits=True, block_size=5).logits
    assert_logits_close(blocks, dec, family)


def test_online_states_really_chunk_and_rotate():
    """The states of the equality test above are not trivial: adaptive opens several chunks per
    head, rotating refreshes several times (past coefficients rewritten)."""
    model = model_for("llama")
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(7))
    factories = compressing_factories("llama")
    with subspace_attention_enabled(model):
        cache = SubspaceCache(model.config, factories["adaptive"])
        model(ids, cache=cache)
        assert all(int(s.num_chunks.min()) >= 3 for s in cache.states)
        cache = SubspaceCache(model.config, factories["rotating"])
        model(ids, cache=cache)
        st = cache.states[0]
        assert (24 - st.policy.warmup) // st.policy.refresh_every >= 5


def test_adaptive_factory_caches_never_outgrow_the_stock_cache():
    """The factory's byte ceiling (spec A7.3): at a tau that fires on nearly every token, the
    uncapped states hold several times the stock cache; the default ones, past the first chunk's
    fixed cost, at most the stock cache (sketches and gamma, fixed-size, aside)."""
    from subspace_ref.layout import BY_NAME, FIXED, counted_nbytes

    fixed = [name for name, a in BY_NAME.items() if a.axis == FIXED]
    model = model_for("llama")
    ids = torch.randint(0, VOCAB, (1, 120), generator=torch.Generator().manual_seed(3))
    held = {}
    with subspace_attention_enabled(model):
        for name, ceiling in (("capped", {}), ("uncapped", {"byte_ceiling": math.inf})):
            cache = SubspaceCache(model.config, adaptive_states(rank_k=4, rank_v=4, tau_k=0.01, tau_v=0.01, **ceiling))
            model(ids, cache=cache)
            held[name] = sum(s.nbytes - counted_nbytes(s, fixed) for s in cache.states)
            full = cache.full_cache_nbytes
    assert held["uncapped"] > 2 * full
    assert held["capped"] <= full


@pytest.mark.parametrize("kind", ["static", "adaptive", "rotating"])
def test_prefill_per_position_attend_equals_coefficient_path(kind):
    """prefill="attend" (subspace_ref.attend once per prompt position over the prefix view)
    and the vectorised causal coefficient-space path agree."""
    model = model_for("llama")
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(5))
    factory = compressing_factories("llama")[kind] or static_states(calibrated_bases(model, seed=2))
    a = teacher_forced(model, ids, factory, keep_logits=True).logits
    b = teacher_forced(model, ids, factory, keep_logits=True, prefill="attend").logits
    assert_logits_close(a, b, "llama")


WINDOWED = {
    # threshold and window: nothing compressed for the first 10 tokens, then all but the last 4
    "static": {"window": 4, "min_tokens": 10},
    "static+sinks": {"window": 3, "sinks": 2},
    "adaptive": {"window": 4, "min_tokens": 6},
    "adaptive+lookahead": {"window": 4, "lookahead": 2},  # numpy backend: torch refuses lookahead
    "rotating+sinks": {"window": 3, "sinks": 2},
}


def windowed_factory(model, name: str):
    options = WINDOWED[name]
    if name.startswith("static"):
        return static_states(calibrated_bases(model, seed=2), **options)
    kind = name.split("+")[0]
    return dict(adaptive=adaptive_states, rotating=rotating_states)[kind](
        rank_k=4, rank_v=6, warmup=2, **options, **({"tau_k": 0.05, "tau_v": 0.05, "max_chunk": 7} if kind == "adaptive" else {"refresh_every": 3})
    )


@pytest.mark.parametrize("name", list(WINDOWED))
def test_windowed_prefill_in_one_block_equals_token_by_token_decoding(name):
    """spec/window.md: a prompt of 24 tokens (tokens leave the exact window inside the block)
    in one forward, and in blocks of 5, equals decoding token by token, where each step appends
    one token and calls subspace_ref.attend (window and sinks attended exactly, W3, W8)."""
    model = model_for("llama")
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(7))
    factory = windowed_factory(model, name)
    backend = "numpy" if "lookahead" in name else "torch"
    dec = decode_token_by_token(model, ids, factory, backend=backend)
    whole = teacher_forced(model, ids, factory, keep_logits=True, backend=backend)
    assert_logits_close(whole.logits, dec, "llama")
    assert_logits_close(teacher_forced(model, ids, factory, keep_logits=True, block_size=5, backend=backend).logits, dec, "llama")
    assert_logits_close(teacher_forced(model, ids, factory, keep_logits=True, prefill="attend", backend=backend).logits, dec, "llama")
    stock = teacher_forced(model, ids, None, keep_logits=True).logits
    assert float((whole.logits - stock).abs().max()) > 1e-3  # tokens really left the window


LOW_BIT = {"int4": {"coefficients": "int4", "group_size": 4}, "int2+window+sinks": {"coefficients": "int2", "group_size": 4, "window": 3, "sinks": 2}}


@pytest.mark.parametrize("backend", ["torch", "numpy"])
@pytest.mark.parametrize("name", list(LOW_BIT))
def test_low_bit_prefill_in_one_block_equals_token_by_token_decoding(name, backend):
    """spec/quantization.md Q2: a key group's tokens are read from the float tail until the group
    is finished, then quantised with scales from all its tokens. A prompt in one forward (and in
    blocks of 5) equals decoding token by token: no query sees a group finished by a later token
    of its block (which would also leak later tokens into its scales). Until 2026-11-25 the block
    was one causal evaluation after one append, and this failed (logits ~1e-3 apart)."""
    model = model_for("llama")
    ids = torch.randint(0, VOCAB, (1, 23), generator=torch.Generator().manual_seed(7))
    factory = static_states(calibrated_bases(model, seed=2), **LOW_BIT[name])
    dec = decode_token_by_token(model, ids, factory, backend=backend)
    assert_logits_close(teacher_forced(model, ids, factory, keep_logits=True, backend=backend).logits, dec, "llama")
    assert_logits_close(teacher_forced(model, ids, factory, keep_logits=True, block_size=5, backend=backend).logits, dec, "llama")


# --------------------------------------------------------------------------- what is compressed
class ProjectingCache(DynamicCache):
    """Stock reference: a DynamicCache storing K P_B and V P_E per KV head (post-RoPE).

    With gamma = 1, coefficient-space attention over a static state equals exact attention over
    these projected keys and values (spec A2: q~ . c = q^T P_B k, (alpha^T D) E = alpha^T V P_E).
    """

    def __init__(self, config, bases):
        super().__init__(config=config)
        self.P = [(torch.from_numpy(np.einsum("hrd,hre->hde", b.B, b.B)), torch.from_numpy(np.einsum("hrd,hre->hde", b.E, b.E))) for b in bases]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        PB, PE = self.P[layer_idx]
        return super().update(key_states @ PB, value_states @ PE, layer_idx, *args, **kwargs)


@pytest.mark.parametrize("compress", ["both", "keys", "values"])
@pytest.mark.parametrize("family", FAMILIES)
def test_static_cache_equals_attention_over_projected_keys_values(family, compress):
    """Per-head ranks from energy, keys projected after RoPE where the cache receives them, GQA
    mapping, GPT-2's per-layer scaling: the compressed cache equals the stock model whose cache
    stores the projections (keys-only / values-only: the other side's projector is I)."""
    model = model_for(family)
    bases = calibrated_bases(model, seed=4, energy=0.8)
    assert any(len(set(b.rank_k)) > 1 or len(set(b.rank_v)) > 1 for b in bases)  # per-head ranks exercised
    ids = torch.randint(0, VOCAB, (1, 14), generator=torch.Generator().manual_seed(9))
    eye_k = [sr.StaticBasis.from_bases(np.broadcast_to(np.eye(b.B.shape[2]), (b.heads,) + (b.B.shape[2],) * 2), b.E) for b in bases]
    ref_bases = [
        sr.StaticBasis.from_bases(
            b.B if compress != "values" else e.B,
            b.E if compress != "keys" else np.broadcast_to(np.eye(b.E.shape[2]), (b.heads,) + (b.E.shape[2],) * 2),
        )
        for b, e in zip(bases, eye_k)
    ]
    ref = model(ids, cache=ProjectingCache(model.config, ref_bases), use_cache=True).logits
    prompt_then_decode = decode_token_by_token(model, ids, static_states(bases, compress=compress))
    got = teacher_forced(model, ids, static_states(bases, compress=compress), keep_logits=True).logits
    assert_logits_close(got, ref, family)
    assert_logits_close(prompt_then_decode, ref, family)


def test_cache_holds_coefficients_only():
    model = model_for("llama")
    bases = calibrated_bases(model, seed=4, energy=0.8)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    with subspace_attention_enabled(model):
        cache = SubspaceCache(model.config, static_states(bases))
        model.generate(ids, max_new_tokens=4, do_sample=False, cache=cache)
    for layer, b in zip(cache.layers, bases):
        assert layer.keys is None and layer.values is None
        assert layer.pending_keys is None
        assert layer.state.layout.key_coef.shape[-1] == max(b.rank_k) < 16
        assert layer.state.num_tokens == 15
    # per token the states hold r + r_v coefficients instead of 2 d numbers (bases aside)
    assert sum(s.nbytes - s.basis_nbytes for s in cache.states) < cache.full_cache_nbytes


# --------------------------------------------------------------------------- INT8, numpy backend, batches
@pytest.mark.parametrize("kind", ["static", "adaptive", "rotating"])
def test_int8_coefficients_teacher_forced_equals_decoding_on_numpy_backend(kind):
    """INT8 coefficients (spec A10) through the numpy backend: teacher forcing still equals
    decoding, and stays near the float cache."""
    model = model_for("neox")
    ids = torch.randint(0, VOCAB, (1, 14), generator=torch.Generator().manual_seed(3))
    if kind == "static":
        bases = calibrated_bases(model, seed=6)
        q8, fl = static_states(bases, coefficients="int8"), static_states(bases)
    else:
        cls = adaptive_states if kind == "adaptive" else rotating_states
        # uncapped: the byte ceiling charges int8 and float tokens differently, so the two would chunk apart
        extra = {"tau_k": 0.1, "tau_v": 0.1, "max_chunk": 6, "byte_ceiling": math.inf} if kind == "adaptive" else {"refresh_every": 4}
        q8 = cls(rank_k=6, rank_v=6, coefficients="int8", **extra)
        fl = cls(rank_k=6, rank_v=6, **extra)
    tf = teacher_forced(model, ids, q8, backend="numpy", keep_logits=True)
    dec = decode_token_by_token(model, ids, q8, backend="numpy")
    assert_logits_close(tf.logits, dec, "neox")
    float_logits = teacher_forced(model, ids, fl, keep_logits=True).logits
    gap = float((tf.logits - float_logits).abs().max())
    assert 0 < gap < 0.1 * float(float_logits.abs().max())


def test_int8_state_on_torch_backend_matches_numpy_backend():
    """The torch backend reads int8 coefficients (spec A10) as the oracle does."""
    model = model_for("gpt2")
    ids = torch.randint(0, VOCAB, (1, 4), generator=torch.Generator().manual_seed(4))
    states = full_rank_states("static", coefficients="int8")
    on_torch = teacher_forced(model, ids, states, backend="torch", keep_logits=True).logits
    on_numpy = teacher_forced(model, ids, states, backend="numpy", keep_logits=True).logits
    assert_logits_close(on_torch, on_numpy, "gpt2")


def test_batch_of_sequences_equals_each_alone():
    model = model_for("llama")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(8))
    factory = adaptive_states(rank_k=4, rank_v=4, tau_k=0.1, tau_v=0.1)
    both = teacher_forced(model, ids, factory, keep_logits=True).logits
    for b in range(2):
        alone = teacher_forced(model, ids[b], factory, keep_logits=True).logits
        assert_logits_close(both[b : b + 1], alone, "llama")


# --------------------------------------------------------------------------- the causal evaluator
@pytest.mark.parametrize("quant", ["float", "int8"])
@pytest.mark.parametrize("kind", ["static", "adaptive", "adaptive-few-chunks", "rotating"])
def test_causal_attention_equals_attend_over_prefix(rng, kind, quant):
    """causal_attention row i == subspace_ref.attend over the state after first+i+1 appends
    (static/adaptive: the prefix view; rotating: no refresh inside the block)."""
    H, g, d, T0, n = 2, 2, 8, 5, 25 if kind == "adaptive-few-chunks" else 9
    K = rng.standard_normal((1, H, T0 + n, d))
    V = rng.standard_normal((1, H, T0 + n, d))
    spec = StateSpec(0, 1, H, d, d, torch.float64, torch.device("cpu"))
    if kind == "static":
        B = np.stack([np.linalg.qr(rng.standard_normal((d, d)))[0].T for _ in range(H)])[:, :5]
        E = np.stack([np.linalg.qr(rng.standard_normal((d, d)))[0].T for _ in range(H)])[:, :4]
        B[1, 3:] = 0  # per-head key ranks 5 and 3
        E[0, 2:] = 0  # per-head value ranks 2 and 4
        basis = sr.StaticBasis.from_bases(B, E, [1.3, 0.7])
        factory = static_states([basis], coefficients=quant)
    elif kind == "adaptive":  # J r > T: each token's key and value rebuilt once
        # many chunks on purpose: the uncapped policy (the factory's byte ceiling would keep few)
        factory = adaptive_states(rank_k=(3, 2), rank_v=3, tau_k=0.3, tau_v=0.3, max_chunk=4, coefficients=quant, byte_ceiling=math.inf)
    elif kind == "adaptive-few-chunks":  # J r <= T: queries projected on each chunk's basis
        factory = adaptive_states(rank_k=(7, 6), rank_v=7, tau_k=0.9, tau_v=0.9, max_chunk=10, coefficients=quant, byte_ceiling=math.inf)
    else:
        factory = rotating_states(rank_k=3, rank_v=(3, 2), refresh_every=100, coefficients=quant)
    state = factory(spec)
    step_by_step = []
    for t in range(T0 + n):
        state.append(K[:, :, t], V[:, :, t])
        if t >= T0:
            step_by_step.append(sr.attend(q_at(rng, t, H * g, d), state, scale=0.3))
    if kind == "adaptive":
        assert int(state.num_chunks.min()) >= 3 and int(state.num_chunks.max()) * 3 > T0 + n
    if kind == "adaptive-few-chunks":
        assert 2 <= int(state.num_chunks.max()) and int(state.num_chunks.max()) * 7 <= T0 + n
    Q = torch.from_numpy(np.stack([q_at(rng, t, H * g, d) for t in range(T0, T0 + n)], axis=2))
    got = causal_attention(Q, state, T0, scale=0.3).numpy()
    for i, want in enumerate(step_by_step):
        np.testing.assert_allclose(got[:, :, i], want, rtol=1e-12, atol=1e-12)
        view = sr.attend(Q[:, :, i].numpy(), prefix_view(state, T0 + i + 1), scale=0.3)
        np.testing.assert_allclose(view, want, rtol=1e-12, atol=1e-12)


def q_at(rng, t, Hq, d):
    """A query per position, reproducible from t alone (so the loop and the block see the same)."""
    return np.random.default_rng(1000 + t).standard_normal((1, Hq, d))


# --------------------------------------------------------------------------- capture
@pytest.mark.parametrize("family", FAMILIES)
def test_capture_records_what_the_cache_receives(family):
    """capture's keys/values are exactly what DynamicCache.update stores (post-RoPE), per KV
    head; queries have H_q heads."""
    model = model_for(family)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    cap = capture(model, ids)
    cache = DynamicCache(config=model.config)
    model(ids, cache=cache, use_cache=True)
    for layer, (k, v, _) in zip(cap.layers, cache):
        want_k = k.detach().permute(1, 0, 2, 3).reshape(k.shape[1], -1, k.shape[3]).numpy()
        want_v = v.detach().permute(1, 0, 2, 3).reshape(v.shape[1], -1, v.shape[3]).numpy()
        np.testing.assert_array_equal(layer.keys, want_k)
        np.testing.assert_array_equal(layer.values, want_v)
        assert layer.queries.shape[0] == model.config.num_attention_heads
        assert layer.queries.shape[1] == 18
    spectra = cap.spectra()
    assert spectra[0]["keys"].shape == (cap.layers[0].heads, min(18, cap.layers[0].keys.shape[2]))


def test_capture_without_rope_undoes_the_rotation():
    """rope=False gives the pre-RoPE keys: Llama's k_proj output; NeoX's key slice of
    query_key_value (partial rotary)."""
    for family in ("llama", "neox"):
        model = model_for(family)
        ids = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(4))
        seen = {}
        if family == "llama":
            attn = model.model.layers[1].self_attn
            hook = attn.k_proj.register_forward_hook(lambda m, i, o: seen.update(k=o))
        else:
            attn = model.gpt_neox.layers[1].attention
            hook = attn.query_key_value.register_forward_hook(lambda m, i, o: seen.update(k=o))
        cap = capture(model, ids, rope=False)
        hook.remove()
        if family == "llama":
            k = seen["k"].view(1, 11, -1, 16).transpose(1, 2)
        else:
            k = seen["k"].view(1, 11, -1, 48).transpose(1, 2)[..., 16:32]
        np.testing.assert_allclose(cap.layers[1].keys, k[0].detach().numpy(), rtol=0, atol=1e-12)
        post = capture(model, ids)
        assert np.abs(post.layers[1].keys - cap.layers[1].keys).max() > 1e-3


# --------------------------------------------------------------------------- refusals
def test_cache_refuses_a_model_with_another_attention_implementation():
    model = make_model("llama", seed=5)
    cache = SubspaceCache(model.config, full_rank_states())
    with pytest.raises(RuntimeError, match="use_subspace_attention"):
        model(torch.tensor([[1, 2, 3]]), cache=cache)


def test_cache_refuses_padding_for_rotating_states():
    """Static and adaptive states take padding masks (tests/test_hf_generation.py); a rotating
    state rewrites past coefficients at refreshes and refuses them, leaving nothing appended."""
    model = make_model("gpt2", seed=5)
    use_subspace_attention(model)
    cache = SubspaceCache(model.config, full_rank_states("rotating", refresh_every=3))
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with pytest.raises(NotImplementedError, match="padding"):
        model(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), attention_mask=mask, cache=cache)
    assert all(layer.pending_keys is None for layer in cache.layers)


def test_static_basis_of_wrong_shape_is_refused():
    model = make_model("llama", seed=6)
    bad = sr.StaticBasis.from_bases(np.eye(8)[None, :4].repeat(2, 0), np.eye(8)[None, :4].repeat(2, 0))
    with pytest.raises(ValueError, match="basis has 2 heads of size 8"):
        teacher_forced(model, [1, 2, 3], static_states([bad, bad]))


def test_default_model_full_rank_smoke():
    """The project's shipped model (float32, load_model) through the cache at full rank."""
    dm = pytest.importorskip("subspace_ref.models.default_model")
    model, _ = dm.load_model("default")
    ids = dm.encode("def f(x):\n    return x + 1\n")[:24]
    stock = teacher_forced(model, ids, None, keep_logits=True)
    ours = teacher_forced(model, ids, full_rank_states(), keep_logits=True)
    # float32 model: one float32 rounding (2^-24) per reduction of n <= 768 terms, 4 layers
    assert float((ours.logits - stock.logits).abs().max()) <= 1e-3 * float(stock.logits.abs().max())
    assert abs(ours.ppl - stock.ppl) / stock.ppl < 1e-4
