"""Checks shared by the two online policies (adaptive and rotating), which both keep FD sketches."""

from __future__ import annotations

from typing import Any

import numpy as np

from subspace_ref import _checks


def per_head_ranks(name: str, rank: Any, heads: int, dim: int) -> tuple[int, ...]:
    if isinstance(rank, (list, tuple, np.ndarray)):
        ranks = tuple(_checks.integer(name, r) for r in rank)
    else:
        ranks = (_checks.integer(name, rank),) * heads
    if len(ranks) != heads:
        raise ValueError(f"{name} must be one int or {heads} ints (one per head), got {rank!r}")
    for r in ranks:
        if not 1 <= r <= dim:
            raise ValueError(f"{name} must lie in [1, {dim}] (the head size), got {r!r}")
    return ranks


def sketch_size(name: str, ell: Any, ranks: tuple[int, ...], rank_name: str) -> int:
    """ell defaults to 2 * max rank (seed 003: 'sketch size 2r'); it must exceed every rank."""
    ell = 2 * max(ranks) if ell is None else _checks.positive_int(name, ell)
    if ell <= max(ranks):
        raise ValueError(f"{name} = {ell} must be > {rank_name} = {max(ranks)} (FD yields at most ell - 1 directions)")
    return ell


def warmup_length(warmup: Any, rank_k: tuple[int, ...], rank_v: tuple[int, ...]) -> int:
    """W, the warm-up cap of spec A7 step 0: each side of each head stores min(W, its rank)
    warm-up rows (:func:`warmup_rows`). Default: the largest rank, so every side fills its basis."""
    limit = max(max(rank_k), max(rank_v))
    if warmup is None:
        return limit
    if isinstance(warmup, np.integer):
        warmup = int(warmup)
    if isinstance(warmup, bool) or not isinstance(warmup, (int, np.integer)) or not 0 <= warmup <= limit:
        raise ValueError(f"warmup must be an int in [0, {limit}] (the largest rank), got {warmup!r}")
    return warmup


def warmup_rows(policy) -> tuple[np.ndarray, np.ndarray]:
    """Per head, how many warm-up rows keys and values take (spec A7 step 0): min(W, rank_k[h])
    and min(W, rank_v[h]), so a side is never cut at the other side's rank."""
    return np.minimum(policy.warmup, np.asarray(policy.rank_k)), np.minimum(policy.warmup, np.asarray(policy.rank_v))
