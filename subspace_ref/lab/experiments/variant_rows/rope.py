"""Rows of the "rope" group (spec/rope.md): at the plain rank r, against the plain "static" row
(post-RoPE SVD basis),

* ``rope_planes_r{r}``: the plane basis of spec/rope.md P1 (r/2 whole RoPE planes per head,
  chosen by the post-RoPE key energy of the calibration SVD; values keep their SVD basis): a
  plain static state, one chunk per head, O(r) attention per token (R1: exact free transport);
* ``rope_pre_r{r}``: the pre-RoPE SVD basis of ``calibrate`` in a state that un-rotates keys
  (``static_states(bases, rope=...)``, spec/rope.md P2-P3; oracle backend): seed 003's pre- vs
  post-RoPE ablation as a cache, same bytes, O(r d) attention per token. Absent when the
  calibration has no pre-RoPE SVD (a model without RoPE).

Every row's ``extra`` holds the residual traces of spec/rope.md §4 (relative key residual by
position bucket for the three bases, held-out windows), the retained calibration energy of each
basis and the chunk counts (1 per head: a static state).
"""

from __future__ import annotations

import numpy as np

from subspace_ref.lab.experiments.variant_rows import Variant, plain_rank

GROUP = "rope"


def plane_layer_basis(entry: dict, rank: int, rope, gamma: float = 1.0):
    """One layer's StaticBasis with a plane key basis (spec/rope.md P1) from the saved SVD
    ``entry`` (``Wk`` rows, ``Sk``): per-dimension key energy ``Σ_k S_k² W_k,i²`` summed per
    plane; values: the SVD's first ``rank`` rows."""
    from subspace_ref.calibration import StaticBasis
    from subspace_ref.lab.experiments.calibrate import basis_from_svd
    from subspace_ref.rope import plane_basis

    W, S = entry["Wk"], entry["Sk"]
    per_dim = np.einsum("hk,hki->hi", S.astype(np.float64) ** 2, W * W)  # diag of KᵀK per head
    pairs = rope.planes(W.shape[-1])
    B = plane_basis(per_dim[:, pairs].sum(-1), rank, rope.layout, rope.rotary_dim)
    E = basis_from_svd(entry, 1, rank, gamma).E
    H = B.shape[0]
    return StaticBasis(B=B, E=E, gamma=np.full(H, float(gamma)), rank_k=(rank,) * H, rank_v=(rank,) * H)


def _retained(entry: dict, B: np.ndarray) -> float:
    """Mean over heads of |K Bᵀ|² / |K|² on the calibration keys, from their SVD."""
    G = np.einsum("hk,hki,hkj->hij", entry["Sk"].astype(np.float64) ** 2, entry["Wk"], entry["Wk"])  # KᵀK
    kept = np.einsum("hri,hij,hrj->h", B, G, B)
    return float(np.mean(kept / np.trace(G, axis1=1, axis2=2)))


def residual_traces(ctx, bases: dict[str, list], rope, windows: int = 2) -> dict:
    """Spec/rope.md §4: mean relative key residual per position bucket and basis, over layers,
    KV heads and ``windows`` held-out windows. ``bases``: name -> (per-layer key bases (H, r, d),
    pre_rope flag)."""
    from subspace_ref.lab.experiments import _common as C
    from subspace_ref.hf.calibration_losses import capture_windows
    from subspace_ref.rope import rotate

    ids = ctx.eval_windows()[:windows]
    T = ids.shape[1]
    cap = capture_windows(ctx.model, ids, queries=False, batch=ctx.profile.batch)
    positions = np.tile(np.arange(T), len(ids))
    edges = [0] + C.position_edges(T)[1:]
    sums = {name: np.zeros(len(edges) - 1) for name in bases}
    count = np.zeros(len(edges) - 1)
    bucket = np.searchsorted(edges, positions, side="right") - 1
    bucket = np.minimum(bucket, len(edges) - 2)
    for li, layer in enumerate(cap.layers):
        K = layer.keys.astype(np.float64)  # (H, n T, d) post-RoPE
        K_pre = rotate(K, positions, rope, inverse=True)
        for name, (per_layer, pre) in bases.items():
            X = K_pre if pre else K
            B = per_layer[li]
            res = X - np.einsum("htd,hrd,hre->hte", X, B, B)
            rho = np.linalg.norm(res, axis=-1) / np.maximum(np.linalg.norm(X, axis=-1), 1e-30)  # (H, n T)
            sums[name] += np.bincount(bucket, weights=rho.sum(0), minlength=len(edges) - 1)
        count += np.bincount(bucket, minlength=len(edges) - 1) * K.shape[0]
    labels = [C.bucket_label(a, b) for a, b in zip(edges[:-1], edges[1:])]
    return {name: {lab: float(s / c) for lab, s, c in zip(labels, sums[name], count) if c} for name in bases}


def variants(ctx, record: dict, svd: list[dict]) -> list[Variant]:
    from subspace_ref.lab.experiments.calibrate import load_svd, static_basis
    from subspace_ref.hf import static_states
    from subspace_ref.rope import RopeParams

    r = plain_rank(ctx, record)
    if r % 2:  # whole planes: two dims each
        r -= 1
    rope = RopeParams.from_config(ctx.model.config)
    post = [static_basis(record, svd, li, rank=r) for li in range(len(svd))]
    planes = [plane_layer_basis(entry, r, rope) for entry in svd]
    svd_pre = load_svd(ctx.out, pre_rope=True) if record["files"].get("pre_rope") else None
    pre = None if svd_pre is None else [static_basis(record, svd_pre, li, rank=r) for li in range(len(svd_pre))]

    traced = {"post_svd": ([b.B for b in post], False), "planes": ([b.B for b in planes], False)}
    if pre is not None:
        traced["pre_svd"] = ([b.B for b in pre], True)
    energy = {"post_svd": float(np.mean([_retained(e, b.B) for e, b in zip(svd, post)])),
              "planes": float(np.mean([_retained(e, b.B) for e, b in zip(svd, planes)]))}
    if pre is not None:
        energy["pre_svd"] = float(np.mean([_retained(e, b.B) for e, b in zip(svd_pre, pre)]))
    shared = dict(rank=r, residual_by_position=residual_traces(ctx, traced, rope), energy_retained=energy,
                  chunks_per_head=1, rope=dict(layout=rope.layout, rotary_dim=rope.rotary_dim, attention_scaling=rope.attention_scaling))

    rows = [Variant(
        name=f"rope_planes_r{r}", group=GROUP, plain="static", factory=static_states(planes), backend="torch",
        note="key basis of r/2 whole RoPE planes (spec/rope.md P1, R1: commutes with R_t, exact free transport, O(r) attention)",
        extra=dict(shared, attention_per_token="O(r)"),
    )]
    if pre is not None:
        rows.append(Variant(
            name=f"rope_pre_r{r}", group=GROUP, plain="static", factory=static_states(pre, rope=rope), backend="numpy",
            note="pre-RoPE SVD basis, keys un-rotated on append and rebuilt+rotated in attention (spec/rope.md P2-P3; seed 003 ablation)",
            extra=dict(shared, attention_per_token="O(r d)"),
        ))
    return rows
