"""Spec A7.2.1 / B11: what the reproject trigger guarantees per stored token (issue 19 item 1)."""

import copy
import math

import numpy as np
import pytest

import subspace_ref as sr
from subspace_ref.arrays import to_numpy

from test_adaptive_state import drifting_stream

PAPER = dict(trigger="paper", byte_ceiling=math.inf)  # seed 001's policy (spec A7 verbatim), which these tests encode


@pytest.mark.parametrize("trigger", ["reproject", "paper"])
@pytest.mark.parametrize("rk, rv", [(16, 12), (12, 16)])
@pytest.mark.parametrize("max_chunk", [1, 3, 7, 50])
def test_full_rank_is_exact_for_any_chunk_boundaries(rng, rk, rv, max_chunk, trigger):
    """A7.2.1 corollary (without tracking): at full rank (r = d, r_v = d_v) every token is stored
    exactly, whatever the chunk lengths and whichever side has the larger rank (issue 19: 68% key
    error before)."""
    H, T = 3, 60
    K, V = rng.standard_normal((H, T, rk)), rng.standard_normal((H, T, rv))
    state = sr.SubspaceState.adaptive(
        H, rk, rv, rank_k=rk, rank_v=rv, max_chunk=max_chunk, trigger=trigger, byte_ceiling=math.inf, track=False
    ).append(K[:, :23], V[:, :23])
    state.append(K[:, 23:], V[:, 23:])
    K_hat, V_hat = state.reconstruct()
    np.testing.assert_allclose(K_hat, K, atol=1e-11)
    np.testing.assert_allclose(V_hat, V, atol=1e-11)
    if max_chunk < 12:
        assert (state.num_chunks > 1).all()  # the boundaries really cut through the warm-up


@pytest.mark.parametrize("max_chunk", [1, 7, 50])
def test_full_rank_under_tracking_is_within_tau_and_exact_once_the_rows_are_in_use(rng, max_chunk):
    """A7.4.1 at full rank: every token within tau (tracking builds rows only for tokens over
    tau), and a chunk whose rows are all in use stores every later token exactly."""
    H, d, T, tau = 3, 8, 120, 0.3
    K, V = rng.standard_normal((H, T, d)), rng.standard_normal((H, T, d))
    state = sr.SubspaceState.adaptive(H, d, rank_k=d, rank_v=d, tau_k=tau, tau_v=tau, max_chunk=max_chunk, byte_ceiling=math.inf).append(K, V)
    K_hat, V_hat = state.reconstruct()
    for X, X_hat in ((K, K_hat), (V, V_hat)):
        assert (np.linalg.norm(X - X_hat, axis=-1) <= tau * np.linalg.norm(X, axis=-1) * (1 + 1e-9)).all()
    assert state.tokens_over_tau == 0
    for h in range(H):
        for j, (a, b) in enumerate(state.chunk_bounds(h)):
            full = (np.linalg.norm(state.layout.key_bases[0, h, j], axis=-1) > 0).all()
            if full and b - a > 0:  # the last token of a full chunk came after its rows were complete or made them
                np.testing.assert_allclose(K_hat[h, b - 1], K[h, b - 1], atol=1e-10)


def test_full_rank_attention_matches_exact(rng):
    H, d, d_v, T = 3, 16, 12, 40
    K, V, q = rng.standard_normal((H, T, d)), rng.standard_normal((H, T, d_v)), rng.standard_normal((H, d))
    state = sr.SubspaceState.adaptive(H, d, d_v, rank_k=16, rank_v=12, max_chunk=7, trigger="reproject", track=False).append(K, V)
    logits = np.einsum("hd,htd->ht", q, K) / np.sqrt(d)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("ht,htd->hd", w / w.sum(-1, keepdims=True), V)
    np.testing.assert_allclose(sr.attend(q, state), want, rtol=1e-10, atol=1e-12)


def _residual(x, B):
    return np.linalg.norm(x - B.T @ (B @ x))


def relative_errors(state, K, V):
    """Per head and token, ||k - k_hat|| / ||k|| and the same for values, from the reconstruction."""
    K_hat, V_hat = state.reconstruct()
    return np.linalg.norm(K - K_hat, axis=-1) / np.linalg.norm(K, axis=-1), np.linalg.norm(V - V_hat, axis=-1) / np.linalg.norm(V, axis=-1)


