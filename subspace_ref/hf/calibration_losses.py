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
from dataclasses import dataclass, replace

import numpy as np
import torch

from subspace_ref.allocation import BITS, KEY_BASES, Allocation, allocate, allocation_bases, check_max_pre_rope_rank, plane_rows, side_losses
from subspace_ref.byte_convention import Geometry
from subspace_ref.calibration import StaticBasis
from subspace_ref.hf.capture import ModelCapture, capture
from subspace_ref.linalg import svd as _svd
from subspace_ref.rope import RopeParams

#: Tokens (the first of the calibration windows) and queries the losses are measured on.
LOSS_TOKENS = 2048
LOSS_QUERIES = 512
#: What the allocator's loss measures (:mod:`subspace_ref.allocation`): ``fisher`` (the default),
#: reconstruction errors weighted by the gradient of the model's next-token loss; ``proxy``, the
#: per-head output-error proxy (logit error x value spread, value error).
LOSSES = ("fisher", "proxy")
#: The (sinks, window) pairs whose Fisher losses are measured by default, among which
#: :meth:`CalibrationLosses.allocate_best` chooses: no exact tokens, and 4 sinks with windows of
#: 0 to 128 tokens (spec/layer_state.md L6.2).
EXACT = ((0, 0), (4, 0), (4, 16), (4, 32), (4, 64), (4, 128))


@dataclass(frozen=True)
class CalibrationLosses:
    """The allocator's input for one model (:func:`calibration_losses`).

    ``losses[layer][head]``: :func:`~subspace_ref.allocation.side_losses` tables. ``svd``,
    ``svd_pre``: per layer ``Wk`` (H, d, d), ``Wv`` (H, d_v, d_v) right-singular vectors of the
    post-RoPE (pre-RoPE) keys and values, rows by decreasing singular value, and their singular
    values ``Sk``, ``Sv``. ``planes``: per layer (H, d, d) plane bases (spec/rope.md P4).
    ``context``: the calibration windows' length, over which bases are amortised. ``loss``: what
    the tables measure (:data:`LOSSES`). ``by_exact``: {(sinks, window): tables} measured with
    the gradients of the queries that read each token compressed (``fisher``; ``losses`` are
    the tables of (0, 0), every query)."""

    losses: list
    svd: list
    svd_pre: list
    planes: list
    rope: RopeParams
    context: int
    tokens: int
    loss_tokens: int
    group: int
    loss: str = "fisher"
    by_exact: dict | None = None

    def tables(self, sinks: int, window: int) -> list:
        """The loss tables allocations with ``sinks`` and ``window`` exact tokens use: those
        measured for them (``by_exact``), else ``losses`` (every query counted)."""
        return (self.by_exact or {}).get((int(sinks), int(window)), self.losses)

    def geometry(self, model) -> Geometry:
        """The byte geometry allocations use: ``model``'s cache at the calibration context
        (``model`` may be that :class:`~subspace_ref.byte_convention.Geometry` itself)."""
        return model if isinstance(model, Geometry) else Geometry.of_model(model, self.context)

    def allocate(self, model, *, compression_ratio: float | None = None, bytes_per_token: float | None = None, window: int = 0, sinks: int = 0,
                 key_bases: tuple[str, ...] = KEY_BASES, max_pre_rope_rank: int | None = None) -> Allocation:
        """:func:`~subspace_ref.allocation.allocate` over these losses for ``model``'s cache."""
        return allocate(self.tables(sinks, window), self.geometry(model), compression_ratio=compression_ratio, bytes_per_token=bytes_per_token,
                        group=self.group, window=window, sinks=sinks, key_bases=key_bases, max_pre_rope_rank=max_pre_rope_rank)

    def allocate_best(self, model, *, compression_ratio: float | None = None, bytes_per_token: float | None = None,
                      key_bases: tuple[str, ...] = KEY_BASES, max_pre_rope_rank: int | None = None) -> Allocation:
        """The allocation of least calibration loss over the measured (sinks, window) pairs
        (``by_exact``; spec/layer_state.md L6.2) whose exact tokens fit the budget: the window is
        chosen by the same loss as the ranks and bits. ``meta["exact_losses"]`` lists each
        pair's loss (None: does not fit). Without ``by_exact``: no exact tokens."""
        check_max_pre_rope_rank(max_pre_rope_rank)  # (a refusal below would read as a pair that does not fit)
        pairs = list(self.by_exact) if self.by_exact else [(0, 0)]
        best, tried = None, {}
        for sinks, window in pairs:
            try:
                a = self.allocate(model, compression_ratio=compression_ratio, bytes_per_token=bytes_per_token, window=window, sinks=sinks, key_bases=key_bases,
                                  max_pre_rope_rank=max_pre_rope_rank)
            except ValueError as err:
                if "key_bases" in str(err):
                    raise
                tried[f"{sinks},{window}"] = None
                continue
            tried[f"{sinks},{window}"] = a.calibration_loss
            if best is None or a.calibration_loss < best.calibration_loss:
                best = a
        if best is None:
            raise ValueError(f"no measured (sinks, window) pair fits the budget: {pairs}")
        return replace(best, meta=dict(best.meta, exact_losses=tried))

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


