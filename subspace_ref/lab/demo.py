"""``subspace-kv demo``: a few thousand synthetic low-rank tokens through static, adaptive and
rotating states; prints the memory ratio to the full cache and the output error of attention."""

from __future__ import annotations

import time

import numpy as np

import subspace_ref as sr


def synthetic_layer(rng, heads: int, tokens: int, d: int, rank: int, noise: float, drift_every: int):
    """Keys and values near a rank-``rank`` subspace per head that is redrawn every
    ``drift_every`` tokens (so adaptive bases have something to adapt to), plus queries."""

    def stream():
        out = np.empty((heads, tokens, d))
        for start in range(0, tokens, drift_every):
            n = min(drift_every, tokens - start)
            basis = rng.standard_normal((heads, rank, d)) / np.sqrt(rank)
            out[:, start : start + n] = np.einsum("htr,hrd->htd", rng.standard_normal((heads, n, rank)), basis)
        return out + noise * rng.standard_normal(out.shape)

    return stream(), stream(), rng.standard_normal((2 * heads, d))


def add_arguments(parser) -> None:
    parser.add_argument("--tokens", type=int, default=4096, help="tokens streamed through each state (default 4096)")
    parser.add_argument("--heads", type=int, default=4, help="KV heads; twice as many query heads attend (GQA; default 4)")
    parser.add_argument("--d", type=int, default=64, help="head size (default 64)")
    parser.add_argument("--rank", type=int, default=16, help="rank of every state; the stream itself has rank/2 plus noise (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the synthetic stream (default 0)")


def run(args) -> int:
    rng = np.random.default_rng(args.seed)
    K, V, q = synthetic_layer(rng, args.heads, args.tokens, args.d, rank=args.rank // 2, noise=0.02, drift_every=args.tokens // 2)
    calibration = args.tokens // 4
    exact = sr.exact_attention(q, K, V)
    states = {
        "static (calibrated on the first quarter)": sr.SubspaceState.static(
            sr.calibrate(K[:, :calibration], V[:, :calibration], rank_k=args.rank, rank_v=args.rank)
        ),
        "adaptive (seed 001, paper sketches)": sr.SubspaceState.adaptive(
            args.heads, args.d, rank_k=args.rank, rank_v=args.rank, tau_k=0.3, tau_v=0.3, max_chunk=512
        ),
        "adaptive + sketch_reset": sr.SubspaceState.adaptive(
            args.heads, args.d, rank_k=args.rank, rank_v=args.rank, tau_k=0.3, tau_v=0.3, max_chunk=512, sketch_reset=True
        ),
        "rotating (seed 003, m = 64)": sr.SubspaceState.rotating(args.heads, args.d, rank_k=args.rank, rank_v=args.rank, refresh_every=64),
    }
    print(f"{args.tokens} tokens, {args.heads} heads, d = {args.d}, rank {args.rank}; subspace switches halfway; float64", flush=True)
    print(f"{'state':<42} {'bytes/full':>10} {'chunks':>7} {'rel. output error':>18} {'append s':>9}")
    for name, state in states.items():
        start = time.perf_counter()
        state.append(K, V)
        elapsed = time.perf_counter() - start
        out = sr.attend(q, state)
        err = np.linalg.norm(out - exact) / np.linalg.norm(exact)
        ratio = state.nbytes / state.full_cache_nbytes
        print(f"{name:<42} {ratio:>10.3f} {state.num_chunks.mean():>7.1f} {err:>18.2e} {elapsed:>9.2f}", flush=True)  # one line per state as it ends
    return 0