def subspace_stream(rng, T, d, rank, segment, noise=0.01):
    """Issue 40's drifting stream: a new random rank-``rank`` subspace every ``segment`` tokens,
    Gaussian coefficients, plus noise of ``noise`` times each token's norm (0: exactly in it)."""
    out = np.empty((T, d))
    for start in range(0, T, segment):
        n = min(segment, T - start)
        x = rng.standard_normal((n, rank)) @ np.linalg.qr(rng.standard_normal((d, rank)))[0].T
        out[start : start + n] = x + noise * np.linalg.norm(x, axis=1, keepdims=True) / np.sqrt(d) * rng.standard_normal((n, d))
    return out


@pytest.mark.parametrize("ceiling", [math.inf, 1.0])
@pytest.mark.parametrize("tau", [0.1, 0.3])
@pytest.mark.parametrize("cuts", [(), (1, 2, 37, 150)])
def test_every_stored_token_within_tau_on_drifting_streams(rng, tau, ceiling, cuts):
    """A7.4.1 (the default, tracking): EVERY stored token, the first of each chunk included, has
    ||x - x_hat|| <= tau ||x|| on keys and values, or is counted in ``tokens_over_tau`` (only when
    the ceiling refused its chunk): the count is exactly the measured number over tau."""
    H, T, d, r = 2, 300, 10, 3
    K = np.stack([drifting_stream(rng, T, d, 3, 70) for _ in range(H)])
    V = np.stack([drifting_stream(rng, T, d, 2, 90) for _ in range(H)])
    state = sr.SubspaceState.adaptive(H, d, rank_k=r, rank_v=r, ell_k=8, ell_v=8, tau_k=tau, tau_v=tau, max_chunk=10**6, byte_ceiling=ceiling)
    for a, b in zip((0, *cuts), (*cuts, T)):
        state.append(K[:, a:b], V[:, a:b])
    assert state.policy.track and state.policy.warmup == 0
    rk, rv = relative_errors(state, K, V)
    over = (rk > tau * (1 + 1e-9)) | (rv > tau * (1 + 1e-9))
    assert state.tokens_over_tau == int(over.sum())
    if math.isinf(ceiling):
        assert not over.any(), (rk.max(), rv.max())
    assert (state.num_chunks > 1).all()  # the streams drift: chunks do open


@pytest.mark.parametrize("tau", [0.1, 0.3])
def test_without_tracking_every_stored_token_within_tau_or_the_sketch_tail(rng, tau):
    """A7.2.1 (a)-(c) (``track=False``) on drifting streams: tokens inside a chunk have residual <=
    tau; a chunk's first token is bounded only by sqrt(sigma_{r+1}(A)^2 + eps) of the rows sketched
    so far (no reset, so A = all tokens <= t); under the paper order the firing tokens exceed tau."""
    H, T, d, r, ell = 2, 300, 10, 3, 8
    K = np.stack([drifting_stream(rng, T, d, 3, 70) for _ in range(H)])
    V = np.stack([drifting_stream(rng, T, d, 2, 90) for _ in range(H)])
    state = sr.SubspaceState.adaptive(
        H, d, rank_k=r, rank_v=r, ell_k=ell, ell_v=ell, tau_k=tau, tau_v=tau, max_chunk=10**6, trigger="reproject", byte_ceiling=math.inf, track=False
    ).append(K, V)
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
    assert paper.tokens_over_tau == 0  # the counter counts refused triggers only: no ceiling, none


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


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_issue_40_three_subspace_stream_with_the_defaults(seed):
    """Issue 40's goal, the seed 001 §5 scenario: 1200 keys and values, d = 32, three rank-8
    subspaces of 400 tokens each plus 1% noise, defaults (tracking, byte_ceiling=1): at most 6
    chunks (A7.4.2 allows 1 + 2k = 5 without noise), no token above tau, at most half the full
    cache. Before: 112 chunks, 806 tokens above tau, 1.025x. Now: 3 chunks, 0, 0.297x."""
    rng = np.random.default_rng(seed)
    K, V = subspace_stream(rng, 1200, 32, 8, 400)[None], subspace_stream(rng, 1200, 32, 8, 400)[None]
    state = sr.SubspaceState.adaptive(1, 32, 32, rank_k=8, rank_v=8, tau_k=0.2, tau_v=0.2, max_chunk=10**6).append(K, V)
    rk, rv = relative_errors(state, K, V)
    assert state.num_chunks[0] <= 6
    assert max(rk.max(), rv.max()) <= 0.2 * (1 + 1e-9) and state.tokens_over_tau == 0
    assert state.nbytes <= 0.5 * state.full_cache_nbytes


