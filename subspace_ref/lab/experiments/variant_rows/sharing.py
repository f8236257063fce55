"""Rows of the "sharing" group (spec/sharing.md; seed 001 §11 "per-head vs per-group (MQA/GQA)
bases", seed 003 "Compatibility"), against the plain "static" row (one post-RoPE PCA key basis
per KV head at the plain rank r):

* ``shared_qa_r{r}``: one key basis per KV head minimising the group's summed logit error
  (spec/sharing.md A1'), same layout and bytes as plain;
* ``per_query_r{r}``: one key basis per query head (A1, A2), states with ``query_group=g``:
  g times plain's bytes (values stored per query head too, B1);
* ``per_query_matched_r{r//g}``: the same at ranks r // g on both sides, so coefficient bytes
  per token are at most plain's (B2).

Queries are re-captured on the calibration windows (``calibrate`` stores only key/value SVDs);
value bases are the calibration SVD's. ``extra`` holds the logit error f of spec/sharing.md S1
on held-out windows (all query/key token pairs, S1's moment identity) for each basis set, summed
over layers and query heads, and its reduction relative to the plain PCA basis.
"""

from __future__ import annotations

import numpy as np

from subspace_ref.lab.experiments.variant_rows import Variant, plain_rank, static_bases

GROUP = "sharing"


def layer_moments(cap) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer (Sigma_q (H_q, d, d), Sigma_k (H, d, d)) of a capture with queries."""
    from subspace_ref.sharing import second_moment

    return [(second_moment(layer.queries), second_moment(layer.keys)) for layer in cap.layers]


def heldout_errors(moments: list, key_bases: list[np.ndarray]) -> float:
    """Sum over layers and query heads of f_i (spec/sharing.md S1) on ``moments``; ``key_bases``
    per layer (H or H_q, r, d): a basis of KV head h serves query heads g h .. g h + g - 1."""
    from subspace_ref.sharing import logit_error

    total = 0.0
    for (A, K), B in zip(moments, key_bases):
        Hq, H = A.shape[0], K.shape[0]
        g = Hq // H
        for i in range(Hq):
            total += logit_error(B[i] if B.shape[0] == Hq else B[i // g], A[i], K[i // g])
    return total


def variants(ctx, record: dict, svd: list[dict]) -> list[Variant]:
    from subspace_ref.lab.experiments.calibrate import basis_from_svd
    from subspace_ref.hf.calibration_losses import capture_windows
    from subspace_ref.hf import static_states
    from subspace_ref.sharing import calibrate_query_heads

    r = plain_rank(ctx, record)
    cal = layer_moments(capture_windows(ctx.model, ctx.calib_windows(), queries=True, batch=ctx.profile.batch))
    hold = layer_moments(capture_windows(ctx.model, ctx.holdout_windows(), queries=True, batch=ctx.profile.batch))
    H, Hq = cal[0][1].shape[0], cal[0][0].shape[0]
    g = Hq // H
    r_m = max(1, r // g)
    plain = static_bases(record, svd, r)
    shared = [calibrate_query_heads(A, K, b.E, r, share="kv_head") for (A, K), b in zip(cal, plain)]
    per_q = [calibrate_query_heads(A, K, b.E, r, share="query_head") for (A, K), b in zip(cal, plain)]
    matched = [calibrate_query_heads(A, K, basis_from_svd(e, 1, r_m, 1.0).E, r_m, share="query_head") for (A, K), e in zip(cal, svd)]

    f = {name: heldout_errors(hold, [b.B for b in bases])
         for name, bases in (("plain_pca", plain), ("shared_qa", shared), ("per_query", per_q), ("per_query_matched", matched))}
    f_cal = {name: heldout_errors(cal, [b.B for b in bases]) for name, bases in (("plain_pca", plain), ("shared_qa", shared), ("per_query", per_q))}
    common = dict(
        group_size=g, kv_heads=H, query_heads=Hq, plain_rank=r,
        heldout_logit_error=f, calibration_logit_error=f_cal,
        heldout_f_reduction={k: 1.0 - v / f["plain_pca"] for k, v in f.items() if k != "plain_pca"},
        coefficient_elements_per_token_per_layer={"plain": H * 2 * r, "shared_qa": H * 2 * r, "per_query": Hq * 2 * r, "per_query_matched": Hq * 2 * r_m},
        note_f="f = E[(q^T (I-P) k)^2], unscaled logits, all held-out (q, k) token pairs (spec/sharing.md S1)",
    )
    return [
        Variant(f"shared_qa_r{r}", GROUP, "static", static_states(shared),
                note="one key basis per KV head minimising the group's summed logit error (spec/sharing.md A1'); plain bytes",
                extra=dict(common, rank=r)),
        Variant(f"per_query_r{r}", GROUP, "static", static_states(per_q, share="query_head"),
                note=f"one key basis per query head (A1-A3); values stored per query head too: {g}x plain bytes",
                extra=dict(common, rank=r)),
        Variant(f"per_query_matched_r{r_m}", GROUP, "static", static_states(matched, share="query_head"),
                note=f"per query head at rank {r_m} on both sides: coefficient bytes/token <= plain (spec/sharing.md B2)",
                extra=dict(common, rank=r_m)),
    ]
