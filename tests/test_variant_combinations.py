"""Variants switched on together (issue 11): encoded bases, int8 coefficients, an exact window and a
pre-RoPE basis compose. Each combination attends exactly as attention over the state's own
reconstruction (spec A2 with spec/storage.md S3.1 and spec/window.md W3), and round-trips through a
saved file (spec/persistence.md version 2 carrying both the basis format and the window)."""

import math

import numpy as np
import pytest

import subspace_ref as sr
from subspace_ref.exact import exact_attention

from conftest import low_rank_stream

H, D, R, T = 2, 12, 4, 40

PAPER = dict(trigger="paper", byte_ceiling=math.inf)  # seed 001's policy (spec A7 verbatim), which these tests encode


def _kv(rng):
    return low_rank_stream(rng, H, T, D, 5, noise=0.2), low_rank_stream(rng, H, T, D, 5, noise=0.2)


def build(kind, K, V, **kw):
    if kind == "static":
        return sr.SubspaceState.static(sr.calibrate(K, V, rank_k=R, rank_v=R), **kw)
    if kind == "adaptive":
        return sr.SubspaceState.adaptive(H, D, rank_k=R, rank_v=R, tau_k=0.3, tau_v=0.3, max_chunk=12, **kw, **PAPER)
    return sr.SubspaceState.rotating(H, D, rank_k=R, rank_v=R, refresh_every=9, **kw)


COMBOS = [
    dict(bases="int8", window=6),
    dict(bases="float16", window=5, min_tokens=20, coefficients="int8"),
    dict(bases="float8_e4m3", window=8),
]


@pytest.mark.parametrize("kind", ["static", "adaptive", "rotating"])
@pytest.mark.parametrize("kw", COMBOS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_combined_variants_attend_to_their_own_reconstruction_and_round_trip(rng, tmp_path, kind, kw):
    K, V = _kv(rng)
    state = build(kind, K, V, **kw)
    state.append(K, V)
    assert state.num_tokens == T and state.window is not None
    q = rng.standard_normal((H, D))
    K_hat, V_hat = state.reconstruct()
    gamma = np.asarray(state.layout.gamma)
    # the exact part is attended with gamma = 1 (spec/window.md W3): scale only the compressed keys
    split = T - state.window.keys.shape[2]
    K_scaled = K_hat.copy()
    K_scaled[:, :split] *= gamma[:, None, None]
    want = exact_attention(q, K_scaled, V_hat)
    np.testing.assert_allclose(sr.attend(q, state), want, rtol=1e-10, atol=1e-12)
    path = tmp_path / "state.safetensors"
    state.save(path)
    back = sr.SubspaceState.load(path)
    assert back.layout.basis_format == state.layout.basis_format and back.window.size == state.window.size
    np.testing.assert_array_equal(sr.attend(q, back), sr.attend(q, state))
    # both keep streaming identically after the round trip
    K2, V2 = _kv(rng)
    state.append(K2[:, :7], V2[:, :7])
    back.append(K2[:, :7], V2[:, :7])
    np.testing.assert_array_equal(sr.attend(q, back), sr.attend(q, state))


def test_pre_rope_state_with_a_window_keeps_true_positions(rng):
    """Compressed tokens are the oldest ones, appended in order, so their compressed index is their
    position and the pre-RoPE state (spec/rope.md P2) composes with a window: at full rank both
    reproduce exact attention over the post-RoPE keys."""
    from subspace_ref.rope import RopeParams, rotate

    rope = RopeParams(inv_freq=1.0 / 10000 ** (np.arange(0, D, 2) / D), layout="half", attention_scaling=1.0)
    pre_K, V = _kv(rng)
    K = rotate(pre_K[None], np.arange(T), rope)[0]  # post-RoPE keys at positions 0..T-1
    eye = np.broadcast_to(np.eye(D), (H, D, D)).copy()
    state = sr.SubspaceState.static(sr.StaticBasis.from_bases(eye, eye, 1.0), rope=rope, window=7)
    state.append(K, V)
    q = rng.standard_normal((H, D))
    np.testing.assert_allclose(sr.attend(q, state), exact_attention(q, K, V), rtol=1e-10, atol=1e-12)


def test_optional_sketch_fields_are_written_only_when_set(rng, tmp_path):
    """spec/persistence.md: a plain adaptive state's file has no optional policy field and is
    version 1; fd_stride or reuse_angle make it version 2; both load back to the same policy, and
    a version 1 file claiming an optional field is rejected."""
    import json

    from safetensors import safe_open

    from subspace_ref.persistence import StateFileError

    K, V = _kv(rng)
    for kw, version in ((dict(), "1"), (dict(fd_stride=2), "2"), (dict(reuse_angle=0.3), "2")):
        state = build("adaptive", K, V, **kw)
        state.append(K, V)
        path = tmp_path / f"s{len(kw)}{version}.safetensors"
        state.save(path)
        with safe_open(str(path), "np") as f:
            meta = f.metadata()
        fields = json.loads(meta["state"])["policy"]
        assert meta["format_version"] == version
        assert ("fd_stride" in fields) == ("fd_stride" in kw) and ("reuse_angle" in fields) == ("reuse_angle" in kw)
        assert sr.SubspaceState.load(path).policy == state.policy
    raw = path.read_bytes()
    forged = raw.replace(b'"format_version":"2"', b'"format_version":"1"')
    assert forged != raw
    (tmp_path / "forged.safetensors").write_bytes(forged)
    with pytest.raises(StateFileError):
        sr.SubspaceState.load(tmp_path / "forged.safetensors")


def test_per_query_head_bases_with_a_window_are_exact_at_full_rank(rng):
    """spec/sharing.md A3 with spec/window.md W1: query_group repeats the KV heads before the
    window sees them, so at full rank the state equals exact grouped-query attention."""
    g = 2
    K, V = _kv(rng)
    eye = np.broadcast_to(np.eye(D), (H * g, D, D)).copy()
    state = sr.SubspaceState.static(sr.StaticBasis.from_bases(eye, eye, 1.0), query_group=g, window=5)
    state.append(K, V)
    q = rng.standard_normal((H * g, D))
    want = exact_attention(q, np.repeat(K, g, axis=0), np.repeat(V, g, axis=0))
    np.testing.assert_allclose(sr.attend(q, state), want, rtol=1e-10, atol=1e-12)
