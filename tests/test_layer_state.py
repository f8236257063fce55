"""Layer states with heads of different configurations (spec/layer_state.md L1-L5).

The reference here is built from the spec's definitions only (no state code): per head, the
sinks and window exact, the compressed tokens projected (pre-RoPE keys un-rotated at their
position, spec/rope.md P2), read back through their format (spec/quantization.md Q0 step 3:
key groups counted from the first compressed token, spec/window.md W10), and exact attention
over the result (Q2.1). Float64 throughout: the only differences are rounding, far below 1e-10.
"""

from __future__ import annotations

import numpy as np
import pytest

import subspace_ref as sr
from subspace_ref.calibration import StaticBasis
from subspace_ref.formats import FORMATS
from subspace_ref.layer_state import HeadConfig, LayerState
from subspace_ref.rope import RopeParams, rotate

D, DV, G = 16, 12, 8


def _rope(d=D):
    return RopeParams(1.0 / 50.0 ** (np.arange(0, d, 2) / d), "half", 1.0)


def _basis(rng, heads, d=D, dv=DV):
    B = np.stack([np.linalg.qr(rng.standard_normal((d, d)))[0].T for _ in range(heads)])
    E = np.stack([np.linalg.qr(rng.standard_normal((dv, dv)))[0].T for _ in range(heads)])
    return StaticBasis.from_bases(B, E, 1.0)


def _reference(q, K, V, basis, configs, rope, sinks, window):
    """Spec-only attention of q (H * g, d) over keys K (H, T, d), values V (H, T, d_v)."""
    H, T, _ = K.shape
    g = q.shape[0] // H
    compressed = max(0, T - sinks - window) if T > sinks else 0
    out = []
    for h, c in enumerate(configs):
        t = np.arange(sinks, sinks + compressed)
        Bk = np.eye(D) if c.key_basis == "identity" else basis.B[h, : c.rank_k]
        Ev = np.eye(DV) if c.value_basis == "identity" else basis.E[h, : c.rank_v]
        x = K[h, t]
        if c.key_basis == "pre_rope":
            x = rotate(x, t, rope, inverse=True)
        k_hat = FORMATS[c.key_format].reconstruct(x @ Bk.T, "key", G) @ Bk
        if c.key_basis == "pre_rope":
            k_hat = rotate(k_hat, t, rope)
        v_hat = FORMATS[c.value_format].reconstruct(V[h, t] @ Ev.T, "value", G) @ Ev
        keys = np.concatenate([K[h, :sinks], k_hat, K[h, sinks + compressed :]])
        values = np.concatenate([V[h, :sinks], v_hat, V[h, sinks + compressed :]])
        out.append(sr.exact_attention(q[h * g : (h + 1) * g], keys[None], values[None]))
    return np.concatenate(out)


MIXED = [
    HeadConfig(5, 4, "int4", "int8", "pre_rope"),
    HeadConfig(D, DV, "int2", "int4", "identity", "identity"),
    HeadConfig(5, 4, "int4", "int8", "pre_rope"),
    HeadConfig(7, DV, "float", "int2", "post_rope", "identity"),
]


@pytest.mark.parametrize("sinks, window", [(0, 0), (3, 5), (2, 0)])
def test_layer_attention_is_exact_attention_over_its_definition(sinks, window):
    """L5.1 with Q2.1: every head's output is exact attention over what its configuration stores."""
    rng = np.random.default_rng(sinks * 10 + window)
    H, T, g = len(MIXED), 61, 3
    basis, rope = _basis(rng, H), _rope()
    K, V = rng.standard_normal((H, T, D)), rng.standard_normal((H, T, DV))
    layer = LayerState.from_heads(basis, MIXED, rope=rope, window=window, sinks=sinks, group_size=G)
    assert [g.heads for g in layer.groups] == [(0, 2), (1,), (3,)]
    layer.append(K[:, :30], V[:, :30])
    for t in range(30, T):  # a block, then token by token: groups finish in both
        layer.append(K[:, t], V[:, t])
    q = rng.standard_normal((H * g, D))
    want = _reference(q, K, V, basis, MIXED, rope, sinks, window)
    np.testing.assert_allclose(sr.attend(q, layer), want, rtol=1e-10, atol=1e-12)


