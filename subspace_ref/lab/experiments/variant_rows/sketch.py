"""Rows of the online-sketch variants (spec/sketch_variants.md S1-S3; seed 001 §7, §9, §14):
the plain adaptive row at ``plain_rank`` with one option changed. Only the oracle implements
them (the torch append refuses, S4), so the rows run on the numpy backend.
"""

from __future__ import annotations

import numpy as np

from subspace_ref.lab.experiments.variant_rows import Variant, adaptive_options, plain_rank

GROUP = "sketch"
RING_WINDOWS = (64, 256)
STRIDES = (2, 4)
REUSE_ANGLES = (0.2, 0.5)


def variants(ctx, record, svd) -> list[Variant]:
    from subspace_ref.hf import adaptive_states

    r = plain_rank(ctx, record)
    rows = []
    for W in RING_WINDOWS:
        # a ring replaces the running sketches and refuses sketch_reset (S1.4)
        opts = adaptive_options(ctx, record, r, sketch_reset=False)
        rows.append(Variant(
            f"adaptive r{r} ring W={W}", GROUP, "adaptive", adaptive_states(**opts, ring_warm_start=W), backend="numpy",
            note=f"S1: each chunk's bases from FD of the last {W} tokens (ring buffers; no running sketch, so no sketch_reset, "
                 "which the plain row has); bytes count the rings",
            extra=dict(ring_warm_start=W)))
    for m in STRIDES:
        rows.append(Variant(
            f"adaptive r{r} FD stride {m}", GROUP, "adaptive", adaptive_states(**adaptive_options(ctx, record, r), fd_stride=m), backend="numpy",
            note=f"S2: every {m}th token enters the FD sketches ({m}x fewer FD rows and compactions; buffered FD already batches: one SVD per ell+1 rows)",
            extra=dict(fd_stride=m)))
    for a in REUSE_ANGLES:
        rows.append(Variant(
            f"adaptive r{r} reuse <{a:g} rad", GROUP, "adaptive", adaptive_states(**adaptive_options(ctx, record, r), reuse_angle=a), backend="numpy",
            note=f"S3: a trigger whose snapshot is within {a:g} rad (largest principal angle, keys and values) of the open bases keeps the open chunk",
            extra=dict(reuse_angle=a)))
    return rows


def sketch_counters(model, ids: np.ndarray, factory) -> dict:
    """FD rows inserted and SVDs run per token and head, and chunks per head, of ``factory``'s
    states on windows ``ids`` (the counters of spec/sketch_variants.md S2.3), numpy backend."""
    import torch

    from subspace_ref.hf import SubspaceCache
    from subspace_ref.hf.attention import subspace_attention_enabled

    rows = svds = heads = 0
    chunks = []
    with torch.no_grad(), subspace_attention_enabled(model):
        cache = SubspaceCache(model.config, factory, backend="numpy")
        model(input_ids=torch.as_tensor(ids, dtype=torch.long), cache=cache, use_cache=True)
    states = [s for s in cache.states if s is not None]
    for s in states:
        n_heads = s.batch * s.heads
        rows += s.sketches.rows_inserted * n_heads
        svds += s.sketches.svds
        heads += n_heads
        chunks.append(np.asarray(s.num_chunks).ravel())
    tokens = ids.shape[1]
    ch = np.concatenate(chunks)
    return dict(fd_rows_per_token=rows / (heads * tokens), svds_per_token=svds / (heads * tokens),
                chunks_mean=float(ch.mean()), bytes=int(sum(s.nbytes for s in states)))
