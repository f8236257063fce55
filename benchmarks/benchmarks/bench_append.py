"""Appending decode tokens to a state (spec A6 static; spec A7 adaptive: residual test, trigger,
FD update -- the Frequent Directions work of a backend is measured here) per backend."""

from __future__ import annotations

import numpy as np

from subspace_ref.roofline import state_cost

from . import common as C

#: tokens already in the state when the timing starts
START = 256 if C.QUICK else 1024
BLOCKS = [1, 64]


class Append:
    """``time_append``: append a block of ``n`` tokens (every head) to a state that holds
    ``START`` tokens or more: asv repeats the call, so the state grows while it is timed and the
    amortised costs (FD compactions every ell + 1 rows, chunk snapshots) are included."""

    params = (C.TARGETS, C.KINDS, C.RANKS, BLOCKS)
    param_names = ["backend", "state", "rank", "n"]
    timeout = 600

    def setup_cache(self):
        states = {("adaptive", START, r): C.adaptive_states([START], r)[START] for r in C.RANKS}
        return C.save_states(states, "append-state")

    setup_cache.timeout = 1200

    def setup(self, paths, backend, kind, rank, n):
        self.target = C.target(backend)
        if backend == "triton":
            # state.to("triton") makes a torch state (engine "torch"): its appends run on the torch
            # backend, already timed as torch-cuda
            raise NotImplementedError("appends of a state converted for triton run on the torch backend (see torch-cuda)")
        state = C.static_state(START, rank) if kind == "static" else C.load_state(paths[("adaptive", START, rank)])
        self.state = self.target.state(state)
        # a pool of fresh tokens, cycled through (the values do not change the work much)
        self.K = [self.target.convert(x) for x in np.split(C.tokens(21, 16 * n), 16, axis=1)]
        self.V = [self.target.convert(x) for x in np.split(C.tokens(22, 16 * n), 16, axis=1)]
        self.i = 0

    def time_append(self, paths, backend, kind, rank, n):
        i = self.i % 16
        self.i += 1
        self.state.append(self.K[i], self.V[i])
        self.target.sync()

    def track_flops_per_token(self, paths, backend, kind, rank, n):
        """Model FLOPs of appending one token to the layer, FD upkeep included (spec R5-R9)."""
        return float(state_cost(self.state, group=C.GROUP).phase("append", "fd").flops)

    track_flops_per_token.unit = "FLOPs"

    def track_bytes_per_token(self, paths, backend, kind, rank, n):
        """Model bytes of appending one token to the layer, FD upkeep included (spec R5-R9)."""
        return float(state_cost(self.state, group=C.GROUP).phase("append", "fd").bytes)

    track_bytes_per_token.unit = "bytes"


class BlockAppendVsDecode:
    """Issue 19 item 3: the amortised cost per token of appending blocks of 256 tokens near a
    low-rank subspace to an adaptive state (r = 32, the state's own FD upkeep and chunk snapshots
    included) on torch-cpu, held against one exact SDPA decode step over 4096 tokens measured in
    the same run. Goal: <= 0.1. ``byte_ceiling``: spec A7.3 (inf: seed 001's policy)."""

    params = (["inf", "1.0"],)
    param_names = ["byte_ceiling"]
    timeout = 600
    BLOCK = 64 if C.QUICK else 256
    CONTEXT = 512 if C.QUICK else 4096

    def setup(self, byte_ceiling):
        tgt = C.target("torch-cpu")
        tokens = C.near_subspace_tokens(31, C.HEADS, 8 * self.BLOCK, C.D)
        values = C.near_subspace_tokens(32, C.HEADS, 8 * self.BLOCK, C.D)
        self.blocks = [(tgt.convert(tokens[:, a : a + self.BLOCK]), tgt.convert(values[:, a : a + self.BLOCK])) for a in range(0, 8 * self.BLOCK, self.BLOCK)]
        self.fresh = lambda: tgt.state(_adaptive_r32(float(byte_ceiling)))
        q = np.random.default_rng(5).standard_normal((C.HEADS * C.GROUP, C.D)).astype(C.DTYPE)
        self.sdpa = C.sdpa("cpu", q, C.tokens(11, self.CONTEXT), C.tokens(12, self.CONTEXT))

    def _append_all(self):
        state = self.fresh()
        for k, v in self.blocks:
            state.append(k, v)

    def track_ratio_to_sdpa_decode(self, byte_ceiling):
        """(seconds per appended token, amortised over 8 blocks from an empty state) / (one SDPA
        decode step at CONTEXT tokens), both measured here."""
        per_token = C.median_seconds(self._append_all, lambda: None, min_total=0.5, max_runs=5) / (8 * self.BLOCK)
        return per_token / C.median_seconds(self.sdpa, lambda: None, min_total=0.2, max_runs=200)

    track_ratio_to_sdpa_decode.unit = "ratio"


def _adaptive_r32(byte_ceiling: float):
    return C.sr.SubspaceState.adaptive(C.HEADS, C.D, rank_k=32, rank_v=32, max_chunk=C.MAX_CHUNK, dtype=C.DTYPE, byte_ceiling=byte_ceiling)


class AppendFormats:
    """Torch-cpu decode appends (one token, every head) to static states by coefficient format
    (issue 16): float32, int8 (spec A10), int4 and int2 (spec/quantization.md Q2, quantised on a
    CPU core by ``kernels/quantized_stores.c``). ``track_slowdown_vs_float`` is this format's
    append time over float32's, both measured in the same run: what quantising a token costs
    (1: nothing)."""

    params = (["float", "int8", "int4", "int2"],)
    param_names = ["format"]
    timeout = 600

    def setup(self, fmt):
        from subspace_ref import SubspaceState
        from subspace_ref.workloads import spanning_basis

        self.target = C.target("torch-cpu")
        K = [self.target.convert(x) for x in np.split(C.tokens(21, 16), 16, axis=1)]
        V = [self.target.convert(x) for x in np.split(C.tokens(22, 16), 16, axis=1)]
        self.steps = {}
        for name in {fmt, "float"}:
            state = self.target.state(SubspaceState.static(spanning_basis(C.HEADS, C.D, 32, C.DTYPE), dtype=C.DTYPE, coefficients=name))
            state.append(self.target.convert(C.tokens(1, START)), self.target.convert(C.tokens(2, START)))
            self.steps[name] = self._stepper(state, K, V)

    @staticmethod
    def _stepper(state, K, V):
        count = iter(range(10**9))

        def step():
            i = next(count) % len(K)
            state.append(K[i], V[i])

        return step

    def time_append(self, fmt):
        self.steps[fmt]()

    def track_slowdown_vs_float(self, fmt):
        """This format's one-token append time over float32's (same run, same thread count)."""
        return float(C.median_seconds(self.steps[fmt], self.target.sync) / C.median_seconds(self.steps["float"], self.target.sync))

    track_slowdown_vs_float.unit = "x"
