"""H2O, heavy-hitter oracle (Zhang et al. 2023; own code).

Per layer, sequence and KV head the cache holds at most ``heavy + recent`` tokens. Decoding step
``p``: token ``p`` is appended; if the cache then holds more than the capacity, the token with the
smallest accumulated attention among those *outside* the ``recent`` most recent positions
(``t <= p - recent``) is evicted (ties: the oldest); query ``p`` attends the kept tokens, and its
attention probabilities (summed over the query heads sharing the KV head) are added to the kept
tokens' scores. So the cache always holds the ``recent`` newest tokens plus the heavy hitters.

The per-layer loop runs over query positions inside one forward (queries, keys and values of a
layer at position p depend only on positions <= p), so the teacher-forced window equals decoding
(checked against one-token steps in the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from subspace_ref.lab.baselines._attention import repeat_kv
from subspace_ref.byte_convention import Bytes, Geometry, make_bytes


@dataclass(frozen=True)
class H2O:
    heavy: int
    recent: int
    family: str = "H2O"
    source: str = "own code (accumulated-attention eviction mask over a DynamicCache)"
    #: per kept token and KV head: float32 accumulated score + int16 position
    EXTRA_BYTES = 6

    def __post_init__(self):
        if self.recent < 1:
            raise ValueError("H2O needs recent >= 1 (the new token is always kept)")

    @property
    def capacity(self) -> int:
        return self.heavy + self.recent

    @property
    def name(self) -> str:
        return f"H2O {self.heavy}+{self.recent}"

    def bytes(self, geom: Geometry) -> Bytes:
        kept = min(self.capacity, geom.context) / geom.context
        return make_bytes(
            geom, keys=geom.head_dim * geom.float_bytes * kept, values=geom.value_dim * geom.float_bytes * kept,
            scores_and_positions=self.EXTRA_BYTES * kept,
        )

    def runtime(self, layer_idx: int) -> "H2ORuntime":
        return H2ORuntime(self.heavy, self.recent)


class H2ORuntime:
    """State of one layer: ``keep`` (B, H, T) bool and ``score`` (B, H, T) float64."""

    def __init__(self, heavy: int, recent: int):
        self.capacity, self.recent = heavy + recent, recent
        self.keep: torch.Tensor | None = None
        self.score: torch.Tensor | None = None
        self.history: list[torch.Tensor] = []  # keep masks after each step (when record=True)
        self.record = False

    def _grow(self, B: int, H: int, T: int, device) -> None:
        if self.keep is None:
            self.keep = torch.zeros((B, H, 0), dtype=torch.bool, device=device)
            self.score = torch.zeros((B, H, 0), dtype=torch.float64, device=device)
        extra = T - self.keep.shape[2]
        if extra > 0:
            self.keep = torch.cat([self.keep, torch.zeros((B, H, extra), dtype=torch.bool, device=device)], dim=2)
            self.score = torch.cat([self.score, torch.zeros((B, H, extra), dtype=torch.float64, device=device)], dim=2)

    def step(self, p: int) -> None:
        """Append token p and evict down to capacity."""
        keep, score = self.keep, self.score
        keep[:, :, p] = True
        over = keep[:, :, : p + 1].sum(-1) > self.capacity  # (B, H)
        if bool(over.any()):
            cand = keep[:, :, : p + 1].clone()
            cand[:, :, max(0, p - self.recent + 1) :] = False
            s = torch.where(cand, score[:, :, : p + 1], torch.full_like(score[:, :, : p + 1], float("inf")))
            victim = s.argmin(dim=-1)  # first minimum = oldest on ties
            b, h = over.nonzero(as_tuple=True)
            keep[b, h, victim[b, h]] = False

    def attend(self, q, k, v, scaling):
        B, Hq, n, _ = q.shape
        H, T = k.shape[1], k.shape[2]
        g = Hq // H
        T0 = T - n
        if T0 == 0:  # a new sequence
            self.keep = self.score = None
            self.history = []
        self._grow(B, H, T, q.device)
        kr, vr = repeat_kv(k, g), repeat_kv(v, g)
        outs = []
        for i in range(n):
            p = T0 + i
            self.step(p)
            keep = self.keep[:, :, : p + 1]
            if self.record:
                self.history.append(self.keep[:, :, : p + 1].clone())
            logits = (q[:, :, i : i + 1] @ kr[:, :, : p + 1].transpose(-1, -2))[:, :, 0] * scaling  # (B, Hq, p+1)
            logits = logits.masked_fill(~repeat_kv(keep, g), float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            outs.append((probs[:, :, None] @ vr[:, :, : p + 1]))
            self.score[:, :, : p + 1] += probs.view(B, H, g, p + 1).sum(2).to(torch.float64)
        return torch.cat(outs, dim=2)
