"""One call of the C kernels per layer and decode step (spec/layer_state.md L5.2): a layer whose
every head group the torch plan routes to the kernel attends through ``layer_attention`` (one
entry of the library, every group's ``coefficient_attention`` arguments), bit for bit what the
groups' own calls give; any other layer attends group by group."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import subspace_ref as sr  # noqa: E402
from subspace_ref.layer_state import HeadConfig, LayerState, query_rows  # noqa: E402
from subspace_ref_torch import kernel_library as lib  # noqa: E402
from tests.test_layer_state import D, DV, G, _basis, _rope  # noqa: E402

pytestmark = pytest.mark.skipif(not lib.library_status()[0], reason=f"the C kernels are not built: {lib.library_status()[1]}")

#: every group served by the kernel: formats per side, ranks, pre-RoPE, post-RoPE and identity keys
KERNEL_GROUPS = [
    HeadConfig(5, 4, "int4", "int8", "pre_rope"),
    HeadConfig(D, DV, "int2", "int4", "identity", "identity"),
    HeadConfig(6, 5, "int8", "int8"),
    HeadConfig(5, 4, "int4", "int8", "pre_rope"),
    HeadConfig(7, DV, "float", "int2", "post_rope", "identity"),
    HeadConfig(4, 3, "float", "float", "pre_rope"),
]
#: a float / float post-RoPE group: the plan's one-chunk or general route, never the kernel
WITH_TORCH_GROUP = KERNEL_GROUPS[:3] + [HeadConfig(6, 5)]


class CountingLibrary:
    """The kernels' library with every entry counted by name."""

    def __init__(self, real):
        self.real, self.calls = real, {}

    def __getattr__(self, name):
        fn = getattr(self.real, name)

        def counted(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args)

        return counted


def _attention_calls(counting: CountingLibrary) -> dict:
    """The counted calls of the attention entries (preparing a rotation's tables is another entry)."""
    return {name: n for name, n in counting.calls.items() if name in ("coefficient_attention", "layer_attention")}


def _layer(rng, configs, batch, sinks, window, dtype="float32"):
    layer = LayerState.from_heads(_basis(rng, len(configs)), configs, rope=_rope(), window=window, sinks=sinks, group_size=G, batch=batch, dtype=dtype)
    return layer.to("torch")


def _tokens(rng, shape):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))


