"""Long-range recall ("needle in a haystack") from held-out stdlib code.

An instance of ``length`` bytes is held-out code (the haystack) with, at line boundary nearest
``depth`` of the way in, a *needle*: a distinct held-out line of 50-80 bytes. The context ends
with the needle's first ``PREFIX`` bytes on a fresh line; the answer is its next ``ANSWER`` bytes,
which only the needle determines (up to what code conventions make guessable: each cell also has
a *control* without the needle, which measures that). Greedy decoding must reproduce the answer
bytes exactly; that equals every answer byte being the argmax given the previous ones
(:func:`score_answer`), read from one teacher-forced pass.

Formats like ``SECRET_KEY_17 = "qzxw"`` ... ``assert SECRET_KEY_17 == "`` and copied identifiers
were tried first: the shipped model solves none of them (0/16 at 256 and 1000 bytes), so the task
uses the format it does best on; see docs/tasks.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

PREFIX, ANSWER = 32, 6
LINE_MIN, LINE_MAX = 50, 80


@dataclass
class NeedleInstance:
    length: int
    depth: float
    needle: bool  # False: the control (same haystack and query, no needle)
    ids: list  # token ids (bytes), the answer included at the end
    answer_len: int
    seed: int
    index: int

    def as_dict(self) -> dict:
        return asdict(self)


def _needle_lines(stream: np.ndarray, limit: int = 2_000_000) -> list[bytes]:
    return [ln for ln in bytes(stream[:limit]).split(b"\n") if LINE_MIN <= len(ln) <= LINE_MAX and ln.strip()]


def make_needles(stream: np.ndarray, lengths, depths, n: int, seed: int = 0, controls: bool = True) -> list[NeedleInstance]:
    """``n`` instances per (length, depth), with their controls; deterministic given ``seed``."""
    if min(lengths) < 2 * (LINE_MAX + 1) + ANSWER:
        raise ValueError(f"lengths must be >= {2 * (LINE_MAX + 1) + ANSWER} bytes, got {min(lengths)}")
    lines = _needle_lines(stream)
    out = []
    for L in lengths:
        for depth in depths:
            rng = np.random.default_rng([seed, int(L), int(round(1000 * depth))])
            for i in range(n):
                line = lines[int(rng.integers(len(lines)))] + b"\n"
                q, ans = line[:PREFIX], line[PREFIX : PREFIX + ANSWER]
                nhay = L - len(line) - len(q) - len(ans)
                st = int(rng.integers(L, len(stream) - L))
                hay = bytes(stream[st : st + nhay])
                nl = hay.rfind(b"\n", 0, int(depth * nhay)) + 1
                for with_needle in ((True, False) if controls else (True,)):
                    text = hay[:nl] + (line if with_needle else b"") + hay[nl:]
                    text = text[: text.rfind(b"\n") + 1] + q
                    pad = L - len(text) - len(ans)
                    text = bytes(stream[st - pad : st]) + text
                    ids = np.frombuffer(text + ans, dtype=np.uint8).astype(int).tolist()
                    assert len(ids) == L
                    out.append(NeedleInstance(int(L), float(depth), with_needle, ids, len(ans), int(seed), i))
    return out


def score_answer(logits, ids, answer_len: int) -> np.ndarray:
    """(B,) bool: greedy decoding reproduces the last ``answer_len`` tokens of each row of ``ids``
    given ``logits`` (B, T, V) of the whole row."""
    import torch

    ids = torch.as_tensor(np.asarray(ids))
    pred = torch.as_tensor(logits)[:, -answer_len - 1 : -1].argmax(-1)
    return (pred == ids[:, -answer_len:]).all(-1).cpu().numpy()
