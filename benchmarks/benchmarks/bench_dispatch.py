"""Dispatch overhead of ``attend`` (issue 18 item 5): a state of 16 tokens, where the attention
work is negligible and what is measured is the layers above the kernel (validation, capability
checks, dispatch), held against torch SDPA over the same 16 tokens in the same run.

One layer as in bench_attend (8 KV heads, d = d_v = 128, float32, rank 16), static state.
Goal: attend / SDPA <= 3 on torch-cpu.
"""

from __future__ import annotations

import numpy as np

from subspace_ref import attend

from . import common as C

TINY_T = 16


class Dispatch:
    params = (["numpy", "torch-cpu", "torch-cuda", "triton", "cupy"],)
    param_names = ["backend"]
    timeout = 300

    def setup(self, backend):
        self.target = C.target(backend)
        if self.target.cuda and (C.torch is None or not C.torch.cuda.is_available()):
            raise NotImplementedError(f"{backend}: torch sees no CUDA device")
        self.state = self.target.state(C.static_state(TINY_T, 16))
        self.q = C.query(self.target)
        q = np.random.default_rng(5).standard_normal((C.HEADS * C.GROUP, C.D)).astype(C.DTYPE)
        device = "cuda" if self.target.cuda else "cpu"
        if C.torch is None:
            raise NotImplementedError("the SDPA baseline needs torch")
        self.sdpa = C.sdpa(device, q, C.tokens(11, TINY_T), C.tokens(12, TINY_T))

    def _attend(self):
        return attend(self.q, self.state, backend=self.target.backend)

    def time_attend_tiny(self, backend):
        self._attend()
        self.target.sync()

    def track_attend_us(self, backend):
        return C.median_seconds(self._attend, self.target.sync, min_total=0.2, max_runs=2000) * 1e6

    track_attend_us.unit = "microseconds"

    def track_sdpa_us(self, backend):
        return C.median_seconds(self.sdpa, self.target.sync, min_total=0.2, max_runs=2000) * 1e6

    track_sdpa_us.unit = "microseconds"

    def track_ratio_to_sdpa(self, backend):
        """attend / SDPA at T = 16, both measured here, now (goal on torch-cpu: <= 3)."""
        a = C.median_seconds(self._attend, self.target.sync, min_total=0.2, max_runs=2000)
        s = C.median_seconds(self.sdpa, self.target.sync, min_total=0.2, max_runs=2000)
        return a / s

    track_ratio_to_sdpa.unit = "ratio"