def _group_by_group(q, layer):
    """The layer's attention by one torch attend call per group (spec/layer_state.md L5.1)."""
    axis = 1 if layer.batched else 0
    rows, inverse = query_rows(layer.groups, q.shape[axis] // layer.kv_heads)
    outs = [sr.attend(q.index_select(axis, torch.tensor(r)), grp.state, backend="torch") for r, grp in zip(rows, layer.groups)]
    return torch.cat(outs, axis).index_select(axis, torch.tensor(inverse))


@pytest.mark.parametrize(
    "batch, g, sinks, window, q_dtype",
    [(None, 1, 0, 0, torch.float32), (2, 3, 2, 5, torch.float32), (None, 4, 3, 0, torch.float32), (1, 2, 0, 6, torch.float16), (3, 1, 4, 32, torch.float32)],
)
def test_one_kernel_call_per_layer_equals_the_groups_calls_bit_for_bit(monkeypatch, batch, g, sinks, window, q_dtype):
    """Decode steps of a layer mixing formats, ranks, pre-RoPE / post-RoPE / identity keys, GQA,
    sinks and a window: after the first call (group by group, which admits the queries), each
    call enters the library once (``layer_attention``) and gives the groups' own outputs bit for
    bit, through key groups being finished and tokens leaving the window."""
    counting = CountingLibrary(lib.library())
    monkeypatch.setattr(lib, "_library", counting)
    rng = np.random.default_rng(batch or 0 + 10 * g + sinks)
    H = len(KERNEL_GROUPS)
    layer = _layer(rng, KERNEL_GROUPS, batch, sinks, window)
    lead = () if batch is None else (batch,)
    layer.append(_tokens(rng, lead + (H, 29, D)), _tokens(rng, lead + (H, 29, DV)))
    routed = []
    for step in range(16):
        q = _tokens(rng, lead + (H * g, D)).to(q_dtype)
        counting.calls.clear()
        admitted = all(any(key[0] == "layer" and route is not None for key, route in grp.state.admitted.items()) for grp in layer.groups)
        got = sr.attend(q, layer, backend="torch")
        if admitted:  # asked once every group holds compressed tokens (a window of 32 holds them back)
            assert counting.calls == {"layer_attention": 1}, step
            routed.append(step)
        else:
            assert "layer_attention" not in counting.calls
        want = _group_by_group(q, layer)
        assert got.dtype == q_dtype and got.shape == want.shape
        assert torch.equal(got, want), (step, (got - want).abs().max())
        layer.append(_tokens(rng, lead + (H, D)), _tokens(rng, lead + (H, DV)))
    assert len(routed) >= 6 and routed == list(range(routed[0], 16))


def test_the_layer_route_is_the_oracle_within_the_harness_tolerance():
    """The layer call's outputs, per group, within the differential harness's tolerance
    (tests/differential/tolerance.py) of the float64 oracle over the same tokens."""
    from tests.differential.tolerance import reference_error, tolerance

    rng = np.random.default_rng(5)
    H, g = len(KERNEL_GROUPS), 2
    oracle = LayerState.from_heads(_basis(rng, H), KERNEL_GROUPS, rope=_rope(), window=4, sinks=2, group_size=G, batch=1)
    on_torch = oracle.to("torch", dtype=torch.float32)
    K, V = rng.standard_normal((1, H, 40, D)), rng.standard_normal((1, H, 40, DV))
    oracle.append(K, V)
    on_torch.append(torch.from_numpy(K).float(), torch.from_numpy(V).float())
    q = rng.standard_normal((1, H * g, D))
    tq = torch.from_numpy(q).float()
    sr.attend(tq, on_torch, backend="torch")  # admits the queries group by group
    got = sr.attend(tq, on_torch, backend="torch").numpy().astype(np.float64)
    want = sr.attend(q, oracle)
    for grp in oracle.groups:
        rows = [h * g + i for h in grp.heads for i in range(g)]
        out64 = sr.attend(q[:, rows], grp.state)
        tol = tolerance(reference_error(grp.state, q[:, rows], None, out64, "float32"), out64, "float32")
        assert np.abs(got[:, rows] - want[:, rows]).max() <= tol, grp.heads


def test_a_group_the_kernel_does_not_serve_keeps_the_layer_group_by_group(monkeypatch):
    """A float / float post-RoPE group (not the kernel's): no layer route, each kernel group its own call."""
    counting = CountingLibrary(lib.library())
    monkeypatch.setattr(lib, "_library", counting)
    rng = np.random.default_rng(3)
    H = len(WITH_TORCH_GROUP)
    layer = _layer(rng, WITH_TORCH_GROUP, 2, 2, 4)
    layer.append(_tokens(rng, (2, H, 20, D)), _tokens(rng, (2, H, 20, DV)))
    for _ in range(3):
        q = _tokens(rng, (2, 2 * H, D))
        counting.calls.clear()
        got = sr.attend(q, layer, backend="torch")
        assert _attention_calls(counting) == {"coefficient_attention": 3}
        assert torch.equal(got, _group_by_group(q, layer))
    assert all(route is None for grp in layer.groups for key, route in grp.state.admitted.items() if key[0] == "layer")


def test_a_replaced_group_state_is_admitted_again(monkeypatch):
    """A group whose state object changed (a copy, a restore point) has not admitted the queries:
    the next call goes group by group, and the one after through the layer again."""
    counting = CountingLibrary(lib.library())
    monkeypatch.setattr(lib, "_library", counting)
    rng = np.random.default_rng(8)
    H = len(KERNEL_GROUPS)
    layer = _layer(rng, KERNEL_GROUPS, None, 0, 3)
    layer.append(_tokens(rng, (H, 20, D)), _tokens(rng, (H, 20, DV)))
    q = _tokens(rng, (H, D))
    sr.attend(q, layer, backend="torch")
    counting.calls.clear()
    sr.attend(q, layer, backend="torch")
    assert counting.calls == {"layer_attention": 1}
    copied = layer.copy()
    calls = []
    for _ in range(2):
        counting.calls.clear()
        out = sr.attend(q, copied, backend="torch")
        calls.append(_attention_calls(counting))
        assert torch.equal(out, sr.attend(q, layer, backend="torch"))
    assert calls == [{"coefficient_attention": len(copied.groups)}, {"layer_attention": 1}]


def test_the_layer_route_keeps_the_checks_of_every_call():
    """What attend checks on every call (the scale, a state without tokens) holds on the layer route."""
    rng = np.random.default_rng(9)
    H = len(KERNEL_GROUPS)
    layer = _layer(rng, KERNEL_GROUPS, None, 0, 0)
    layer.append(_tokens(rng, (H, 20, D)), _tokens(rng, (H, 20, DV)))
    q = _tokens(rng, (H, D))
    sr.attend(q, layer, backend="torch")
    with pytest.raises(ValueError, match="scale"):
        sr.attend(q, layer, backend="torch", scale=-1.0)
    with pytest.raises(ValueError, match="q must have shape"):
        sr.attend(_tokens(rng, (H + 1, D)), layer, backend="torch")
