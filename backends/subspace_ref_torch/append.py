"""Appending to a torch-family state (spec A6, A7, A8), on the state's device.

Follows :func:`subspace_ref.numpy_backend.append_reference` step for step, so that in float64 the
resulting state equals the oracle's to rounding, with the same chunk boundaries:

* static (A6): one batched matmul per block, over sequences, heads and tokens;
* adaptive (A7): warm-up tokens (t < W) one at a time, as their bases change with each token;
  after that the block is processed in *windows*: coefficients and residuals of a window are
  computed with the open bases in one batched matmul, the first token at which any head fires
  is found (ONE host sync per window: ``int(first)``), every token before it is committed, the
  FD buffers take those tokens in one insertion (the same writes and compactions as one by
  one), the fired heads get their new bases from their sketches *before* the firing token is
  inserted (the paper's order: trigger, then FD update; with ``sketch_reset``, step 3b zeroes
  the fired heads' buffers in between, as the oracle does), and the next window starts after
  the firing token. Tokens after the first firing one are recomputed with the new bases, so
  the result is exactly the per-token algorithm; the window size only changes speed. Fired
  heads are found with ``nonzero`` (a second sync, only when something fired). A one-token
  append (decoding) is one window: one sync per token, the acceptable cost of a trigger that
  depends on the token. Drift tracking (spec A7.4, :mod:`subspace_ref.policies.tracking`) adds
  growth as an event of the same kind: the window stops at the first token where a head fires
  or grows a free row, handled as the oracle does (grown rows, snapshots that hold the firing
  token, sketches restarted), and the count of refused triggers (``tokens_over_tau``) rides on
  the same sync;
* rotating (A8): blocks between refresh tokens are projected with one matmul and inserted at
  once; at each refresh token the bases are rebuilt and every stored coefficient rotated.

Nothing visible changes until the final commit, as in the oracle: new coefficient rows and new
chunks go past the live ranges (spare capacity), and whatever is rewritten (rotated
coefficients, chunk 0's warm-up rows, the FD buffers) is rewritten in private copies that
replace the state's arrays in the last two statements.

Half-precision states (float16, bfloat16) are computed in float32 and stored in their dtype;
bases are rounded to the stored dtype before use, so coefficients are taken with the same bases
``attend`` later reads. int8 coefficients (spec A10) are quantised when stored, as the oracle's
``store`` does; the residual trigger uses the unquantised coefficients, and a rotating refresh
dequantises, rotates and quantises again.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from subspace_ref.basis_storage import row_error_bound
from subspace_ref.policies import byte_ceiling, tracking
from subspace_ref.policies._online import warmup_rows
from subspace_ref.policies.online_run import relative_residual, warmup_row
from subspace_ref.quantization import dequantize_rows, quantize_rows, read_low_bit, store_low_bit
from subspace_ref.rope import rotate
from subspace_ref.window import first_compressed_position
from subspace_ref_torch import fd, kernel_stores
from subspace_ref_torch.convert import compute_dtype

# First window of the adaptive trigger search, and its bounds (see _next_window).
FIRST_WINDOW = 16
MIN_WINDOW = 4
MAX_WINDOW = 1024


def project_window(kk: torch.Tensor, vv: torch.Tensor, open_B: torch.Tensor, open_E: torch.Tensor):
    """Spec A7 steps 1-2 for a window of tokens (N, H, s, d) against the open bases (N, H, r, d):
    coefficients and relative residuals (c, d, rho_k, rho_v). Backends with a projection kernel
    pass their own function of this signature as ``append(..., project=...)``.

    Parameters
    ----------
    kk, vv : torch.Tensor
        (N, H, s, d) keys and (N, H, s, d_v) values.
    open_B, open_E : torch.Tensor
        The open key and value bases.

    Returns
    -------
    tuple of torch.Tensor
        (c, d, rho_k, rho_v).
    """
    c = torch.matmul(kk, open_B.mT)
    dv = torch.matmul(vv, open_E.mT)
    return c, dv, relative_residual(kk, c), relative_residual(vv, dv)


def append(state, keys: torch.Tensor, values: torch.Tensor, project=project_window) -> None:
    """Append keys (N, H, n, d), values (N, H, n, d_v) (validated, in the state's dtype and on its
    device) following spec A6/A7/A8 for the state's policy; ``project`` computes steps 1-2.

    Parameters
    ----------
    state : SubspaceState
        A state holding torch tensors.
    keys, values : torch.Tensor
        (N, H, n, d) and (N, H, n, d_v).
    project : callable
        Spec A7 steps 1-2 (:func:`project_window`'s signature).
    """
    if state.policy.kind == "static":
        append_static(state, keys, values)
    else:
        append_online(state, keys, values, project)


def append_static(state, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Spec A6: c_t = B k_t, d_t = E v_t for every token of the block in one matmul -- or, for a
    decode step's few tokens into quantised coefficients on a CPU core, in one call of the
    kernels (``kernel_stores.static_append``: projection, un-rotation of pre-RoPE keys, stores).

    Parameters
    ----------
    state : SubspaceState
        A state holding torch tensors.
    keys, values : torch.Tensor
        (N, H, n, d) and (N, H, n, d_v).
    """
    lay = state.layout
    T, n_new = lay.num_tokens, keys.shape[2]
    lay = lay.with_capacity(T + n_new, lay.key_bases.shape[2])
    rope = getattr(state.policy, "rope", None)
    first = first_compressed_position(state)
    if kernel_stores.static_append(lay, keys, values, rope, first):  # a decode step's tokens, in one call
        state.layout = replace(lay, num_tokens=T + n_new)
        return
    work = compute_dtype(lay.dtype)
    if rope is not None:  # spec/rope.md P2 step 1: un-rotate at positions S+T.. (spec/window.md W10)
        keys = rotate(keys.to(work), np.arange(first + T, first + T + n_new), rope, inverse=True)
    # rows T.. are spare capacity until the commit below: writing them changes nothing visible
    rows = slice(T, T + n_new)
    # the bases as attention reads them (decoded once per set of stored bases, not copied per token)
    store(lay, "key", rows, torch.matmul(keys.to(work), lay.decoded_bases("key", work)[:, :, 0].mT))
    store(lay, "value", rows, torch.matmul(values.to(work), lay.decoded_bases("value", work)[:, :, 0].mT))
    state.layout = replace(lay, num_tokens=T + n_new)


def store(lay, which: str, rows, coef: torch.Tensor) -> None:
    """Write coefficients (N, H, ..., r) at token ``rows`` of ``lay`` (in place), quantised to
    int8 with per-token scales (spec A10) or to int4 / int2 (spec/quantization.md Q2) when the
    layout is, by the same definitions as the oracle (on a CPU core, by the store kernels), else
    cast to the stored dtype.

    Parameters
    ----------
    lay : PackedLayout
    which : {"key", "value"}
    rows : int or slice
        Token rows written.
    coef : torch.Tensor
        (N, H, ..., r) coefficients.
    """
    target = getattr(lay, f"{which}_coef")
    scales = getattr(lay, f"{which}_scale", None)
    a, b = (rows, rows + 1) if isinstance(rows, int) else (rows.start, rows.stop)
    block = coef[:, :, None] if isinstance(rows, int) else coef
    if kernel_stores.store_quantized(lay, which, a, b, block):
        return
    if lay.side_format(which).low_bits:
        store_low_bit(lay, which, a, b, block)
    elif scales is None:
        target[:, :, rows] = coef
    else:
        q, scale = quantize_rows(coef)
        target[:, :, rows] = q
        scales[:, :, rows] = scale


def _rotated(lay, which: str, upto: int, R: torch.Tensor, own: bool):
    """Spec A8 step 4: C <- C R for the first ``upto`` tokens, in private copies of the
    coefficient (and scale) arrays -- made on the first rotation of an append (``own`` False),
    reused after. int8 coefficients are dequantised, rotated and quantised again."""
    coef = getattr(lay, f"{which}_coef")
    scales = getattr(lay, f"{which}_scale", None)
    if lay.side_format(which).low_bits:  # dequantised, rotated and quantised again (spec/quantization.md Q2)
        current = read_low_bit(lay, which, 0, upto, R.dtype, upto)
        if not own:
            lay = replace(lay, **{name: getattr(lay, name).clone() for name in lay.side_arrays(which)})
        store(lay, which, slice(0, upto), torch.matmul(current, R))
        return lay
    if scales is None:
        current = coef[:, :, :upto].to(R.dtype)
    else:
        current = dequantize_rows(coef[:, :, :upto], scales[:, :, :upto], R.dtype)
    rotated = torch.matmul(current, R)
    if not own:
        lay = replace(lay, **{f"{which}_coef": coef.clone()})
        if scales is not None:
            lay = replace(lay, **{f"{which}_scale": scales.clone()})
    store(lay, which, slice(0, upto), rotated)
    return lay


def append_online(state, keys: torch.Tensor, values: torch.Tensor, project=project_window) -> None:
    """Spec A7 (adaptive) or A8 (rotating); see the module docstring for the batching.

    Parameters
    ----------
    state : SubspaceState
        A state holding torch tensors.
    keys, values : torch.Tensor
        (N, H, n, d) and (N, H, n, d_v).
    project : callable
        Spec A7 steps 1-2 (:func:`project_window`'s signature).
    """
    policy = state.policy
    variants = sketch_variant_reasons(policy)
    if variants:  # refused before anything changes (spec/sketch_variants.md S4)
        raise NotImplementedError(f"the torch append does not implement {'; '.join(variants)}; append on the numpy backend (state.to('numpy'))")
    adaptive = policy.kind == "adaptive"
    n_new = keys.shape[2]
    T = state.layout.num_tokens
    lay = state.layout
    J_used = int(lay.num_chunks.max()) if adaptive else 1
    lay = lay.with_capacity(T + n_new, J_used + (n_new if adaptive else 0))
    dtype = lay.dtype  # the state's float dtype (coefficients may be int8, bases encoded)
    work = compute_dtype(dtype)
    every = (slice(None), slice(None), 0)  # chunk 0 of every sequence and head

    sk = state.sketches
    buf_k = sk.keys.to(work, copy=True)
    buf_v = sk.values.to(work, copy=True)
    filled_k, filled_v = sk.filled_k, sk.filled_v
    own_coef = False  # becomes True once a rotation has replaced the coefficients by private copies
    num_chunks = lay.num_chunks.clone()
    chunk_starts = lay.chunk_starts.clone()
    N, H = lay.key_coef.shape[:2]
    device = lay.key_coef.device
    n_idx = torch.arange(N, device=device)[:, None]
    h_idx = torch.arange(H, device=device)[None, :]
    open_B = lay.basis("key", (n_idx, h_idx, num_chunks - 1), work)  # (N, H, r, d), a decoded copy
    open_E = lay.basis("value", (n_idx, h_idx, num_chunks - 1), work)
    open_start = torch.gather(chunk_starts, 2, (num_chunks - 1)[..., None])[..., 0]  # (N, H)
    r, r_v = open_B.shape[2], open_E.shape[2]
    mask_k = fd.rank_mask(policy.rank_k, r, work, device)
    mask_v = fd.rank_mask(policy.rank_v, r_v, work, device)
    W = policy.warmup
    warm_k, warm_v = (torch.as_tensor(w, device=device) for w in warmup_rows(policy))  # (H,) per side, spec A7 step 0
    reproject = adaptive and policy.trigger == "reproject"  # spec A7.2; "paper": A7 step 3 verbatim
    track = adaptive and getattr(policy, "track", False)  # spec A7.4
    may_open = byte_ceiling.opener(state) if adaptive else None  # spec A7.3
    private = policy.kind == "rotating" or T < W or T == 0
    if private:
        # the only bases rewritten in place: the single rotating basis, or chunk 0 during
        # warm-up or while empty (and, under A7.4, chunks that grow); they are rewritten in private copies. Bases are stored encoded at once and the
        # open ones hold their decoding, as attend will read them (spec/storage.md S3)
        lay = lay.with_private_bases()
    first_new = num_chunks.clone()  # chunk slots >= this are spare: written in place
    over_tau = 0  # spec A7.4.1's counter
    k_all, v_all = keys.to(work), values.to(work)
    window = FIRST_WINDOW
    no_head = torch.zeros((N, H), dtype=torch.bool, device=device)

    i = 0
    while i < n_new:
        t = T + i
        warming_k = warming_v = no_head
        if t < W:
            # spec A7/A8 step 0: exact warm-up rows in chunk 0 while it is open, per side up to
            # min(W, rank); one token at a time, as the bases change with each token
            k, v = k_all[:, :, i], v_all[:, :, i]
            in_chunk0 = num_chunks == 1
            warming_k, warming_v = in_chunk0 & (t < warm_k), in_chunk0 & (t < warm_v)
            if t < r and bool(warming_k.any()):
                open_B[:, :, t] = _warm(lay, "key", t, open_B, k, warming_k)
            if t < r_v and bool(warming_v.any()):
                open_E[:, :, t] = _warm(lay, "value", t, open_E, v, warming_v)
            if not adaptive:  # A8: steps 2 and 3 for this token (no refresh before W)
                store(lay, "key", t, torch.matmul(open_B, k[..., None])[..., 0])
                store(lay, "value", t, torch.matmul(open_E, v[..., None])[..., 0])
                buf_k, filled_k = fd.insert_(buf_k, filled_k, k[:, :, None], policy.ell_k)
                buf_v, filled_v = fd.insert_(buf_v, filled_v, v[:, :, None], policy.ell_v)
                i += 1
                continue

        if adaptive:
            s = 1 if t < W else min(n_new - i, window)
            kk, vv = k_all[:, :, i : i + s], v_all[:, :, i : i + s]
            # steps 1-2 for the whole window with the open bases, then step 3 per token (a side
            # still warming does not fire; the length cap waits for both sides)
            c, dv, rho_k, rho_v = project(kk, vv, open_B, open_E)
            ends = torch.arange(t + 1, t + 1 + s, device=device)  # t + 1 per token
            # tokens held when t is decided (spec A7.2)
            capped = (~warming_k & ~warming_v)[..., None] & (ends - int(reproject) - open_start[..., None] >= policy.max_chunk)
            over_k = (~warming_k[..., None]) & (rho_k > policy.tau_k)
            over_v = (~warming_v[..., None]) & (rho_v > policy.tau_v)
            if track:  # spec A7.4 step 1: a side with a free row grows (over tau / 2) instead of firing
                free_k, free_v = ~tracking.full(open_B, mask_k)[..., None], ~tracking.full(open_E, mask_v)[..., None]
                grow_k = tracking.growing(rho_k, warming_k[..., None], policy.tau_k) & free_k
                grow_v = tracking.growing(rho_v, warming_v[..., None], policy.tau_v) & free_v
                fire = (over_k & ~free_k) | (over_v & ~free_v) | capped
            else:
                fire = over_k | over_v | capped
            # spec A7.3 (num_chunks is constant up to the first event, where the window stops)
            want = fire
            fire = want & (may_open(num_chunks[..., None].double(), ends.double()) | (reproject & (open_start[..., None] == ends - 1)))
            event = fire | grow_k | grow_v if track else fire  # what changes the open bases
            any_head = event.flatten(0, 1).any(0)
            # one host sync: the first event, and per token the running count of (token, head) pairs
            # over tau, which before the event are refused triggers stored over tau (A7.4's count)
            first_event = torch.where(any_head, torch.arange(s, device=device), s).min()
            synced = torch.cat([first_event[None], (over_k | over_v).flatten(0, 1).sum(0).cumsum(0)]).tolist()
            first = int(synced[0])
            take = min(first + 1, s)
            over_tau += int(synced[first]) if first > 0 else 0
            if first < s:
                # paper: step 4 for the tokens before the firing one, then step 3 at it, then its
                # step 4; reproject (A7.2): step 4 through the firing token, then step 3
                upto = first + 1 if reproject else first
                buf_k, filled_k = fd.insert_(buf_k, filled_k, kk[:, :, :upto], policy.ell_k)
                buf_v, filled_v = fd.insert_(buf_v, filled_v, vv[:, :, :upto], policy.ell_v)
                if track:  # A7.4 step 1 at the event token
                    for which, grows, x, coef, basis, mask in (
                        ("key", grow_k[:, :, first] & ~fire[:, :, first], kk[:, :, first], c, open_B, mask_k),
                        ("value", grow_v[:, :, first] & ~fire[:, :, first], vv[:, :, first], dv, open_E, mask_v),
                    ):
                        gn, gh = grows.nonzero(as_tuple=True)
                        if len(gn):
                            gj = num_chunks[gn, gh] - 1
                            if not private and bool((gj < first_new[gn, gh]).any()):  # a visible chunk grows in a private copy
                                lay, private = lay.with_private_bases(), True
                            tracking.grow(lay, which, basis, mask, gn, gh, gj, x)
                            coef[gn, gh, first] = torch.matmul(basis[gn, gh], x[gn, gh][..., None])[..., 0]
                fn, fh = fire[:, :, first].nonzero(as_tuple=True)
                if len(fn):
                    start = t + first + 1 - reproject
                    # chunk slot j >= num_chunks: spare until the commit (with reproject, an empty
                    # open chunk -- chunk 0 at t = 0 without warm-up -- takes the snapshot itself)
                    j = num_chunks[fn, fh] - (reproject & (open_start[fn, fh] == start)).long()
                    new_B = fd.top_directions(buf_k[fn, fh, :filled_k], r) * mask_k[fh]
                    new_E = fd.top_directions(buf_v[fn, fh, :filled_v], r_v) * mask_v[fh]
                    if track:  # A7.4 step 2: each side's bases hold the firing token within tau
                        new_B = tracking.spanning(new_B, kk[fn, fh, first], policy.tau_k)
                        new_E = tracking.spanning(new_E, vv[fn, fh, first], policy.tau_v)
                    new_B = lay.store_basis("key", (fn, fh, j), new_B)
                    new_E = lay.store_basis("value", (fn, fh, j), new_E)
                    chunk_starts[fn, fh, j] = start
                    num_chunks[fn, fh] = j + 1
                    if reproject:  # A7.2: the firing token is stored with the new chunk's bases
                        c[fn, fh, first] = torch.matmul(new_B, kk[fn, fh, first][..., None])[..., 0]
                        dv[fn, fh, first] = torch.matmul(new_E, vv[fn, fh, first][..., None])[..., 0]
                    if track:  # A7.4 step 3: the sketches summarise the new chunk's tokens only
                        tracking.restart(buf_k, filled_k, fn, fh, kk[:, :, first])
                        tracking.restart(buf_v, filled_v, fn, fh, vv[:, :, first])
                    elif getattr(policy, "sketch_reset", False):
                        # step 3b: after the snapshot, forget what a long enough closing chunk taught
                        # (with reproject the closing chunk ends before the firing token, which the
                        # new chunk's sketch keeps)
                        long = (start - open_start[fn, fh]) >= max(policy.ell_k, policy.ell_v)
                        ln, lh = fn[long], fh[long]
                        buf_k[ln, lh] = 0.0
                        buf_v[ln, lh] = 0.0
                        if reproject:
                            buf_k[ln, lh, filled_k - 1] = kk[ln, lh, first]
                            buf_v[ln, lh, filled_v - 1] = vv[ln, lh, first]
                    open_start[fn, fh] = start
                    open_B[fn, fh] = new_B
                    open_E[fn, fh] = new_E
                if not reproject:
                    buf_k, filled_k = fd.insert_(buf_k, filled_k, kk[:, :, first : first + 1], policy.ell_k)
                    buf_v, filled_v = fd.insert_(buf_v, filled_v, vv[:, :, first : first + 1], policy.ell_v)
                refused = want[:, :, first] & ~fire[:, :, first]
                if bool(refused.any()):  # A7.4's count: a refused trigger that leaves the event token over tau as stored
                    rk, rv = relative_residual(kk[:, :, first], c[:, :, first]), relative_residual(vv[:, :, first], dv[:, :, first])
                    over_tau += int((refused & (((~warming_k) & (rk > policy.tau_k)) | ((~warming_v) & (rv > policy.tau_v)))).sum())
            else:
                buf_k, filled_k = fd.insert_(buf_k, filled_k, kk, policy.ell_k)
                buf_v, filled_v = fd.insert_(buf_v, filled_v, vv, policy.ell_v)
            store(lay, "key", slice(t, t + take), c[:, :, :take])  # A10: the trigger used unquantised c
            store(lay, "value", slice(t, t + take), dv[:, :, :take])
            if t >= W:
                window = _next_window(window, first, s)
            i += take
        else:
            m = policy.refresh_every
            refresh_t = W - 1 + m * -(-(t + 1 - W) // m)  # the first t' >= t with (t' + 1 - W) % m == 0
            s = min(n_new - i, refresh_t - t + 1)
            kk, vv = k_all[:, :, i : i + s], v_all[:, :, i : i + s]
            c, dv, _, _ = project(kk, vv, open_B, open_E)  # step 2
            store(lay, "key", slice(t, t + s), c)
            store(lay, "value", slice(t, t + s), dv)
            buf_k, filled_k = fd.insert_(buf_k, filled_k, kk, policy.ell_k)  # step 3
            buf_v, filled_v = fd.insert_(buf_v, filled_v, vv, policy.ell_v)
            if t + s - 1 == refresh_t:
                # step 4: new bases from the whole buffers, stored coefficients rotated by B B'^T
                new_B = lay.store_basis("key", every, fd.top_directions(buf_k, r) * mask_k)
                new_E = lay.store_basis("value", every, fd.top_directions(buf_v, r_v) * mask_v)
                upto = refresh_t + 1
                lay = _rotated(lay, "key", upto, torch.matmul(open_B, new_B.mT), own_coef)
                lay = _rotated(lay, "value", upto, torch.matmul(open_E, new_E.mT), own_coef)
                own_coef = True
                open_B, open_E = new_B, new_E
            i += s

    state.layout = replace(lay, num_chunks=num_chunks, chunk_starts=chunk_starts, num_tokens=T + n_new)
    state.sketches = replace(
        sk,
        keys=buf_k.to(sk.keys.dtype),
        values=buf_v.to(sk.values.dtype),
        filled_k=filled_k,
        filled_v=filled_v,
        rows_seen=sk.rows_seen + n_new,
        tokens_over_tau=sk.tokens_over_tau + over_tau,
    )


def _warm(lay, which: str, t: int, open_basis: torch.Tensor, x: torch.Tensor, warming: torch.Tensor) -> torch.Tensor:
    """Spec A7 step 0 for token t, as the oracle's ``OnlineRun._warm_row`` (subspace_ref.policies.online_run): chunk-0 row t of the
    heads still ``warming`` becomes x's unit residual; other heads keep their open row t."""
    floor = 2 * row_error_bound(lay.basis_format, x.shape[-1])
    row = torch.where(warming[..., None], warmup_row(open_basis, x, floor), 0.0)
    decoded = lay.store_basis(which, (slice(None), slice(None), 0, t), row)
    return torch.where(warming[..., None], decoded, open_basis[:, :, t])


def sketch_variant_reasons(policy) -> list[str]:
    """The online-sketch options of spec/sketch_variants.md set away from their neutral values:
    the oracle implements them, this backend refuses them.

    Parameters
    ----------
    policy : Policy

    Returns
    -------
    list of str
        One reason per option set, empty when none is.
    """
    out = []
    if getattr(policy, "ring_warm_start", 0):
        out.append(f"ring_warm_start={policy.ring_warm_start}")
    if getattr(policy, "fd_stride", 1) != 1:
        out.append(f"fd_stride={policy.fd_stride}")
    if getattr(policy, "reuse_angle", None) is not None:
        out.append(f"reuse_angle={policy.reuse_angle}")
    return out


def _next_window(window: int, first: int, size: int) -> int:
    """Speculation length of the next adaptive window: about twice the last gap between triggers
    (few recomputed tokens when heads fire often, few syncs when they fire rarely)."""
    if first >= size:
        return min(2 * window, MAX_WINDOW)
    return max(MIN_WINDOW, min(2 * (first + 1), MAX_WINDOW))
