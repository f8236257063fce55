"""Rows of the "window" variant group (spec/window.md): an exact recent window, a length
threshold, and small-lookahead anchoring, each against the plain row at ``plain_rank``.

* static + window W (W in 32, 64) and static + min_tokens M (M = 256, with window 64: below M
  tokens nothing is compressed, then the last 64 stay exact; seed 003 "Limitations");
* matched bytes: static at the largest rank r' whose bytes with a window of W do not exceed the
  plain static row's at the evaluation context T (spec/window.md W5:
  (T - W)(r' + r') + W (d + d) <= T (r + r)), against static at r;
* adaptive + window W = 64 with lookahead 0 (streaming) and W/2 (seed 001 §7's added-latency
  mode). Lookahead appends run on the numpy oracle only (``backend="numpy"``); the others on torch.
"""

from __future__ import annotations

from subspace_ref.lab.experiments.variant_rows import Variant, adaptive_options, plain_rank, static_bases

WINDOWS = (32, 64)
MIN_TOKENS = (256,)
LOOKAHEAD_WINDOW = 64


def matched_rank(T: int, W: int, d: int, r: int) -> int:
    """The largest r' >= 1 with (T - W) 2 r' + W 2 d <= T 2 r (per head and token numbers of
    spec/window.md W5), or 0 when even r' = 1 does not fit (the window alone is too large)."""
    if T <= W:
        return 0
    return max(0, min(r, (T * r - W * d) // (T - W)))


def variants(ctx, record: dict, svd: list[dict]) -> list[Variant]:
    from subspace_ref.hf import adaptive_states, static_states

    r = plain_rank(ctx, record)
    bases = static_bases(record, svd, r)
    rows = []
    for W in WINDOWS:
        rows.append(
            Variant(
                f"static r={r} + exact tail {W}",
                "window",
                "static",
                static_states(bases, window=W),
                note=f"last {W} tokens exact (spec/window.md W1-W3)",
                extra=dict(rank=r, window=W),
            )
        )
    for M in MIN_TOKENS:
        W = max(WINDOWS)
        rows.append(
            Variant(
                f"static r={r} + exact tail {W}, min_tokens {M}",
                "window",
                "static",
                static_states(bases, window=W, min_tokens=M),
                note=f"nothing compressed below {M} tokens, then the last {W} exact",
                extra=dict(rank=r, window=W, min_tokens=M),
            )
        )
    T = ctx.context
    for W in WINDOWS:
        r_low = matched_rank(T, W, ctx.d, r)
        if r_low < 1:
            continue
        rows.append(
            Variant(
                f"static r={r_low} + exact tail {W} (bytes of r={r} at T={T})",
                "window",
                "static",
                static_states(static_bases(record, svd, r_low), window=W),
                note=f"matched bytes at T={T}: (T-W) 2r' + W 2d <= T 2r (spec/window.md W5)",
                extra=dict(rank=r_low, window=W, matched_to=r, context=T),
            )
        )
    W = LOOKAHEAD_WINDOW
    for L in (0, W // 2):
        rows.append(
            Variant(
                f"adaptive r={r} + exact tail {W}, lookahead {L}",
                "window",
                "adaptive",
                adaptive_states(**adaptive_options(ctx, record, r), window=W, lookahead=L),
                backend="numpy" if L else "torch",
                note="streaming anchoring" if L == 0 else f"new chunks anchored on the next {L} exact tokens (seed 001 §7; spec/window.md W4)",
                extra=dict(rank=r, window=W, lookahead=L),
            )
        )
    return rows