class _FarPairs(torch.autograd.Function):
    """Causal attention whose output is the stock one (the same operations in the same order)
    and whose backward gives the key and value of token t gradient only from the queries i that
    read them compressed (``far``), the query from every pair (spec L6.2). The backward
    recomputes one query head's scores at a time, so no (H, T, T) tensor outlives the forward:
    calibration's peak memory is the model's, not the probe's (docs/benchmarks.md)."""

    @staticmethod
    def forward(ctx, query, key, value, scale: float, sinks: int, window: int):
        g = query.shape[1] // key.shape[1]
        T = query.shape[2]
        i, t = torch.arange(T, device=query.device)[:, None], torch.arange(T, device=query.device)[None, :]
        p = (query @ key.repeat_interleave(g, 1).mT).mul_(scale).masked_fill_(t > i, float("-inf")).softmax(-1)
        out = p @ value.repeat_interleave(g, 1)
        ctx.save_for_backward(query, key, value, out)
        ctx.params = (scale, sinks, window)
        return out

    @staticmethod
    def backward(ctx, d_out):
        query, key, value, out = ctx.saved_tensors
        scale, sinks, window = ctx.params
        g = query.shape[1] // key.shape[1]
        T = query.shape[2]
        i, t = torch.arange(T, device=query.device)[:, None], torch.arange(T, device=query.device)[None, :]
        far = (i - t >= window) & (t >= sinks)
        dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
        for b in range(query.shape[0]):
            for hq in range(query.shape[1]):
                h = hq // g
                p = (query[b, hq] @ key[b, h].mT).mul_(scale).masked_fill_(t > i, float("-inf")).softmax(-1)
                # softmax backward: ds = p (dp - sum_j p_j dp_j), and sum_j p_j dp_j = dO . O
                ds = p * (d_out[b, hq] @ value[b, h].mT - (d_out[b, hq] * out[b, hq]).sum(-1, keepdim=True))
                dq[b, hq] = (ds @ key[b, h]).mul_(scale)
                dk[b, h] += (ds.masked_fill_(~far, 0.0).mT @ query[b, hq]).mul_(scale)
                dv[b, h] += p.masked_fill_(~far, 0.0).mT @ d_out[b, hq]
        return dq, dk, dv, None, None, None


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention (no padding, positions 0..T-1) whose output equals the stock one, but
    through which the key and value of token t get gradient only from the queries i that read
    them compressed: ``t >= sinks`` and ``i - t >= window`` (:data:`_PROBE`, :class:`_FarPairs`)."""
    probe = _PROBE[-1]
    if key.requires_grad:
        key.retain_grad()
        value.retain_grad()
    probe["recorded"][module.layer_idx] = (key, value)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = _FarPairs.apply(query, key, value, float(scale), int(probe["sinks"]), int(probe["window"]))
    return out.transpose(1, 2).contiguous(), None


_PROBE: list[dict] = []
PROBE_ATTENTION = "subspace_ref_gradient_probe"


def output_gradients(model, windows: np.ndarray, tokens: int | None = None, exact: Sequence[tuple[int, int]] = ((0, 0),)) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """For each ``(sinks, window)`` of ``exact``, per layer ``(G_k (H, N, d), G_v (H, N, d_v))``:
    the gradient of the summed next-token NLL of each calibration window (teacher-forced, the
    model's own outputs) with respect to every token's post-RoPE key and value of every KV head,
    counting only the queries that would read the token compressed, i.e. not the first ``sinks``
    tokens and not from the ``window`` queries that still hold it exactly ((0, 0): every query).
    Tokens of the windows in order, the first ``tokens`` of them (only the windows needed are
    run). The model's parameters get no gradient; its attention implementation is restored."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    windows = np.asarray(windows)
    T = windows.shape[1]
    need = len(windows) if tokens is None else min(len(windows), -(-int(tokens) // T))
    device = next(model.parameters()).device
    AttentionInterface.register(PROBE_ATTENTION, _probe_attention)
    AttentionMaskInterface.register(PROBE_ATTENTION, sdpa_mask)
    previous = model.config._attn_implementation
    flags = [p.requires_grad for p in model.parameters()]
    out = []
    model.eval()
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        model.set_attn_implementation(PROBE_ATTENTION)
        for sinks, window in exact:
            grads: dict[int, tuple[list, list]] = {}
            for i in range(need):
                _PROBE.append(dict(sinks=int(sinks), window=int(window), recorded={}))
                try:
                    x = torch.as_tensor(windows[i : i + 1], dtype=torch.long, device=device)
                    with torch.enable_grad():
                        hidden = model.get_input_embeddings()(x).detach().requires_grad_(True)  # a leaf, so that the graph is built
                        logits = model(inputs_embeds=hidden, use_cache=False).logits
                        torch.nn.functional.cross_entropy(logits[0, :-1].float(), x[0, 1:], reduction="sum").backward()
                    for li, (k, v) in _PROBE[-1]["recorded"].items():
                        slot = grads.setdefault(li, ([], []))
                        slot[0].append(k.grad[0].detach().to(torch.float64).cpu().numpy())
                        slot[1].append(v.grad[0].detach().to(torch.float64).cpu().numpy())
                finally:
                    _PROBE.pop()
            out.append([(np.concatenate(grads[li][0], axis=1)[:, :tokens], np.concatenate(grads[li][1], axis=1)[:, :tokens]) for li in sorted(grads)])
    finally:
        model.set_attn_implementation(previous)
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)
    return out


def capture_windows(model, ids: np.ndarray, *, rope: bool = True, queries: bool = True, batch: int = 4) -> ModelCapture:
    """Post-RoPE (or, ``rope=False``, un-rotated) keys, values and queries of every layer over the
    windows ``ids`` (n, T), ``batch`` windows a forward; tokens of all windows in order."""
    seqs = [torch.as_tensor(ids[i : i + batch]) for i in range(0, len(ids), batch)]
    return capture(model, seqs, rope=rope, queries=queries)


def calibration_losses(model, windows: np.ndarray, *, ranks: Sequence[int] | None = None, bits: Sequence[int] = BITS, group: int = 32,
                       batch: int = 4, identity: bool = True, svd: list | None = None, progress: bool = False, loss: str = "fisher",
                       exact: Sequence[tuple[int, int]] = EXACT) -> CalibrationLosses:
    """The allocator's losses for ``model`` from calibration ``windows`` (n, T) of token ids.

    Bases: SVDs of the post-RoPE and the un-rotated keys and of the values over every window's
    tokens (``svd``: the post-RoPE one when already computed), plane bases chosen by the key loss
    (spec/rope.md P4). Losses: :func:`~subspace_ref.allocation.side_losses` of every KV head on the
    first :data:`LOSS_TOKENS` tokens, queries of its group at :data:`LOSS_QUERIES` of them, at
    ``ranks`` (default every 4th, 0..d) x ``bits`` and the identity bases (``identity``),
    keys in groups of ``group`` tokens. ``progress``: a tqdm bar on stderr over the heads.
    ``loss``: ``fisher`` (default) weights each token's key and value error by the gradient of
    the model's next-token loss on those tokens (:func:`output_gradients`; one forward and
    backward per window measured), ``proxy`` is the per-head proxy (:data:`LOSSES`). ``exact``:
    the (sinks, window) pairs measured for ``fisher`` (``by_exact``), (0, 0) always."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
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
    exact = [(0, 0)] + [(int(s), int(w)) for s, w in exact if (int(s), int(w)) != (0, 0)]
    grads = output_gradients(model, windows, n, exact) if loss == "fisher" else None
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
        if grads is None:
            losses[li][h] = side_losses(layer, h, queries, grid, bits=bits, group=group, rope=rope, identity=identity)
        else:
            gk, gv = np.stack([g[li][0][h] for g in grads]), np.stack([g[li][1][h] for g in grads])
            losses[li][h] = side_losses(layer, h, queries, grid, bits=bits, group=group, rope=rope, identity=identity, key_grads=gk, value_grads=gv)
    by_exact = None
    if grads is not None:
        by_exact = {pair: [[losses[li][h][e] for h in range(len(losses[li]))] for li in range(len(losses))] for e, pair in enumerate(exact)}
        losses = by_exact[(0, 0)]
    return CalibrationLosses(losses, svd, svd_pre, planes, rope, int(windows.shape[1]), int(post.num_tokens), int(n), int(group), loss, by_exact)


__all__ = ["EXACT", "LOSSES", "LOSS_QUERIES", "LOSS_TOKENS", "CalibrationLosses", "calibration_losses", "capture_windows", "layer_svd", "output_gradients"]
