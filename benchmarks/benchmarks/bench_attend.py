"""Decode attention in coefficient space (spec A2, A3) per backend, with the roofline metrics of
spec R1-R12.

One layer: 8 KV heads, one query head each, d = d_v = 128, float32; static states (spec A6, one
chunk) and adaptive states (spec A7, chunks closing every 256 tokens, so J = T/256 + 1).
"""

from __future__ import annotations

from subspace_ref import attend
from subspace_ref.roofline import state_cost

from . import common as C


class Attend:
    """``time_attend``: one decode query per head over a state of T tokens. The ``track_``
    metrics are computed on the same state: model counts (spec R2-R9), and measured times held
    against the model and against the exact baseline."""

    params = (C.TARGETS, C.KINDS, C.CONTEXTS, C.RANKS)
    param_names = ["backend", "state", "T", "rank"]
    timeout = 600

    def setup_cache(self):
        """Measured once per run: this machine's rooflines (spec R12) and the adaptive states,
        whose append is sequential in the tokens (seconds per thousand), pickled to files."""
        states = {}
        for r in C.RANKS:
            for T, s in C.adaptive_states(C.CONTEXTS, r, numpy_only_to=C.NUMPY_MAX_T).items():
                states[("adaptive", T, r)] = s
        return {"machines": C.machines(), "paths": C.save_states(states, "attend-state")}

    setup_cache.timeout = 3600

    def setup(self, cache, backend, kind, T, rank):
        self.target = C.target(backend)
        C.skip_numpy_oracle_at(self.target, T)
        if kind == "static":
            state = C.static_state(T, rank)
        else:
            path = cache["paths"].get((kind, T, rank))
            if path is None:
                raise NotImplementedError(f"no adaptive state of {T} tokens in setup_cache: without the torch backend "
                                          f"they are built on the oracle up to T = {C.NUMPY_MAX_T} only")
            state = C.load_state(path)
        self.state = self.target.state(state)
        self.q = C.query(self.target)
        self.machine = cache["machines"]["cuda" if self.target.cuda else "cpu"]
        self.cost = state_cost(self.state, group=C.GROUP).phase("attend")

    def _attend(self):
        return attend(self.q, self.state, backend=self.target.backend)

    def _measured(self) -> float:
        return C.median_seconds(self._attend, self.target.sync)

    def time_attend(self, cache, backend, kind, T, rank):
        self._attend()
        self.target.sync()

    def track_bytes_per_token(self, cache, backend, kind, T, rank):
        """Model bytes moved by one decode token's attention over the layer (spec R4)."""
        return float(self.cost.bytes)

    track_bytes_per_token.unit = "bytes"

    def track_flops_per_token(self, cache, backend, kind, T, rank):
        """Model FLOPs of one decode token's attention over the layer (spec R3)."""
        return float(self.cost.flops)

    track_flops_per_token.unit = "FLOPs"

    def track_bandwidth_fraction(self, cache, backend, kind, T, rank):
        """Achieved bandwidth (model bytes / measured time) over this machine's copy bandwidth
        (spec R12, measured in setup_cache)."""
        return float(self.cost.bytes / self._measured() / self.machine.bandwidth)

    track_bandwidth_fraction.unit = "fraction of copy bandwidth"

    def track_roofline_ratio(self, cache, backend, kind, T, rank):
        """Measured time over the roofline limit of spec R10.1 (1 = at the limit)."""
        return float(self._measured() / self.cost.time(self.machine))

    track_roofline_ratio.unit = "measured / roofline"

    def track_speedup_vs_exact(self, cache, backend, kind, T, rank):
        """Exact attention's time over this backend's, same device and T (torch SDPA; the NumPy
        oracle's exact_attention for the numpy target). Above 1: the subspace method is faster."""
        exact = C.exact_baseline(self.target, T)
        return float(C.median_seconds(exact, self.target.sync) / self._measured())

    track_speedup_vs_exact.unit = "x"

    def track_state_nbytes(self, cache, backend, kind, T, rank):
        """Bytes the state holds (SubspaceState.nbytes: coefficients, bases in use, sketches)."""
        return float(self.state.nbytes)

    track_state_nbytes.unit = "bytes"

    def track_chunks(self, cache, backend, kind, T, rank):
        """Mean chunks per head (J of spec R3.1)."""
        return float(self.state.num_chunks.mean())

    track_chunks.unit = "chunks"


class AttendFormats:
    """Torch-cpu decode of static states by coefficient format and key basis kind (issue 16):
    float32, int8 (spec A10) or int4 coefficients, plain or pre-RoPE (spec/rope.md P3, cost spec R13).
    ``track_speedup_vs_exact`` is torch SDPA's time over the attend's, both measured in the same
    process and thread count. int4 is spec/quantization.md's format (KIVI groups)."""

    params = (["float", "int8", "int4", "rope-float", "rope-int8", "rope-int4"], C.CONTEXTS)
    param_names = ["format", "T"]
    timeout = 600

    def setup(self, fmt, T):
        import numpy as np

        from subspace_ref import SubspaceState
        from subspace_ref.rope import RopeParams
        from subspace_ref.workloads import spanning_basis

        self.target = C.target("torch-cpu")
        rope = RopeParams(1.0 / 10000.0 ** (np.arange(0, C.D, 2) / C.D)) if fmt.startswith("rope") else None
        state = SubspaceState.static(spanning_basis(C.HEADS, C.D, 32, C.DTYPE), dtype=C.DTYPE, coefficients=fmt.split("-")[-1], rope=rope)
        state = self.target.state(state)
        for a in range(0, T, 16384):
            n = min(16384, T - a)
            state.append(self.target.convert(C.tokens(1 + a, n)), self.target.convert(C.tokens(10**6 + a, n)))
        self.state = state
        self.q = C.query(self.target)

    def _attend(self):
        return attend(self.q, self.state, backend="torch")

    def time_attend(self, fmt, T):
        self._attend()

    def track_speedup_vs_exact(self, fmt, T):
        """SDPA's time over this attend's (same run, same threads). Above 1: faster than exact."""
        exact = C.median_seconds(C.exact_baseline(self.target, T), self.target.sync)
        return float(exact / C.median_seconds(self._attend, self.target.sync))

    track_speedup_vs_exact.unit = "x"
