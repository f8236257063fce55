"""Pre-RoPE bases with sinks and a window through the transformers cache (issue 42 item 3):
spec/window.md W10 in :func:`subspace_ref.hf.causal_attention.causal_attention` (the prefill) and in
``subspace_ref.attend`` (a decode step), on a tiny random Llama (tests/test_hf_cache.py) whose
pre-RoPE keys and values lie in low-rank subspaces.

Why low rank: with a full-rank pre-RoPE basis, a compressed token rebuilt at a wrong position is
still a rotation of the right key only by accident of the test (W10's remark); with rank r < d a
key un-rotated at its position ``S + t`` and rotated back there is exact (P3 on the span, W10.1),
while one rotated back at ``t`` (the offset S forgotten) is ``R_t k`` instead of ``R_(S+t) k``:
the logits move by O(1). The other pre-RoPE tests of the cache use identity bases and no sinks.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from subspace_ref.hf_requirements import MIN_TRANSFORMERS

pytest.importorskip("transformers", minversion=MIN_TRANSFORMERS)  # older: generate has no cache= (skipped, both versions named)

from transformers import DynamicCache  # noqa: E402

import subspace_ref as sr  # noqa: E402
from subspace_ref.hf import SubspaceCache, decode_token_by_token, static_states, subspace_attention_enabled  # noqa: E402
from subspace_ref.rope import RopeParams  # noqa: E402
from tests.test_hf_cache import VOCAB, assert_logits_close, make_model  # noqa: E402

torch.set_num_threads(1)

RANK_K, RANK_V = 4, 6  # of head size 16
SINKS, WINDOW = 3, 4
PROMPT, DECODED = 15, 1  # after the prompt: 15 - 3 - 4 = 8 compressed tokens per head


def random_rows(rng, heads: int, rank: int, d: int) -> np.ndarray:
    """(heads, rank, d) orthonormal rows."""
    return np.stack([np.linalg.qr(rng.standard_normal((d, rank)))[0].T for _ in range(heads)])


_LOW_RANK: dict = {}


def low_rank_llama():
    """(model, bases): the tiny float64 Llama of tests/test_hf_cache.py with each layer's k_proj
    and v_proj rows projected, per KV head, on random rank-4 (keys) and rank-6 (values)
    subspaces, and those subspaces as one StaticBasis per layer. Llama's k_proj output is the
    pre-RoPE key (no bias, no key norm), so every pre-RoPE key lies in span(B_h) and every value
    in span(E_h): spec/window.md W10.1's hypothesis."""
    if not _LOW_RANK:
        model = copy.deepcopy(make_model("llama", seed=11))
        cfg = model.config
        H, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
        rng = np.random.default_rng(42)
        bases = []
        for layer in model.model.layers:
            B, E = random_rows(rng, H, RANK_K, d), random_rows(rng, H, RANK_V, d)
            with torch.no_grad():
                for proj, rows in ((layer.self_attn.k_proj, B), (layer.self_attn.v_proj, E)):
                    W = proj.weight.view(H, d, -1)
                    P = torch.from_numpy(np.einsum("hrd,hre->hde", rows, rows))  # B^T B per head
                    W.copy_(torch.einsum("hde,hek->hdk", P, W))
            bases.append(sr.StaticBasis.from_bases(B, E, 1.0))
        _LOW_RANK.update(model=model, bases=bases)
    return _LOW_RANK["model"], _LOW_RANK["bases"]


def factory(model, bases):
    return static_states(bases, rope=RopeParams.from_config(model.config), sinks=SINKS, window=WINDOW)


def prompt_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, PROMPT + DECODED), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_prefill_and_decode_with_low_rank_pre_rope_bases_sinks_and_window_are_exact(backend):
    """Spec/window.md W10.1 through SubspaceCache: a prompt of 15 tokens in one forward (the
    causal coefficient-space evaluator: 8 tokens leave the window inside the block, compressed
    token t rebuilt at position S + t, W10 step 2) and then one decode step (``attend`` on the
    backend: the numpy oracle or torch) give the stock model's logits, because the keys and
    values lie in the bases' spans. The prefill also equals the oracle decoding token by token
    (``decode_token_by_token`` on the numpy backend, each step one ``subspace_ref.attend``)."""
    model, bases = low_rank_llama()
    ids = prompt_ids()
    prompt, step = ids[:, :PROMPT], ids[:, PROMPT:]
    stock_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        stock_prefill = model(prompt, cache=stock_cache).logits
        stock_step = model(step, cache=stock_cache).logits
    with subspace_attention_enabled(model), torch.no_grad():
        cache = SubspaceCache(model.config, factory(model, bases), backend=backend)
        prefill = model(prompt, cache=cache).logits
        state = cache.states[0]
        # really compressed, low rank, sinks held exactly (W7): 15 = 3 sinks + 8 compressed + 4 recent
        assert (state.window.sink_count, state.layout.num_tokens, state.window.recent) == (SINKS, PROMPT - SINKS - WINDOW, WINDOW)
        assert state.layout.key_coef.shape[-1] == RANK_K and state.layout.value_coef.shape[-1] == RANK_V
        decoded = model(step, cache=cache).logits
    assert_logits_close(prefill, stock_prefill, "llama")
    assert_logits_close(decoded, stock_step, "llama")
    oracle = decode_token_by_token(model, prompt, factory(model, bases), backend="numpy")
    assert_logits_close(prefill, oracle, "llama")
