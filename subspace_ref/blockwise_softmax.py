"""The one-pass blockwise softmax of spec A3 and the partial-result merge of spec A3.2."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SoftmaxPartial:
    """Running (m, Z, N) over the tokens seen so far (spec A3): max logit, normaliser, numerator.

    ``N`` is kept in output space (d_v numbers); a chunk's contribution enters through
    :meth:`add_chunk` already mapped through its value basis, once per chunk.
    """

    m: float
    Z: float
    N: np.ndarray

    @classmethod
    def empty(cls, d_v: int, dtype=np.float64) -> "SoftmaxPartial":
        """The identity of the merge (spec A3.2): no tokens."""
        return cls(m=-np.inf, Z=0.0, N=np.zeros(d_v, dtype=dtype))

    def add_chunk(self, logits: np.ndarray, value_coef: np.ndarray, value_basis: np.ndarray) -> None:
        """Spec A3 steps 2.2-2.3 for one chunk: logits (L,), coefficients D_j (L, r_v), E_j (r_v, d_v)."""
        if logits.size == 0:
            return
        m_j = logits.max()
        if m_j > self.m:
            rescale = np.exp(self.m - m_j)
            self.Z *= rescale
            self.N = self.N * rescale
            self.m = m_j
        w = np.exp(logits - self.m)
        self.Z += w.sum()
        self.N = self.N + (w @ value_coef) @ value_basis

    def merge(self, other: "SoftmaxPartial") -> "SoftmaxPartial":
        """Spec A3.2: combine two partials over disjoint token sets."""
        m = max(self.m, other.m)
        if m == -np.inf:
            return SoftmaxPartial(m, 0.0, self.N + other.N)
        a, b = np.exp(self.m - m), np.exp(other.m - m)
        return SoftmaxPartial(m, self.Z * a + other.Z * b, self.N * a + other.N * b)

    def result(self) -> np.ndarray:
        """Spec A3 step 3: N / Z."""
        if self.Z == 0:
            raise ValueError("no tokens were attended to; the softmax of an empty set is undefined")
        return self.N / self.Z
