"""Spec A7.2.1 / B11: what the reproject trigger guarantees per stored token (issue 19 item 1)."""

import math

import numpy as np
import pytest

import subspace_ref as sr

from test_adaptive_state import drifting_stream

PAPER = dict(trigger="paper", byte_ceiling=math.inf)  # seed 001's policy (spec A7 verbatim), which these tests encode


@pytest.mark.parametrize("trigger", ["reproject", "paper"])
@pytest.mark.parametrize("rk, rv", [(16, 12), (12, 16)])
@pytest.mark.parametrize("max_chunk", [1, 3, 7, 50])
def test_full_rank_is_exact_for_any_chunk_boundaries(rng, rk, rv, max_chunk, trigger):
    """A7.2.1 corollary: at full rank (r = d, r_v = d_v) every token is stored exactly, whatever the
    chunk lengths and whichever side has the larger rank (issue 19: 68% key error before)."""
    H, T = 3, 60
    K, V = rng.standard_normal((H, T, rk)), rng.standard_normal((H, T, rv))
    state = sr.SubspaceState.adaptive(H, rk, rv, rank_k=rk, rank_v=rv, max_chunk=max_chunk, trigger=trigger, byte_ceiling=math.inf).append(K[:, :23], V[:, :23])
    state.append(K[:, 23:], V[:, 23:])
    K_hat, V_hat = state.reconstruct()
    np.testing.assert_allclose(K_hat, K, atol=1e-11)
    np.testing.assert_allclose(V_hat, V, atol=1e-11)
    if max_chunk < 12:
        assert (state.num_chunks > 1).all()  # the boundaries really cut through the warm-up


def test_full_rank_attention_matches_exact(rng):
    H, d, d_v, T = 3, 16, 12, 40
    K, V, q = rng.standard_normal((H, T, d)), rng.standard_normal((H, T, d_v)), rng.standard_normal((H, d))
    state = sr.SubspaceState.adaptive(H, d, d_v, rank_k=16, rank_v=12, max_chunk=7, trigger="reproject").append(K, V)
    logits = np.einsum("hd,htd->ht", q, K) / np.sqrt(d)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("ht,htd->hd", w / w.sum(-1, keepdims=True), V)
    np.testing.assert_allclose(sr.attend(q, state), want, rtol=1e-10, atol=1e-12)


def _residual(x, B):
    return np.linalg.norm(x - B.T @ (B @ x))


@pytest.mark.parametrize("tau", [0.1, 0.3])
def test_every_stored_token_within_tau_or_the_sketch_tail(rng, tau):
    """A7.2.1 (a)-(c) on drifting streams: tokens inside a chunk have residual <= tau; a chunk's
    first token is bounded by sqrt(sigma_{r+1}(A)^2 + eps) of the rows sketched so far (no reset,
    so A = all tokens <= t); under the paper order the firing tokens exceed tau."""
    H, T, d, r, ell = 2, 300, 10, 3, 8
    K = np.stack([drifting_stream(rng, T, d, 3, 70) for _ in range(H)])
    V = np.stack([drifting_stream(rng, T, d, 2, 90) for _ in range(H)])
    state = sr.SubspaceState.adaptive(H, d, rank_k=r, rank_v=r, ell_k=ell, ell_v=ell, tau_k=tau, tau_v=tau, max_chunk=10**6, trigger="reproject", byte_ceiling=math.inf).append(K, V)
    paper = sr.SubspaceState.adaptive(H, d, rank_k=r, rank_v=r, ell_k=ell, ell_v=ell, tau_k=tau, tau_v=tau, max_chunk=10**6, trigger="paper", byte_ceiling=math.inf).append(K, V)
    firsts = 0
    for h in range(H):
        for j, (a, b) in enumerate(state.chunk_bounds(h)):
            B, E = state.layout.key_bases[0, h, j], state.layout.value_bases[0, h, j]
            for t in range(a, b):
                if t == a and j > 0:  # (b): the firing token, against the sketch's tail
                    firsts += 1
                    for X, Bx in ((K, B), (V, E)):
                        s = np.linalg.svd(X[h, : t + 1], compute_uv=False)
                        eps = (s[r:] ** 2).sum() / (ell - r)
                        tail = s[r] ** 2 if len(s) > r else 0.0
                        assert _residual(X[h, t], Bx) <= np.sqrt(tail + eps) * (1 + 1e-9) + 1e-12
                else:  # (a) and (c)
                    assert _residual(K[h, t], B) <= tau * np.linalg.norm(K[h, t]) * (1 + 1e-9) + 1e-12
                    assert _residual(V[h, t], E) <= tau * np.linalg.norm(V[h, t]) * (1 + 1e-9) + 1e-12
    assert firsts > 10
    # the paper's order leaves each firing token with its residual above tau in the closing chunk
    over = 0
    for h in range(H):
        bounds = paper.chunk_bounds(h)
        for j, (a, b) in enumerate(bounds[:-1]):
            t = b - 1
            B, E = paper.layout.key_bases[0, h, j], paper.layout.value_bases[0, h, j]
            over += _residual(K[h, t], B) > tau * np.linalg.norm(K[h, t]) or _residual(V[h, t], E) > tau * np.linalg.norm(V[h, t])
    assert over > 10


