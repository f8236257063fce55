"""Spec A8: appending to a rotating state, one basis per head refreshed from the FD sketches every
``refresh_every`` tokens, with every stored coefficient rotated into the new basis."""

from __future__ import annotations

from typing import Any

from subspace_ref import frequent_directions as fd
from subspace_ref.policies.online_run import OnlineRun
from subspace_ref.policies.storing import rotated, store


def append_rotating(state, keys: Any, values: Any) -> None:
    """Spec A8 for keys (N, H, n, d), values (N, H, n, d_v), token by token."""
    run = OnlineRun(state, keys, values)
    policy, xp = run.policy, run.xp
    every = (slice(None), slice(None), 0)  # the single basis of every sequence and head
    for i in range(run.n_new):
        t = run.T + i
        k, v = keys[:, :, i], values[:, :, i]
        run.warm(t, k, v)  # step 0 (A7's, shared)
        c, dv = run.coefficients(k, v)  # step 1
        store(run.lay, "key", t, c)  # step 2
        store(run.lay, "value", t, dv)
        run.feed(t, k, v)  # step 3: the FD update
        if t >= policy.warmup and (t + 1 - policy.warmup) % policy.refresh_every == 0:
            # step 4: new basis, and every stored coefficient moved into it by R = B B'^T
            # (R is taken between the decoded stored bases: spec/storage.md S3)
            new_B = run.lay.store_basis("key", every, fd.top_directions(run.buf_k, run.open_B.shape[2]) * run.mask_k)
            new_E = run.lay.store_basis("value", every, fd.top_directions(run.buf_v, run.open_E.shape[2]) * run.mask_v)
            run.lay = rotated(run.lay, "key", t + 1, xp.einsum("nhrd,nhsd->nhrs", run.open_B, new_B))
            run.lay = rotated(run.lay, "value", t + 1, xp.einsum("nhrd,nhsd->nhrs", run.open_E, new_E))
            run.open_B, run.open_E = new_B, new_E
            run.svds += 2 * run.stack
    run.commit(state)
