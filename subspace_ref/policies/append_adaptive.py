"""Spec A7: appending to an adaptive state, chunks opened by a residual or length trigger with
bases snapshotted from the FD sketches; spec A7.2's trigger order ("reproject") or seed 001's
("paper"); spec A7.3's byte ceiling; spec A7.4's drift tracking (:mod:`subspace_ref.policies.tracking`);
the sketch variants through :mod:`subspace_ref.policies.variants`."""

from __future__ import annotations

from typing import Any

from subspace_ref import frequent_directions as fd
from subspace_ref import window
from subspace_ref.policies import byte_ceiling, tracking, variants
from subspace_ref.policies.online_run import OnlineRun, relative_residual
from subspace_ref.policies.storing import store


def append_adaptive(state, keys: Any, values: Any, ahead: tuple | None = None) -> None:
    """Spec A7 for keys (N, H, n, d), values (N, H, n, d_v), token by token; with ``track`` the
    drift tracking of spec A7.4 (growth into free rows, spanning snapshots).

    ``ahead``: (keys, values) of the L_h tokens that follow the block, for lookahead anchoring
    (spec/window.md W4); None (or L_h = 0) is spec A7 verbatim."""
    run = OnlineRun(state, keys, values)
    policy, xp = run.policy, run.xp
    reproject = policy.trigger == "reproject"  # spec A7.2; "paper": A7 step 3 verbatim
    track = getattr(policy, "track", False)  # spec A7.4 (needs reproject)
    may_open = byte_ceiling.opener(state)  # spec A7.3
    following = window.lookahead_stream(keys, values, ahead)  # spec/window.md W4; None: A7 as is
    for i in range(run.n_new):
        t = run.T + i
        k, v = keys[:, :, i], values[:, :, i]
        warming_k, warming_v = run.warm(t, k, v)  # step 0
        c, dv = run.coefficients(k, v)  # step 1
        # step 2: residuals from the coefficients; step 3: the trigger (a side that is still
        # warming is exact and does not fire; the length cap waits for both sides)
        rho_k, rho_v = relative_residual(k, c), relative_residual(v, dv)
        over_k, over_v = ~warming_k & (rho_k > policy.tau_k), ~warming_v & (rho_v > policy.tau_v)
        open_start = xp.take_along_axis(run.chunk_starts, (run.num_chunks - 1)[..., None], axis=2)[..., 0]
        # the tokens the open chunk holds when t is decided: t too under the paper order, where t
        # stays in it; not under A7.2, where a firing t goes to the next chunk (so a chunk closed
        # by the cap holds max_chunk tokens under both orders)
        capped = ~warming_k & ~warming_v & variants.length_capped(t + 1 - reproject - open_start, policy)
        if track:  # A7.4 step 1: a side with a free row grows instead of firing
            full_k, full_v = tracking.full(run.open_B, run.mask_k), tracking.full(run.open_E, run.mask_v)
            want = (over_k & full_k) | (over_v & full_v) | capped
        else:
            want = over_k | over_v | capped
        # spec A7.3: a chunk that would not pay for its bases is not opened (with reproject, an
        # empty open chunk takes the snapshot in place and adds nothing)
        fire = want & (may_open(run.num_chunks, t + 1) | (reproject & (open_start == t)))
        refused = want & ~fire
        if reproject:  # A7.2: the FD update first, so the new bases see the firing token
            run.feed(t, k, v)
        changed = False
        if track:  # A7.4 step 1: rows go to tokens over tau / 2 while the open bases have free rows
            grow_k, grow_v = tracking.growing(rho_k, warming_k, policy.tau_k), tracking.growing(rho_v, warming_v, policy.tau_v)
            changed |= _grow(run, "key", grow_k & ~full_k & ~fire, k, c)
            changed |= _grow(run, "value", grow_v & ~full_v & ~fire, v, dv)
        if bool(fire.any()):
            changed = True
            fn, fh = xp.nonzero(fire)
            src_k, src_v = variants.snapshot_sources(run, fn, fh, t, reproject, following, i)
            new_B = fd.top_directions(src_k, run.open_B.shape[2]) * run.mask_k[fh]
            new_E = fd.top_directions(src_v, run.open_E.shape[2]) * run.mask_v[fh]
            run.svds += 2 * len(fn)
            fn, fh, new_B, new_E = variants.reused(run, fn, fh, new_B, new_E)
            if track:  # A7.4 steps 2-3: bases that hold the firing token; sketches of the new chunk only
                new_B = tracking.spanning(new_B, k[fn, fh], policy.tau_k)
                new_E = tracking.spanning(new_E, v[fn, fh], policy.tau_v)
                if not run.ring:  # a ring (spec/sketch_variants.md S1) keeps no running sketch
                    fed = t % run.stride == 0
                    tracking.restart(run.buf_k, run.filled_k, fn, fh, k if fed else None)
                    tracking.restart(run.buf_v, run.filled_v, fn, fh, v if fed else None)
            # the snapshot goes into spare chunk slot j, encoded; the open basis is its decoding.
            # With reproject, an open chunk that is still empty (chunk 0 at t = 0 without
            # warm-up) takes the snapshot itself rather than staying an empty chunk
            j = run.num_chunks[fn, fh] - (reproject & (open_start[fn, fh] == t))
            new_B = run.lay.store_basis("key", (fn, fh, j), new_B)
            new_E = run.lay.store_basis("value", (fn, fh, j), new_E)
            run.chunk_starts[fn, fh, j] = t + 1 - reproject
            run.num_chunks[fn, fh] = j + 1
            run.open_B[fn, fh] = new_B
            run.open_E[fn, fh] = new_E
            if reproject:  # A7.2: the firing token is stored with the new chunk's bases
                c[fn, fh] = xp.einsum("mrd,md->mr", new_B, k[fn, fh])
                dv[fn, fh] = xp.einsum("mrd,md->mr", new_E, v[fn, fh])
            if policy.sketch_reset and not track:  # under A7.4 step 3 every opening restarts the sketches
                _reset_sketches(run, fn, fh, t, open_start, reproject, k, v)
        if bool(refused.any()):  # A7.4's count: refused triggers that leave the token over tau as stored
            if changed:
                over_k, over_v = ~warming_k & (relative_residual(k, c) > policy.tau_k), ~warming_v & (relative_residual(v, dv) > policy.tau_v)
            run.over_tau += int((refused & (over_k | over_v)).sum())
        store(run.lay, "key", t, c)
        store(run.lay, "value", t, dv)
        if not reproject:  # step 4: the FD update
            run.feed(t, k, v)
    run.commit(state)


