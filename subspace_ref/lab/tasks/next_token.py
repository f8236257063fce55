"""Next-token top-1 accuracy and a LAMBADA-style last-identifier task on held-out windows.

LAMBADA-style targets: in a window, the last identifier (>= 3 bytes) of a line that already
occurred earlier in the window (so the context, not the line, determines it); the model must
produce all its bytes greedily given the line up to it. Both are read from one pass's logits.
"""

from __future__ import annotations

import re

import numpy as np

_LAST_IDENT = re.compile(rb"([A-Za-z_][A-Za-z0-9_]{2,})[^A-Za-z0-9_\n]*\n")


def next_token_correct(logits, ids) -> np.ndarray:
    """(B, T-1) bool: the argmax at position t is token t+1."""
    import torch

    ids = torch.as_tensor(np.asarray(ids))
    return (torch.as_tensor(logits)[:, :-1].argmax(-1) == ids[:, 1:]).cpu().numpy()


def lambada_targets(ids: np.ndarray, min_start: int = 16, per_window: int = 8, seed: int = 0) -> list[tuple[int, int, int]]:
    """``(window, start, length)`` targets: bytes ``ids[w, start:start+length]`` are a line's last
    identifier that appeared earlier in the window; at most ``per_window`` per window (seeded)."""
    rng = np.random.default_rng(seed)
    out = []
    for w, row in enumerate(np.asarray(ids)):
        text = bytes(np.asarray(row, dtype=np.uint8))
        cands = []
        for m in _LAST_IDENT.finditer(text):
            a, b = m.span(1)
            if a < min_start or (a > 0 and (chr(text[a - 1]).isalnum() or text[a - 1] == ord("_"))):
                continue
            if re.search(rb"(?<![A-Za-z0-9_])" + re.escape(text[a:b]) + rb"(?![A-Za-z0-9_])", text[:a]):
                cands.append((w, a, b - a))
        if len(cands) > per_window:
            pick = np.sort(rng.choice(len(cands), per_window, replace=False))
            cands = [cands[i] for i in pick]
        out += cands
    return out


def lambada_correct(logits, ids, targets) -> np.ndarray:
    """(len(targets),) bool: every byte of each target is the argmax given the previous bytes."""
    import torch

    pred = torch.as_tensor(logits).argmax(-1).cpu().numpy()
    ids = np.asarray(ids)
    return np.array([bool((pred[w, s - 1 : s - 1 + n] == ids[w, s : s + n]).all()) for w, s, n in targets], dtype=bool)