def test_torch_backend_reads_mixed_formats_as_the_oracle():
    """Each group's torch attention and appends (per-side formats, spec/quantization.md Q0) give
    the oracle's numbers in float64."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    H, T = len(MIXED), 45
    basis, rope = _basis(rng, H), _rope()
    K, V = rng.standard_normal((H, T, D)), rng.standard_normal((H, T, DV))
    oracle = LayerState.from_heads(basis, MIXED, rope=rope, window=4, sinks=2, group_size=G)
    on_torch = oracle.to("torch")
    oracle.append(K, V)
    on_torch.append(torch.from_numpy(K[:, :20]), torch.from_numpy(V[:, :20]))
    for t in range(20, T):
        on_torch.append(torch.from_numpy(K[:, t]), torch.from_numpy(V[:, t]))
    q = rng.standard_normal((2 * H, D))
    got = sr.attend(torch.from_numpy(q), on_torch, backend="torch")
    np.testing.assert_allclose(got.numpy(), sr.attend(q, oracle), rtol=1e-10, atol=1e-12)


def test_backends_that_read_uniform_formats_refuse_a_mixed_group_with_the_reason():
    """A backend that declares only uniform formats names the group's format in its refusal."""
    from subspace_ref.capabilities import Capabilities, attend_reasons

    rng = np.random.default_rng(1)
    layer = LayerState.from_heads(_basis(rng, 1), [HeadConfig(4, 4, "int4", "int8")])
    layer.append(rng.standard_normal((1, 3, D)), rng.standard_normal((1, 3, DV)))

    class Uniform:
        capabilities = Capabilities(array_families=("numpy",), devices=("cpu",), dtypes=("float64",), coefficient_formats=("float", "int8", "int4", "int2"))

    reasons = attend_reasons("uniform", Uniform(), rng.standard_normal((1, D)), layer.groups[0].state)
    assert any("int4/int8 coefficients" in r for r in reasons), reasons


def test_save_and_load_round_trip_bit_for_bit(tmp_path):
    rng = np.random.default_rng(2)
    H = len(MIXED)
    layer = LayerState.from_heads(_basis(rng, H), MIXED, rope=_rope(), window=3, sinks=2, group_size=G)
    layer.append(rng.standard_normal((H, 29, D)), rng.standard_normal((H, 29, DV)))
    path = tmp_path / "layer.safetensors"
    layer.save(path)
    back = LayerState.load(path)
    assert [g.heads for g in back.groups] == [g.heads for g in layer.groups]
    assert [g.flags for g in back.groups] == [g.flags for g in layer.groups]
    assert back.nbytes == layer.nbytes
    for a, b in zip(layer.groups, back.groups):
        assert a.state.layout.coefficients == b.state.layout.coefficients
        for name, x in a.state.layout.live_arrays().items():
            np.testing.assert_array_equal(b.state.layout.live_arrays()[name], x)
    q = rng.standard_normal((H, D))
    np.testing.assert_array_equal(sr.attend(q, back), sr.attend(q, layer))


def test_a_corrupted_layer_file_is_refused(tmp_path):
    from subspace_ref.persistence import StateFileError

    rng = np.random.default_rng(3)
    layer = LayerState.from_heads(_basis(rng, 2), MIXED[:2], rope=_rope())
    layer.append(rng.standard_normal((2, 9, D)), rng.standard_normal((2, 9, DV)))
    path = tmp_path / "layer.safetensors"
    layer.save(path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StateFileError, match="checksum"):
        LayerState.load(path)
    with pytest.raises(StateFileError, match="not a saved LayerState"):
        state = layer.groups[0].state
        state.save(tmp_path / "state.safetensors")
        LayerState.load(tmp_path / "state.safetensors")


def test_a_failing_append_leaves_every_group_as_it_was():
    """L3 step 2: the second group's failure (a value beyond float16's range, Q1) after the first
    group appended leaves both groups at their old tokens and outputs."""
    rng = np.random.default_rng(4)
    layer = LayerState.from_heads(_basis(rng, 2), [HeadConfig(4, 4, "int8", "int8"), HeadConfig(4, 4, "int4", "int4")])
    layer.append(rng.standard_normal((2, 20, D)), rng.standard_normal((2, 20, DV)))
    q = rng.standard_normal((2, D))
    before = sr.attend(q, layer)
    values = rng.standard_normal((2, 5, DV))
    values[1] = 1e6
    with pytest.raises(ValueError, match="float16"):
        layer.append(rng.standard_normal((2, 5, D)), values)
    assert [g.state.num_tokens for g in layer.groups] == [20, 20]
    np.testing.assert_array_equal(sr.attend(q, layer), before)