def _grow(run: OnlineRun, which: str, heads: Any, x: Any, coef: Any) -> bool:
    """Spec A7.4 step 1 for the (N, H) mask ``heads``, and their coefficients recomputed in
    place with the grown bases. Returns whether any head grew."""
    if not bool(heads.any()):
        return False
    xp = run.xp
    fn, fh = xp.nonzero(heads)
    j = run.num_chunks[fn, fh] - 1
    if not run.private and bool((j < run.first_new[fn, fh]).any()):
        # a chunk open before this append is visible: it grows in a private copy (committed at the end)
        run.lay = run.lay.with_private_bases()
        run.private = True
    open_basis, mask = (run.open_B, run.mask_k) if which == "key" else (run.open_E, run.mask_v)
    tracking.grow(run.lay, which, open_basis, mask, fn, fh, j, x)
    coef[fn, fh] = xp.einsum("mrd,md->mr", open_basis[fn, fh], x[fn, fh])
    return True


def _reset_sketches(run: OnlineRun, fn: Any, fh: Any, t: int, open_start: Any, reproject: bool, k: Any, v: Any) -> None:
    """Step 3b: the fired heads forget what the closing chunk summarised, unless it was too short
    to have taught the sketch a full basis (a reset then would thrash). S2.4: "long" counts the
    rows the chunk fed to the sketches, tokens t' = 0 mod stride; with reproject the chunk ends at
    t - 1, and the firing token, the new chunk's first, is kept."""
    policy, stride = run.policy, run.stride
    last = t - reproject
    long = (last // stride - (-(-open_start[fn, fh] // stride)) + 1) >= max(policy.ell_k, policy.ell_v)
    ln, lh = fn[long], fh[long]
    run.buf_k[ln, lh] = 0.0
    run.buf_v[ln, lh] = 0.0
    if reproject and t % stride == 0:
        run.buf_k[ln, lh, run.filled_k - 1] = k[ln, lh]
        run.buf_v[ln, lh, run.filled_v - 1] = v[ln, lh]
