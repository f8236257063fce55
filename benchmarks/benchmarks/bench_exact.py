"""Exact-attention baselines (spec A1) on the same layer shape as ``bench_attend``: torch SDPA on
the CPU and on CUDA, and the NumPy oracle ``subspace_ref.exact_attention``."""

from __future__ import annotations

import numpy as np

import subspace_ref as sr
from subspace_ref.roofline import Shape, exact_layer_cost

from . import common as C

IMPLS = ["numpy", "sdpa-cpu", "sdpa-cuda"]
#: exact_attention materialises the (H, T) logits and repeats K, V per query group: small T only.
NUMPY_EXACT_MAX_T = 16384


class ExactAttention:
    params = (IMPLS, C.CONTEXTS)
    param_names = ["impl", "T"]
    timeout = 600

    def setup(self, impl, T):
        q = np.random.default_rng(5).standard_normal((C.HEADS * C.GROUP, C.D)).astype(C.DTYPE)
        K, V = C.tokens(11, T), C.tokens(12, T)
        self.sync = lambda: None
        if impl == "numpy":
            if T > NUMPY_EXACT_MAX_T:
                raise NotImplementedError(f"the NumPy exact_attention oracle is benchmarked at T <= {NUMPY_EXACT_MAX_T} only")
            self.fn = lambda: sr.exact_attention(q, K, V)
            return
        if C.torch is None:
            raise NotImplementedError("torch is not installed")
        device = impl.removeprefix("sdpa-")
        if device == "cuda":
            if not C.torch.cuda.is_available():
                raise NotImplementedError("torch sees no CUDA device")
            self.sync = C.torch.cuda.synchronize
        self.fn = C.sdpa(device, q, K, V)

    def time_exact(self, impl, T):
        self.fn()
        self.sync()

    def track_bytes_per_token(self, impl, T):
        """Model bytes of one decode token's exact attention over the layer (spec R2.5, R2.6)."""
        return float(exact_layer_cost(T, Shape(C.D, C.D, C.GROUP, 4.0), C.HEADS).phase("attend").bytes)

    track_bytes_per_token.unit = "bytes"

    def track_flops_per_token(self, impl, T):
        """Model FLOPs of one decode token's exact attention over the layer (spec R2.1-R2.4)."""
        return float(exact_layer_cost(T, Shape(C.D, C.D, C.GROUP, 4.0), C.HEADS).phase("attend").flops)

    track_flops_per_token.unit = "FLOPs"