def test_paper_order_is_kept_as_an_option(rng):
    K = rng.standard_normal((1, 40, 6))
    state = sr.SubspaceState.adaptive(1, 6, rank_k=2, rank_v=2, tau_k=0.2, tau_v=0.2, trigger="paper").append(K, K)
    assert state.policy.trigger == "paper"
    with pytest.raises(ValueError, match="trigger must be one of"):
        sr.SubspaceState.adaptive(1, 6, rank_k=2, rank_v=2, trigger="later")


@pytest.mark.parametrize("trigger", ["reproject", "paper"])
@pytest.mark.parametrize("sketch_reset", [False, True])
def test_torch_matches_the_oracle(rng, trigger, sketch_reset):
    torch = pytest.importorskip("torch")
    H, T, d, d_v = 2, 120, 8, 6
    K = np.stack([drifting_stream(rng, T, d, 3, 40) for _ in range(H)])
    V = np.stack([drifting_stream(rng, T, d_v, 2, 50) for _ in range(H)])
    kw = dict(rank_k=4, rank_v=2, ell_k=6, ell_v=4, tau_k=0.3, tau_v=0.3, max_chunk=9, trigger=trigger, sketch_reset=sketch_reset)
    ref = sr.SubspaceState.adaptive(H, d, d_v, **kw).append(K, V)
    got = sr.SubspaceState.adaptive(H, d, d_v, **kw).to("torch")
    got.append(torch.from_numpy(K[:, :37]), torch.from_numpy(V[:, :37])).append(torch.from_numpy(K[:, 37:]), torch.from_numpy(V[:, 37:]))
    got = got.to("numpy")
    np.testing.assert_array_equal(got.num_chunks, ref.num_chunks)
    np.testing.assert_array_equal(got.layout.chunk_starts[..., : ref.num_chunks.max()], ref.layout.chunk_starts[..., : ref.num_chunks.max()])
    for a, b in zip(got.reconstruct(), ref.reconstruct()):
        np.testing.assert_allclose(a, b, atol=1e-10)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("max_chunk", [1, 4, 7])
def test_a_chunk_closed_by_the_length_cap_holds_max_chunk_tokens_under_both_orders(rng, backend, max_chunk):
    """Spec A7.2: the cap counts the tokens held when t is decided, so on a stream that never
    fires by residual once the sketch has seen it (one direction), the chunks the cap closes
    hold exactly max_chunk tokens under both orders (the first chunks, closed while the empty
    sketch is learning the direction, and the open last chunk may be shorter)."""
    if backend == "torch":
        pytest.importorskip("torch")
    direction = rng.standard_normal(8)
    K = np.tile(direction, (2, 40, 1)) * rng.uniform(0.5, 2.0, (2, 40, 1))
    for trigger in ("paper", "reproject"):
        state = sr.SubspaceState.adaptive(2, 8, rank_k=2, rank_v=2, tau_k=0.5, tau_v=0.5, max_chunk=max_chunk, warmup=0, trigger=trigger, byte_ceiling=math.inf)
        state = state if backend == "numpy" else state.to("torch")
        state.append(K if backend == "numpy" else __import__("torch").from_numpy(K), K if backend == "numpy" else __import__("torch").from_numpy(K))
        bounds = [b - a for a, b in state.chunk_bounds(0)]
        closed = [n for n in bounds[:-1] if n]  # the paper order leaves an empty open chunk at the end
        assert len(closed) >= 3 and closed[-3:] == [max_chunk] * 3, (trigger, bounds)
