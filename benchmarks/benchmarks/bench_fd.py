"""Frequent Directions updates (spec A4) of the public NumPy ``FrequentDirections``: one row at a
time (the decode case) and in blocks. The backends' own FD work is timed through their adaptive
appends (``bench_append``)."""

from __future__ import annotations

import numpy as np

from subspace_ref import FrequentDirections
from subspace_ref.roofline import Shape, Subspace, subspace_cost

from . import common as C

DIMS = [128] if C.QUICK else [64, 128]
ELLS = [32] if C.QUICK else [16, 32, 64]
BLOCK = 256 if C.QUICK else 1024


class FrequentDirectionsUpdate:
    params = (DIMS, ELLS)
    param_names = ["d", "ell"]

    def setup(self, d, ell):
        rng = np.random.default_rng(0)
        self.rows = rng.standard_normal((BLOCK, d)).astype(C.DTYPE)
        self.fd = FrequentDirections(d, ell, dtype=C.DTYPE).update(self.rows[: 2 * ell])  # buffer full once
        self.i = 0

    def time_update_row(self, d, ell):
        """One row; asv's repeats make this the amortised cost, one SVD per ell + 1 rows (spec R7.3)."""
        self.fd.update(self.rows[self.i % BLOCK])
        self.i += 1

    def time_update_block(self, d, ell):
        self.fd.update(self.rows)

    def track_flops_per_row(self, d, ell):
        """Model FLOPs per row of one sketch (spec R7.2, R7.3)."""
        cost = subspace_cost(1, Shape(d, d, 1, 4.0), Subspace(1, 1, chunks=1, ell_k=ell, ell_v=ell))
        return float(cost.term("fd_compact").flops / 2)  # the term holds the key and the value sketch

    track_flops_per_row.unit = "FLOPs"
