"""Declared backend capabilities (subspace_ref.capabilities): every backend declares them as data,
one composer lists every reason a call is refused, one exception type carries them."""

from __future__ import annotations

import math

import dataclasses

import numpy as np
import pytest

import subspace_ref as sr
from subspace_ref import StaticBasis, SubspaceState
from subspace_ref.capabilities import (
    Capabilities,
    NotSupportedError,
    append_reasons,
    attend_reasons,
    features,
    sketch_variants,
    state_reasons,
    table,
)
from subspace_ref.registry import declared_capabilities, get_backend, register_backend

PAPER = dict(trigger="paper", byte_ceiling=math.inf)  # seed 001's policy (spec A7 verbatim), which these tests encode


def _basis(rng, H=2, r=3, d=8):
    B = np.stack([np.linalg.qr(rng.standard_normal((d, d)))[0].T[:r] for _ in range(H)])
    return StaticBasis.from_bases(B, B.copy())


def test_every_registered_backend_declares_capabilities():
    declared = declared_capabilities()
    assert {"numpy", "torch", "triton", "cupy"} <= set(declared)
    for name, caps in declared.items():
        assert isinstance(caps, Capabilities), name
        impl = get_backend(name)
        assert tuple(impl.devices) == caps.devices and tuple(impl.dtypes) == caps.dtypes, name
        assert impl.array_family == caps.array_families[0], name


def test_not_supported_error_is_a_value_error_listing_every_reason():
    err = NotSupportedError("backend 'x' does not support this call", ["one", "two"])
    assert isinstance(err, ValueError) and err.reasons == ["one", "two"]
    assert str(err) == "backend 'x' does not support this call: one; two"


def test_composer_lists_every_mismatch_at_once(rng):
    """A float64 state with an exact window and rope on a backend declaring none of them: every
    reason in one error, nothing appended."""

    class Narrow:
        name = "narrow"
        array_family = "numpy"
        capabilities = Capabilities(array_families=("numpy",), devices=("cpu",), dtypes=("float32",), basis_formats=("native",), append_policies=("static",))
        devices, dtypes = capabilities.devices, capabilities.dtypes

        def availability(self):
            return sr.Availability(True)

        def append(self, state, keys, values):
            raise AssertionError("refused calls never reach the backend")

        attend = append

    register_backend("narrow", Narrow)
    from subspace_ref.rope import RopeParams

    state = SubspaceState.static(_basis(rng), rope=RopeParams(1.0 / 100.0 ** (np.arange(0, 8, 2) / 8)), window=2, bases="float16")
    state.engine = "narrow"
    reasons = append_reasons("narrow", Narrow(), state)
    assert len(reasons) == 3 and any("float64" in r for r in reasons) and any("float16" in r for r in reasons) and any("rope" in r for r in reasons)
    with pytest.raises(NotSupportedError) as err:
        state.append(rng.standard_normal((2, 8)), rng.standard_normal((2, 8)))
    assert err.value.reasons == reasons and state.num_tokens == 0
    q = rng.standard_normal((1, 2, 8)).astype(np.float16)
    attend = attend_reasons("narrow", Narrow(), q, state)
    assert any("exact window" in r for r in attend) and any("q has dtype float16" in r for r in attend) and len(attend) == 5
    assert set(state_reasons("narrow", Narrow(), state)) == set(reasons) | {r for r in attend if "exact window" in r}


def test_append_refusals_come_from_the_declaration(rng):
    torch = pytest.importorskip("torch")
    state = SubspaceState.adaptive(2, 8, rank_k=2, rank_v=2, ring_warm_start=4, fd_stride=2, **PAPER).to("torch")
    before = state.copy()
    with pytest.raises(NotSupportedError, match="ring_warm_start=4; fd_stride=2") as err:
        state.append(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(2, 8, dtype=torch.float64))
    assert len(err.value.reasons) == 1 and state.num_tokens == 0 and state.nbytes == before.nbytes
    assert sketch_variants(state) == ["ring_warm_start", "fd_stride"]


def test_features_of_a_plain_state(rng):
    f = features(SubspaceState.static(_basis(rng)))
    assert f == {
        "family": "numpy",
        "device": "cpu",
        "dtype": "float64",
        "coefficients": "float",
        "bases": "native",
        "window": False,
        "sinks": 0,
        "rope": False,
        "query_group": 1,
        "policy": "static",
        "d": 8,
        "d_v": 8,
        "ranks": (3, 3),
    }


def test_backends_command_prints_the_table(capsys):
    from subspace_ref import cli_backends

    assert cli_backends.run(None) == 0
    out = capsys.readouterr().out
    for field in dataclasses.fields(Capabilities):
        assert field.name in out
    assert table(declared_capabilities()).splitlines()[0].split()[1:] == sorted(declared_capabilities())
