"""What the byte-budget allocator measures on a model (spec/layer_state.md L6, the loss of
:mod:`subspace_ref.allocation`): per layer and KV head, the calibration loss of every candidate
configuration of each side, and the bases the candidates are made of.

Example::

    from subspace_ref.hf import calibration_losses
    cal = calibration_losses(model, windows)                     # windows: (n, T) token ids
    allocation = cal.allocate(compression_ratio=0.25, sinks=4, window=32)
    bases = cal.bases(allocation)                                # one StaticBasis per layer
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from subspace_ref.allocation import BITS, Allocation, allocate, allocation_bases, plane_rows, side_losses
from subspace_ref.byte_convention import Geometry
from subspace_ref.calibration import StaticBasis
from subspace_ref.hf.capture import ModelCapture, capture
from subspace_ref.linalg import svd as _svd
from subspace_ref.rope import RopeParams

#: Tokens (the first of the calibration windows) and queries the losses are measured on.
LOSS_TOKENS = 2048
LOSS_QUERIES = 512


@dataclass(frozen=True)
class CalibrationLosses:
    """The allocator's input for one model (:func:`calibration_losses`).

    ``losses[layer][head]``: :func:`~subspace_ref.allocation.side_losses` tables. ``svd``,
    ``svd_pre``: per layer ``Wk`` (H, d, d), ``Wv`` (H, d_v, d_v) right-singular vectors of the
    post-RoPE (pre-RoPE) keys and values, rows by decreasing singular value, and their singular
    values ``Sk``, ``Sv``. ``planes``: per layer (H, d, d) plane bases (spec/rope.md P4).
    ``context``: the calibration windows' length, over which bases are amortised."""

    losses: list
    svd: list
    svd_pre: list
    planes: list
    rope: RopeParams
    context: int
    tokens: int
    loss_tokens: int
    group: int

    def geometry(self, model) -> Geometry:
        return Geometry.of_model(model, self.context)

    def allocate(self, model, *, compression_ratio: float | None = None, bytes_per_token: float | None = None, window: int = 0, sinks: int = 0) -> Allocation:
        """:func:`~subspace_ref.allocation.allocate` over these losses for ``model``'s cache."""
        return allocate(self.losses, self.geometry(model), compression_ratio=compression_ratio, bytes_per_token=bytes_per_token,
                        group=self.group, window=window, sinks=sinks)

    def bases(self, allocation: Allocation) -> list[StaticBasis]:
        """One :class:`StaticBasis` per layer holding ``allocation``'s ranks of each head's kind
        (:func:`~subspace_ref.allocation.allocation_bases`)."""
        return allocation_bases(allocation, self.svd, svd_pre=self.svd_pre, planes=self.planes)


def layer_svd(cap: ModelCapture) -> list[dict]:
    """Per layer: ``Wk`` (H, d, d) right-singular vectors (rows) and ``Sk`` (H, d) singular values
    of the captured keys (zero-padded when fewer tokens than d), and ``Wv``, ``Sv`` of the values
    (spec A5 step 1)."""
    out = []
    for layer in cap.layers:
        entry = {}
        for side, X in (("k", layer.keys), ("v", layer.values)):
            H, N, dim = X.shape
            W, S = np.zeros((H, dim, dim)), np.zeros((H, dim))
            for h in range(H):
                _, s, wt = _svd(X[h].astype(np.float64), full_matrices=N < dim)
                W[h] = wt[:dim]
                S[h, : s.size] = s
            entry["W" + side], entry["S" + side] = W, S
        out.append(entry)
    return out


def capture_windows(model, ids: np.ndarray, *, rope: bool = True, queries: bool = True, batch: int = 4) -> ModelCapture:
    """Post-RoPE (or, ``rope=False``, un-rotated) keys, values and queries of every layer over the
    windows ``ids`` (n, T), ``batch`` windows a forward; tokens of all windows in order."""
    seqs = [torch.as_tensor(ids[i : i + batch]) for i in range(0, len(ids), batch)]
    return capture(model, seqs, rope=rope, queries=queries)


def calibration_losses(model, windows: np.ndarray, *, ranks: Sequence[int] | None = None, bits: Sequence[int] = BITS, group: int = 32,
                       batch: int = 4, identity: bool = True, svd: list | None = None, progress: bool = False) -> CalibrationLosses:
    """The allocator's losses for ``model`` from calibration ``windows`` (n, T) of token ids.

    Bases: SVDs of the post-RoPE and the un-rotated keys and of the values over every window's
    tokens (``svd``: the post-RoPE one when already computed), plane bases chosen by the key loss
    (spec/rope.md P4). Losses: :func:`~subspace_ref.allocation.side_losses` of every KV head on the
    first :data:`LOSS_TOKENS` tokens, queries of its group at :data:`LOSS_QUERIES` of them, at
    ``ranks`` (default every 4th, 0..d) x ``bits`` and the identity bases (``identity``),
    keys in groups of ``group`` tokens. ``progress``: a tqdm bar on stderr over the heads."""
    windows = np.asarray(windows)
    if windows.ndim != 2 or windows.shape[0] < 1 or windows.shape[1] < 1:
        raise ValueError(f"windows must be (n, T) token ids with n, T >= 1, got shape {windows.shape}")
    rope = RopeParams.from_config(model.config)
    post = capture_windows(model, windows, queries=True, batch=batch)
    pre = capture_windows(model, windows, rope=False, queries=False, batch=batch)
    svd = layer_svd(post) if svd is None else svd
    svd_pre = layer_svd(pre)
    n = min(LOSS_TOKENS, post.num_tokens)
    positions = np.arange(n) % windows.shape[1]
    pick = np.linspace(0, n - 1, min(LOSS_QUERIES, n)).astype(int)
    heads = [(li, h) for li, layer in enumerate(post.layers) for h in range(layer.keys.shape[0])]
    if progress:
        from tqdm.auto import tqdm

        heads = tqdm(heads, desc="calibration losses", unit="head")
    losses = [[None] * layer.keys.shape[0] for layer in post.layers]
    planes = [np.zeros_like(entry["Wk"]) for entry in svd]
    for li, h in heads:
        lp, lq = post.layers[li], pre.layers[li]
        d = lp.keys.shape[-1]
        g = lp.queries.shape[0] // lp.keys.shape[0]
        queries = lp.queries[h * g : (h + 1) * g][:, pick].reshape(-1, d).astype(np.float64)
        keys = lp.keys[h, :n].astype(np.float64)
        planes[li][h] = plane_rows(keys, rope.planes(d), queries)  # P4: by the allocator's own key loss
        layer = dict(keys=keys, keys_pre=lq.keys[h, :n].astype(np.float64), values=lp.values[h, :n].astype(np.float64), positions=positions,
                     Wk=svd[li]["Wk"][h], Wk_pre=svd_pre[li]["Wk"][h], Wv=svd[li]["Wv"][h], Wk_plane=planes[li][h])
        grid = range(0, d + 1, 4) if ranks is None else ranks
        losses[li][h] = side_losses(layer, h, queries, grid, bits=bits, group=group, rope=rope, identity=identity)
    return CalibrationLosses(losses, svd, svd_pre, planes, rope, int(windows.shape[1]), int(post.num_tokens), int(n), int(group))


__all__ = ["LOSS_QUERIES", "LOSS_TOKENS", "CalibrationLosses", "calibration_losses", "capture_windows", "layer_svd"]
