"""The triton backend's vendor path (backends/subspace_ref_triton/vendor.py, issue 38 item 4):
static post-RoPE float states through torch SDPA over (γ B q, C, D), alone and beside exact tokens
(one log-sum-exp partial, spec A3.2), against the float64 oracle with the differential harness's
tolerance rule (tests/differential/tolerance.py); and every state it refuses goes to the kernels.

Runs on the GPU when there is one, else on the CPU (Triton's interpreter for the kernels, the
CPU flash operator for SDPA).
"""

from __future__ import annotations


import numpy as np
import pytest

from tests.triton_interpreter import _interpreter_environment, load_kernels  # noqa: F401  (an autouse fixture)

torch = pytest.importorskip("torch")
_AVAILABLE, DEVICE, _ = load_kernels()

import subspace_ref as sr  # noqa: E402

from tests.differential.cases import Case, build  # noqa: E402
from tests.differential.harness import Target, backend_state, to_backend  # noqa: E402
from tests.differential.tolerance import reference_error, tolerance  # noqa: E402

pytestmark = pytest.mark.skipif(not _AVAILABLE, reason=f"triton backend unavailable: {_AVAILABLE.reason}")



SERVED = [
    Case("vendor-gqa4", "static", H=2, group=4, d=32, d_v=48, rank_k=16, rank_v=16, T=300),
    Case("vendor-gqa1-scale", "static", N=2, H=3, group=1, d=16, d_v=16, rank_k=8, rank_v=8, T=77, scale=0.3),
    Case("vendor-sinks-window", "static", H=2, group=2, d=32, d_v=32, rank_k=8, rank_v=8, T=200, sinks=4, window=16),
    Case("vendor-logits30", "static", H=2, group=4, d=32, d_v=32, rank_k=16, rank_v=16, T=500, logit=30.0),
]
REFUSED = {
    "int8 coefficients": Case("kernel-int8", "static", H=2, group=2, d=32, d_v=32, rank_k=8, rank_v=8, T=64, coefficients="int8"),
    "pre-RoPE keys": Case("kernel-rope", "static", H=2, group=2, d=32, d_v=32, rank_k=8, rank_v=8, T=64, rope=True),
    "one basis per chunk": Case("kernel-adaptive", "adaptive", group=2, T=40, max_chunk=16, data="lowrank"),
    "r != r_v": Case("kernel-ranks", "static", H=2, group=2, d=32, d_v=32, rank_k=8, rank_v=16, T=64),
}


def _routes(monkeypatch):
    """Record which path each attend takes: "vendor" or "kernel"."""
    from subspace_ref_triton import vendor

    taken = []
    for name in ("attention", "partials"):
        real = getattr(vendor, name)
        monkeypatch.setattr(vendor, name, lambda *a, _real=real, **k: (taken.append("vendor"), _real(*a, **k))[1])
    return taken


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", SERVED, ids=str)
def test_vendor_path_matches_the_oracle(case, dtype, monkeypatch):
    b = build(case)
    target = Target("triton", DEVICE, dtype)
    state = backend_state(b.state, target)
    q = to_backend(b.q, target)
    taken = _routes(monkeypatch)
    out = sr.attend(q, state, backend="triton", scale=b.scale)
    assert taken == ["vendor"], "a static float 16-bit state must take the vendor path"
    err = float(np.abs(out.double().cpu().numpy() - b.out64).max())
    tol = tolerance(reference_error(b.state, b.q, b.scale, b.out64, dtype, seed=case.seed), b.out64, dtype)
    assert err <= tol, f"{case.name} {dtype}: max |vendor - oracle64| = {err:.3g} > tol {tol:.3g}"


@pytest.mark.parametrize("why", sorted(REFUSED))
def test_refused_states_take_the_kernels(why, monkeypatch):
    from subspace_ref_triton import vendor

    b = build(REFUSED[why])
    target = Target("triton", DEVICE, "bfloat16")
    state = backend_state(b.state, target)
    q = to_backend(b.q, target)
    assert vendor.refusals(q, state), f"{why}: the vendor path must refuse"
    taken = _routes(monkeypatch)
    sr.attend(q, state, backend="triton", scale=b.scale)
    assert taken == []


def test_float32_states_take_the_kernels(monkeypatch):
    from subspace_ref_triton import vendor

    b = build(SERVED[0])
    target = Target("triton", DEVICE, "float32")
    state, q = backend_state(b.state, target), to_backend(b.q, target)
    assert any("float16/bfloat16" in reason for reason in vendor.refusals(q, state))