def test_bytes_leave_out_identity_bases_only():
    """L4: nbytes is the groups' bytes less the identity bases (d x d numbers each)."""
    rng = np.random.default_rng(5)
    layer = LayerState.from_heads(_basis(rng, len(MIXED)), MIXED, rope=_rope(), group_size=G)
    layer.append(rng.standard_normal((len(MIXED), 40, D)), rng.standard_normal((len(MIXED), 40, DV)))
    identity = (D * D + DV * DV) * 8 + DV * DV * 8  # head 1: both sides; head 3: values
    assert layer.nbytes == sum(g.state.nbytes for g in layer.groups) - identity
    assert layer.allocated_nbytes >= sum(g.state.nbytes for g in layer.groups)
    assert layer.full_cache_nbytes == len(MIXED) * 40 * (D + DV) * 8


def test_bad_configurations_are_refused_naming_the_field():
    rng = np.random.default_rng(6)
    basis = _basis(rng, 2)
    good = HeadConfig(4, 4)
    cases = [
        ([good], "one HeadConfig per KV head"),
        ([good, HeadConfig(5, 4, key_basis="identity")], "identity basis has rank 16"),
        ([good, HeadConfig(D + 1, 4)], "rank_k is 17, above"),
        ([good, HeadConfig(0, 4)], "rank_k must be a positive int"),
        ([good, HeadConfig(4, -1)], "rank_v must be a non-negative int"),
        ([good, HeadConfig(4, 4, key_basis="sideways")], "key_basis must be one of"),
        ([good, HeadConfig(4, 4, value_basis="pre_rope")], "value_basis must be one of"),
        ([good, HeadConfig(4, 4, "int3")], "coefficients"),
        ([good, HeadConfig(4, 4, key_basis="pre_rope")], "rope"),
    ]
    for heads, message in cases:
        with pytest.raises(ValueError, match=message):
            LayerState.from_heads(basis, heads)
    layer = LayerState.from_heads(basis, [good, good])
    with pytest.raises(ValueError, match="H = 2 KV heads"):
        layer.append(np.zeros((3, D)), np.zeros((3, DV)))
    with pytest.raises(ValueError, match="multiple of the 2 KV heads"):
        layer.append(np.zeros((2, D)), np.zeros((2, DV)))
        sr.attend(np.zeros((3, D)), layer)
    assert layer.num_tokens == 1


UNIFORM_GROUPS = [
    HeadConfig(5, 4, "int4", "int4", "pre_rope"),
    HeadConfig(D, DV, "int8", "int8", "identity", "identity"),
    HeadConfig(5, 4, "int4", "int4", "pre_rope"),
]


def _targets():
    from tests.differential.harness import targets

    return [pytest.param(t, id=t.id) for t in targets(("float32",))]


@pytest.mark.parametrize("target", _targets())
def test_every_backend_attends_a_layer_of_uniform_groups(target):
    """One attend call per layer on each backend (spec/layer_state.md L5): groups of uniform formats,
    pre-RoPE and identity heads, sinks and a window, within the differential harness's tolerance
    (tests/differential/tolerance.py: twice the oracle's own float32 error) of the float64 oracle."""
    from tests.differential.harness import backend_state, check_output, to_backend
    from tests.differential.tolerance import reference_error, tolerance

    if target.skip:
        pytest.skip(target.skip)
    rng = np.random.default_rng(11)
    H, g = len(UNIFORM_GROUPS), 2
    layer = LayerState.from_heads(_basis(rng, H), UNIFORM_GROUPS, rope=_rope(), window=4, sinks=2, group_size=G, batch=1)
    layer.append(rng.standard_normal((1, H, 37, D)), rng.standard_normal((1, H, 37, DV)))
    q = rng.standard_normal((1, H * g, D))
    want = sr.attend(q, layer)
    converted = LayerState(H, [type(grp)(grp.heads, backend_state(grp.state, target, poison=False), grp.key_identity, grp.value_identity) for grp in layer.groups])
    got = check_output(sr.attend(to_backend(q, target), converted, backend=target.backend), target, want.shape)
    for grp in layer.groups:
        rows = [h * g + i for h in grp.heads for i in range(g)]
        out64 = sr.attend(q[:, rows], grp.state)
        tol = tolerance(reference_error(grp.state, q[:, rows], None, out64, target.dtype), out64, target.dtype)
        assert np.abs(got[:, rows] - want[:, rows]).max() <= tol, (target.id, grp.heads)