def test_issue_40_stream_token_by_token_equals_one_block(rng):
    """Decoding (one token per append) builds the same state as one block append (A7.4 per token)."""
    K, V = subspace_stream(rng, 600, 32, 8, 200)[None], subspace_stream(rng, 600, 32, 8, 200)[None]
    kw = dict(rank_k=8, rank_v=8, tau_k=0.2, tau_v=0.2, max_chunk=10**6)
    block = sr.SubspaceState.adaptive(1, 32, 32, **kw).append(K, V)
    single = sr.SubspaceState.adaptive(1, 32, 32, **kw)
    for t in range(600):
        single.append(K[:, t], V[:, t])
    np.testing.assert_array_equal(single.num_chunks, block.num_chunks)
    for a, b in zip(single.reconstruct(), block.reconstruct()):
        np.testing.assert_allclose(a, b, atol=1e-12)
    assert single.nbytes == block.nbytes and single.tokens_over_tau == block.tokens_over_tau == 0


@pytest.mark.parametrize("noise", [0.0, 0.01])
@pytest.mark.parametrize("switches", [1, 2, 4, 7])
def test_drifting_family_opens_at_most_two_chunks_per_switch(switches, noise):
    """A7.4.2: k subspace switches open at most 1 + 2k chunks per head without noise (a theorem),
    and at most two per segment with 1% noise (measured: a row grown from a noisy token can tilt a
    chunk once, and the snapshot that replaces it is stable), with segments of random lengths and
    dimensions up to the rank, and every token within tau."""
    rng = np.random.default_rng(100 * switches + int(noise * 1000))
    H, d, r, tau = 2, 24, 6, 0.2
    lengths = rng.integers(60, 200, switches + 1)
    K, V = [], []
    for _ in range(H):
        K.append(np.concatenate([subspace_stream(rng, n, d, int(rng.integers(1, r + 1)), n, noise) for n in lengths]))
        V.append(np.concatenate([subspace_stream(rng, n, d, int(rng.integers(1, r + 1)), n, noise) for n in lengths]))
    K, V = np.stack(K), np.stack(V)
    state = sr.SubspaceState.adaptive(H, d, rank_k=r, rank_v=r, tau_k=tau, tau_v=tau, max_chunk=10**6, byte_ceiling=math.inf).append(K, V)
    assert (state.num_chunks <= (1 + 2 * switches if noise == 0 else 2 * (switches + 1))).all(), state.num_chunks
    rk, rv = relative_errors(state, K, V)
    assert max(rk.max(), rv.max()) <= tau * (1 + 1e-9) and state.tokens_over_tau == 0


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_a_failing_append_that_grew_a_visible_chunk_changes_nothing(rng, monkeypatch, backend):
    """Spec A7.4 step 1 rewrites a row of the chunk that was open before the append; it does so in
    a private copy, so an append that fails after the growth leaves the state as it was."""
    if backend == "torch":
        pytest.importorskip("torch")
        from subspace_ref_torch import append as append_adaptive
    else:
        from subspace_ref.policies import append_adaptive

    K, V = subspace_stream(rng, 60, 12, 4, 30)[None], subspace_stream(rng, 60, 12, 4, 30)[None]
    kw = dict(rank_k=4, rank_v=4, tau_k=0.2, tau_v=0.2, byte_ceiling=math.inf)
    state = sr.SubspaceState.adaptive(1, 12, **kw)
    if backend == "torch":
        import torch

        state = state.to("torch")
        K, V = torch.from_numpy(K), torch.from_numpy(V)
    state.append(K[:, :16], V[:, :16]).append(K[:, 16:31], V[:, 16:31])  # 31 tokens in a capacity of 32
    assert state.layout.key_coef.shape[2] >= 32 and state.layout.key_bases.shape[2] >= 2  # room: the next append writes in place
    assert (np.linalg.norm(to_numpy(state.layout.key_bases)[0, 0, state.num_chunks[0] - 1], axis=-1) == 0).any()  # free rows to grow
    before = copy.deepcopy((state.layout.live_arrays(), state.sketches, state.tokens_over_tau))
    calls = []

    def failing(lay, which, index, coef):
        calls.append(index)
        if len(calls) > 12 or len(calls) == 1:  # the first call, after growth; then after several
            raise RuntimeError("disk on fire")
        return store(lay, which, index, coef)

    store = append_adaptive.store
    monkeypatch.setattr(append_adaptive, "store", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        state.append(K[:, 31:32], V[:, 31:32])  # token 31 grows the chunk opened by token 30
    with pytest.raises(RuntimeError, match="disk on fire"):
        state.append(K[:, 31:], V[:, 31:])
    after = (state.layout.live_arrays(), state.sketches, state.tokens_over_tau)
    for name, x in before[0].items():
        np.testing.assert_array_equal(to_numpy(after[0][name]), to_numpy(x), err_msg=name)
    np.testing.assert_array_equal(to_numpy(after[1].keys), to_numpy(before[1].keys))
    assert after[2] == before[2]
    monkeypatch.undo()
    state.append(K[:, 31:], V[:, 31:])
    grown = sr.SubspaceState.adaptive(1, 12, **kw).append(to_numpy(K), to_numpy(V))
    J = grown.num_chunks[0]
    np.testing.assert_allclose(to_numpy(state.layout.key_bases)[:, :, :J], grown.layout.key_bases[:, :, :J], atol=1e-12)


@pytest.mark.parametrize("ceiling", [math.inf, 1.0])
def test_torch_tracks_like_the_oracle(rng, ceiling):
    """The torch append (backends/subspace_ref_torch/append.py) follows A7.4 step for step: same
    chunks, reconstruction, counter and bytes as the oracle, in blocks cut anywhere."""
    torch = pytest.importorskip("torch")
    H, T, d = 2, 400, 16
    K = np.stack([subspace_stream(rng, T, d, 4, 90) for _ in range(H)])
    V = np.stack([subspace_stream(rng, T, d, 3, 70) for _ in range(H)])
    K[:, 150:350] = rng.standard_normal((H, 200, d))  # a full-rank stretch: refusals under the ceiling
    kw = dict(rank_k=4, rank_v=3, tau_k=0.1, tau_v=0.1, max_chunk=50, byte_ceiling=ceiling)
    ref = sr.SubspaceState.adaptive(H, d, **kw).append(K, V)
    got = sr.SubspaceState.adaptive(H, d, **kw).to("torch")
    for a, b in ((0, 1), (1, 2), (2, 77), (77, 78), (78, T)):
        got.append(torch.from_numpy(K[:, a:b]), torch.from_numpy(V[:, a:b]))
    got = got.to("numpy")
    np.testing.assert_array_equal(got.num_chunks, ref.num_chunks)
    J = ref.num_chunks.max()
    np.testing.assert_array_equal(got.layout.chunk_starts[..., :J], ref.layout.chunk_starts[..., :J])
    for a, b in zip(got.reconstruct(), ref.reconstruct()):
        np.testing.assert_allclose(a, b, atol=1e-10)
    assert got.tokens_over_tau == ref.tokens_over_tau and got.nbytes == ref.nbytes
    assert (ref.tokens_over_tau > 0) == (ceiling == 1.0)


def test_check_knows_grown_bases_are_no_projection(rng):
    """Spec B0/B12: a row grown after a token was stored leaves that token's k_hat on the rows in
    use then, not P_{B_j} k; ``check`` detects it and reports the paper forms (which assume the
    projection) as no guarantee, while the corrected forms stay guarantees and hold."""
    from subspace_ref.lab.bounds import check

    H, d = 1, 16
    K = rng.standard_normal((H, 200, d)) @ np.diag(0.5 ** np.arange(d))  # a graded spectrum: tokens within tau / 2 come before rows grow
    state = sr.SubspaceState.adaptive(H, d, rank_k=8, rank_v=8, tau_k=0.3, tau_v=0.3, byte_ceiling=math.inf).append(K, K.copy())
    rows = {row.id: row for row in check(rng.standard_normal((H, d)), K, K.copy(), state).rows}
    for paper in ("B2", "B4.2", "B8"):
        assert not rows[paper].guarantee and "grown" in rows[paper].status
    for corrected in ("B2.c", "B4.2.c", "B8.c"):
        assert rows[corrected].guarantee and rows[corrected].held
