"""Saving and loading states (spec/persistence.md): bit-exact round trips, continuing after a load,
clear errors for bad files, atomic writes."""

from __future__ import annotations

import math

import hashlib
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import subspace_ref
from subspace_ref import StaticBasis, SubspaceState, attend
from subspace_ref import persistence
from subspace_ref.arrays import to_numpy
from subspace_ref.persistence import StateFileError


# ------------------------------------------------------------------------------------ helpers
def backend_available(name: str) -> bool:
    return any(b.name == name and b.available for b in subspace_ref.backends())


PAPER = dict(trigger="paper", byte_ceiling=math.inf)  # seed 001's policy (spec A7 verbatim), which these tests encode


def orthonormal(rng, heads, r, d, ranks=None):
    out = np.zeros((heads, r, d))
    for h in range(heads):
        q = np.linalg.qr(rng.standard_normal((d, d)))[0].T
        k = r if ranks is None else ranks[h]
        out[h, :k] = q[:k]
    return out


def make_state(kind, rng, *, heads=2, d=6, d_v=5, batch=None, dtype=np.float64, tokens=0, **kw):
    if kind == "static":
        ranks = kw.pop("ranks", (3,) * heads)
        basis = StaticBasis.from_bases(orthonormal(rng, heads, max(ranks), d, ranks), orthonormal(rng, heads, 2, d_v), gamma=rng.uniform(0.5, 2, heads))
        state = SubspaceState.static(basis, batch=batch, dtype=dtype, **kw)
    elif kind == "adaptive":
        kw.setdefault("max_chunk", 4)
        state = SubspaceState.adaptive(
            heads, d, d_v, rank_k=kw.pop("rank_k", 2), rank_v=kw.pop("rank_v", 2), batch=batch, dtype=dtype, gamma="paper", **kw, **PAPER
        )
    else:
        kw.setdefault("refresh_every", 3)
        state = SubspaceState.rotating(heads, d, d_v, rank_k=kw.pop("rank_k", 2), rank_v=kw.pop("rank_v", 3), batch=batch, dtype=dtype, **kw)
    if tokens:
        append_random(state, rng, tokens)
    return state


def append_random(state, rng, n, block=False):
    lead = (state.batch, state.heads) if state.batched else (state.heads,)
    if block:
        state.append(rng.standard_normal(lead + (n, state.d)), rng.standard_normal(lead + (n, state.d_v)))
    else:
        for _ in range(n):
            state.append(rng.standard_normal(lead + (state.d,)), rng.standard_normal(lead + (state.d_v,)))


def live_arrays(state) -> dict[str, np.ndarray]:
    """Every array a state's behaviour depends on (int8 scales included), cut to its live range,
    as NumPy."""
    out = dict(state.layout.live_arrays())
    if state.sketches is not None:
        out["sketch_keys"] = state.sketches.keys
        out["sketch_values"] = state.sketches.values
    return {k: to_numpy(v) for k, v in out.items()}


def assert_same_state(a, b):
    assert a.policy == b.policy
    assert a.batched == b.batched
    assert a.num_tokens == b.num_tokens
    assert a.nbytes == b.nbytes
    if a.sketches is None:
        assert b.sketches is None
    else:
        assert (a.sketches.filled_k, a.sketches.filled_v, a.sketches.rows_seen) == (b.sketches.filled_k, b.sketches.filled_v, b.sketches.rows_seen)
    la, lb = live_arrays(a), live_arrays(b)
    assert la.keys() == lb.keys()
    for name in la:
        assert la[name].dtype == lb[name].dtype, name
        assert la[name].shape == lb[name].shape, name
        assert la[name].tobytes() == lb[name].tobytes(), f"{name} differs"


def read_raw(path):
    with safe_open(str(path), framework="np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


def write_raw(path, tensors, metadata, *, fix_checksum=True):
    metadata = dict(metadata)
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}  # safetensors mis-writes strided views
    if fix_checksum:
        metadata["checksum"] = persistence.checksum(tensors, metadata)
    safetensors.numpy.save_file(tensors, str(path), metadata=metadata)


def edited(tmp_path, src, *, tensors=None, state=None, meta=None, fix_checksum=True):
    """A copy of ``src`` with tensors / state-JSON / metadata edited by the given functions and a
    valid checksum, so that only the consistency checks can catch the edit."""
    t, m = read_raw(src)
    if tensors:
        tensors(t)
    if state:
        header = json.loads(m["state"])
        state(header)
        m["state"] = json.dumps(header, sort_keys=True, separators=(",", ":"))
    if meta:
        meta(m)
    out = tmp_path / "edited.safetensors"
    write_raw(out, t, m, fix_checksum=fix_checksum)
    return out


KINDS = ["static", "adaptive", "rotating"]


# -------------------------------------------------------------------------------- round trips
ROUND_TRIPS = [
    (kind, batch, dtype, tokens, "float") for kind in KINDS for batch in (None, 2) for dtype in (np.float32, np.float64) for tokens in (0, 1, 13)
] + [(kind, 2, np.float32, tokens, "int8") for kind in KINDS for tokens in (0, 1, 13)]


@pytest.mark.parametrize("kind, batch, dtype, tokens, coefficients", ROUND_TRIPS)
def test_round_trip_is_bit_exact(tmp_path, kind, batch, dtype, tokens, coefficients):
    rng = np.random.default_rng(tokens)
    state = make_state(kind, rng, batch=batch, dtype=dtype, tokens=tokens, coefficients=coefficients)
    path = tmp_path / "s.safetensors"
    state.save(path)
    loaded = SubspaceState.load(path)
    assert loaded.engine == "numpy"
    assert loaded.dtype == dtype
    assert_same_state(state, loaded)


@pytest.mark.parametrize(
    "kind, extra",
    [
        ("static", {}),
        ("static", {"coefficients": "int8"}),
        ("adaptive", {"rank_k": (2, 3)}),
        ("adaptive", {"rank_k": (2, 3), "coefficients": "int8"}),
        ("adaptive", {"rank_k": 2, "sketch_reset": True, "max_chunk": 6, "ell_k": 3, "ell_v": 3}),
        ("rotating", {"rank_k": (2, 3)}),
        ("rotating", {"rank_k": (1, 3), "coefficients": "int8"}),
    ],
)
def test_appending_after_load_continues_exactly(tmp_path, kind, extra):
    rng = np.random.default_rng(1)
    state = make_state(kind, rng, batch=2, tokens=11, **extra)
    state.save(tmp_path / "s.safetensors")
    loaded = SubspaceState.load(tmp_path / "s.safetensors")
    for step in range(6):  # single tokens and blocks, through warm-up ends, refreshes and triggers
        lead = (2, state.heads)
        n = 1 + step % 3
        k, v = rng.standard_normal(lead + (n, state.d)), rng.standard_normal(lead + (n, state.d_v))
        state.append(k, v)
        loaded.append(k, v)
        assert_same_state(state, loaded)
    q = rng.standard_normal((2, 2 * state.heads, state.d))
    assert attend(q, state).tobytes() == attend(q, loaded).tobytes()
    assert all(np.array_equal(a, b) for a, b in zip(state.reconstruct(), loaded.reconstruct()))


def test_append_after_load_of_empty_state(tmp_path):
    rng = np.random.default_rng(2)
    for kind in KINDS:
        state = make_state(kind, rng)
        state.save(tmp_path / "e.safetensors")
        loaded = SubspaceState.load(tmp_path / "e.safetensors")
        append_random(state, np.random.default_rng(3), 7)
        append_random(loaded, np.random.default_rng(3), 7)
        assert_same_state(state, loaded)


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    heads=st.integers(1, 3),
    d=st.integers(2, 6),
    batch=st.sampled_from([None, 1, 3]),
    before=st.integers(0, 12),
    after=st.integers(0, 6),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_property(tmp_path_factory, kind, heads, d, batch, before, after, seed):
    rng = np.random.default_rng(seed)
    kw = {}
    if kind == "adaptive":
        kw = dict(rank_k=int(rng.integers(1, d + 1)), rank_v=1, max_chunk=int(rng.integers(1, 6)), tau_k=float(rng.uniform(0.01, 0.99)))
    elif kind == "rotating":
        kw = dict(rank_k=1, rank_v=int(rng.integers(1, d + 1)), refresh_every=int(rng.integers(1, 5)))
    else:
        kw = dict(ranks=tuple(int(x) for x in rng.integers(1, d + 1, heads)))
    state = make_state(kind, rng, heads=heads, d=d, d_v=d, batch=batch, **kw)
    append_random(state, rng, before, block=bool(seed % 2))
    path = tmp_path_factory.mktemp("prop") / "s.safetensors"
    state.save(path)
    loaded = SubspaceState.load(path)
    assert_same_state(state, loaded)
    r2 = np.random.default_rng(seed + 1)
    append_random(state, r2, after)
    append_random(loaded, np.random.default_rng(seed + 1), after)
    assert_same_state(state, loaded)


def test_schema_covers_every_layout_array_and_policy_field():
    """A new layout array or policy field must be added to the schema (spec/persistence.md) or
    saving refuses/loses it; this test fails first."""
    from dataclasses import fields

    from subspace_ref.layout import PackedLayout
    from subspace_ref.policies import AdaptivePolicy, RotatingPolicy, StaticPolicy

    assert set(PackedLayout.ARRAYS) == set(
        persistence.LAYOUT_TENSORS + persistence.SCALE_TENSORS + persistence.BASIS_SCALE_TENSORS + persistence.LOW_BIT_TENSORS
    )
    spec = Path(__file__).resolve().parents[1].joinpath("spec", "persistence.md").read_text()
    for name in persistence.TENSOR_ORDER:
        assert f"`{name}`" in spec, f"tensor {name} is not described in spec/persistence.md"
    for cls in (StaticPolicy, AdaptivePolicy, RotatingPolicy):
        for f in fields(cls):
            assert f"`{f.name}`" in spec, f"policy field {cls.__name__}.{f.name} is not described in spec/persistence.md"


def test_int8_state_file_holds_int8_coefficients_and_float32_scales(tmp_path):
    state = make_state("adaptive", np.random.default_rng(16), tokens=9, coefficients="int8")
    state.save(tmp_path / "q")
    tensors, meta = read_raw(tmp_path / "q")
    assert tensors["key_coef"].dtype == np.int8 and tensors["value_coef"].dtype == np.int8
    assert tensors["key_scale"].dtype == np.float32 and tensors["key_scale"].shape == (1, 2, 9)
    assert json.loads(meta["state"])["coefficients"] == "int8"
    bad = edited(tmp_path, tmp_path / "q", tensors=lambda t: t.pop("value_scale"))
    with pytest.raises(StateFileError, match="missing \\['value_scale'\\]"):
        SubspaceState.load(bad)
    bad = edited(tmp_path, tmp_path / "q", tensors=lambda t: t["key_scale"].__setitem__((0, 0, 0), -1.0))
    with pytest.raises(StateFileError, match="key_scale must be >= 0"):
        SubspaceState.load(bad)
    bad = edited(tmp_path, tmp_path / "q", state=lambda s: s.update(coefficients="int4"))
    with pytest.raises(StateFileError, match="coefficients"):
        SubspaceState.load(bad)


def test_arrays_are_cut_to_live_ranges_and_schema_is_versioned(tmp_path):
    rng = np.random.default_rng(4)
    state = make_state("adaptive", rng, tokens=17, max_chunk=5)
    assert state.layout.key_coef.shape[2] > 17  # spare capacity exists ...
    state.save(tmp_path / "s.safetensors")
    tensors, meta = read_raw(tmp_path / "s.safetensors")
    assert tensors["key_coef"].shape[2] == 17  # ... and is not saved
    J = int(state.layout.num_chunks.max())
    assert tensors["key_bases"].shape[2] == J and tensors["chunk_starts"].shape[2] == J
    assert tensors["sketch_keys"].shape == state.sketches.keys.shape
    assert meta["format"] == "subspace_ref.state" and meta["format_version"] == "1"
    header = json.loads(meta["state"])
    assert header["kind"] == "adaptive" and header["num_tokens"] == 17 and header["batched"] is False
    assert header["policy"]["tau_k"] == state.policy.tau_k and header["policy"]["max_chunk"] == 5
    assert header["sketch"] == {"filled_k": state.sketches.filled_k, "filled_v": state.sketches.filled_v, "rows_seen": 17}


def test_checksum_follows_the_documented_algorithm(tmp_path):
    """An independent implementation of spec/persistence.md §3."""
    state = make_state("rotating", np.random.default_rng(5), tokens=9, batch=2)
    state.save(tmp_path / "s.safetensors")
    tensors, meta = read_raw(tmp_path / "s.safetensors")
    h = hashlib.sha256()
    h.update(json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True, separators=(",", ":")).encode())
    order = ["key_coef", "value_coef", "key_bases", "value_bases", "chunk_starts", "num_chunks", "gamma", "sketch_keys", "sketch_values"]
    for name in order:
        x = tensors[name]
        h.update(b"\0%s\0%s\0%s\0" % (name.encode(), x.dtype.str.encode(), json.dumps(list(x.shape), separators=(",", ":")).encode()))
        h.update(x.tobytes())
    assert meta["checksum"] == "sha256:" + h.hexdigest()


def test_saving_twice_gives_the_same_content(tmp_path):
    """Same tensors and metadata (safetensors may order the header's keys differently)."""
    state = make_state("adaptive", np.random.default_rng(6), tokens=10)
    state.save(tmp_path / "a")
    state.save(tmp_path / "b")
    (ta, ma), (tb, mb) = read_raw(tmp_path / "a"), read_raw(tmp_path / "b")
    assert ma == mb
    assert ta.keys() == tb.keys() and all(ta[k].tobytes() == tb[k].tobytes() for k in ta)


def test_loaded_state_is_independent_of_the_file(tmp_path):
    state = make_state("static", np.random.default_rng(7), tokens=4)
    state.save(tmp_path / "s")
    loaded = SubspaceState.load(tmp_path / "s")
    before = live_arrays(loaded)
    (tmp_path / "s").write_bytes(b"gone")
    assert all(np.array_equal(before[k], v) for k, v in live_arrays(loaded).items())
    for x in live_arrays(loaded).values():
        assert x.flags.writeable


# ---------------------------------------------------------------------- states from torch arrays
def torch_copy(state, dtype):
    """The state with its arrays as CPU torch tensors of ``dtype`` (done by hand, so this works
    without the torch backend: saving only reads arrays)."""
    import torch

    def conv(name, x):
        t = torch.from_numpy(np.array(x))
        return t.to(dtype) if t.is_floating_point() else t

    out = state.copy()
    out.layout = out.layout.map_arrays(conv)
    if out.sketches is not None:
        out.sketches.keys = conv("k", out.sketches.keys)
        out.sketches.values = conv("v", out.sketches.values)
    out.engine = "torch"
    return out


@pytest.mark.parametrize("tdtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
def test_state_saved_from_torch_loads_as_numpy(tmp_path, kind, tdtype):
    torch = pytest.importorskip("torch")
    dt = getattr(torch, tdtype)
    state = make_state(kind, np.random.default_rng(8), tokens=9)
    tstate = torch_copy(state, dt)
    tstate.save(tmp_path / "t")
    loaded = SubspaceState.load(tmp_path / "t")
    assert loaded.engine == "numpy"
    assert isinstance(loaded.layout.key_coef, np.ndarray)
    # bfloat16 has no NumPy dtype: it loads as float32 holding exactly the same values
    assert loaded.dtype == (np.float32 if tdtype == "bfloat16" else np.dtype(tdtype))
    want = {k: v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy() for k, v in _torch_live(tstate).items()}
    got = live_arrays(loaded)
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name
    assert json.loads(read_raw(tmp_path / "t")[1]["state"])["saved_from"] == "torch"
    assert json.loads(read_raw(tmp_path / "t")[1]["state"])["dtype"] == tdtype


def _torch_live(state):
    lay = state.layout
    T, J = lay.num_tokens, int(lay.num_chunks.max())
    out = dict(
        key_coef=lay.key_coef[:, :, :T],
        value_coef=lay.value_coef[:, :, :T],
        key_bases=lay.key_bases[:, :, :J],
        value_bases=lay.value_bases[:, :, :J],
        chunk_starts=lay.chunk_starts[:, :, :J],
        num_chunks=lay.num_chunks,
        gamma=lay.gamma,
    )
    if state.sketches is not None:
        out.update(sketch_keys=state.sketches.keys, sketch_values=state.sketches.values)
    return out


@pytest.mark.skipif(not backend_available("torch"), reason="torch backend not available")
@pytest.mark.parametrize("tdtype", ["float64", "float32", "bfloat16"])
def test_torch_state_round_trip_through_to(tmp_path, tdtype):
    """state.to("torch") -> save -> load (NumPy) -> .to("torch", dtype) gives the same bits, and
    appending continues exactly."""
    import torch

    dt = getattr(torch, tdtype)
    rng = np.random.default_rng(9)
    base = make_state("adaptive", rng, dtype=np.float32 if tdtype != "float64" else np.float64)
    tstate = base.to("torch", dtype=dt)
    k = torch.tensor(rng.standard_normal((2, 12, 6)), dtype=dt)
    v = torch.tensor(rng.standard_normal((2, 12, 5)), dtype=dt)
    tstate.append(k, v)
    tstate.save(tmp_path / "t")
    back = SubspaceState.load(tmp_path / "t").to("torch", dtype=dt)
    for name, x in _torch_live(tstate).items():
        y = _torch_live(back)[name]
        assert x.dtype == y.dtype and torch.equal(x, y), name
    k2, v2 = k[:, :3] * 0.5, v[:, :3] * 2
    tstate.append(k2, v2)
    back.append(k2, v2)
    for name, x in _torch_live(tstate).items():
        assert torch.equal(x, _torch_live(back)[name]), name


# ---------------------------------------------------------------------------------- bad files
@pytest.fixture
def saved(tmp_path):
    state = make_state("adaptive", np.random.default_rng(10), tokens=12, batch=2, max_chunk=3, rank_k=(1, 2))
    path = tmp_path / "good.safetensors"
    state.save(path)
    return path


def test_truncated_file_is_rejected(tmp_path, saved):
    data = saved.read_bytes()
    bad = tmp_path / "cut"
    header_end = 8 + int.from_bytes(data[:8], "little")
    for n in sorted({0, 1, 7, 8, 9, 20, header_end - 1, header_end, header_end + 1, (header_end + len(data)) // 2, len(data) - 1}):
        bad.write_bytes(data[:n])
        with pytest.raises(StateFileError) as err:
            SubspaceState.load(bad)
        msg = str(err.value)
        assert "truncated" in msg or "not a safetensors file" in msg, (n, msg)
        if n > header_end:
            assert "truncated" in msg


def test_every_flipped_byte_is_detected(tmp_path, saved):
    data = saved.read_bytes()
    bad = tmp_path / "flip"
    stride = max(1, len(data) // 1500)
    for i in list(range(0, len(data), stride)) + [len(data) - 1]:
        corrupt = bytearray(data)
        corrupt[i] ^= 0xFF
        bad.write_bytes(bytes(corrupt))
        with pytest.raises(StateFileError):
            SubspaceState.load(bad)


def test_a_flipped_byte_in_any_tensor_fails_the_checksum(tmp_path):
    """Every tensor of a version 2 file (window, sinks, int8 bases and coefficients with their scales,
    sketches) is under the checksum: a flipped byte anywhere in any of them is refused as a
    checksum mismatch, before any consistency check could happen to catch it."""
    rng = np.random.default_rng(12)
    state = make_state("adaptive", rng, tokens=14, coefficients="int8", bases="int8", window=3, sinks=2)
    path = tmp_path / "v2"
    state.save(path)
    data = path.read_bytes()
    start = 8 + int.from_bytes(data[:8], "little")
    layout = json.loads(data[8:start])
    layout.pop("__metadata__")
    # every tensor the format has, but the int4/int2 ones (tests/test_low_bit_coefficients.py)
    assert set(layout) == set(persistence.TENSOR_ORDER) - set(persistence.LOW_BIT_TENSORS)
    bad = tmp_path / "flip"
    for name, entry in layout.items():
        a, b = entry["data_offsets"]
        for i in sorted({a, (a + b) // 2, b - 1}):
            corrupt = bytearray(data)
            corrupt[start + i] ^= 0x01
            bad.write_bytes(bytes(corrupt))
            with pytest.raises(StateFileError, match="checksum mismatch"):
                SubspaceState.load(bad)


@settings(max_examples=60, deadline=None)
@given(position=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255))
def test_random_corruption_is_detected_or_harmless(tmp_path_factory, position, mask):
    """Any single-byte change either raises StateFileError or (whitespace in the JSON header only)
    loads the very same state."""
    path = tmp_path_factory.mktemp("c") / "s"
    state = make_state("rotating", np.random.default_rng(11), tokens=7)
    state.save(path)
    data = bytearray(path.read_bytes())
    i = int(position * len(data))
    data[i] ^= mask
    path.write_bytes(bytes(data))
    try:
        loaded = SubspaceState.load(path)
    except StateFileError:
        return
    assert chr(data[i]) in " \t\r\n" and chr(data[i] ^ mask) in " \t\r\n", (i, mask)
    assert_same_state(state, loaded)


def test_data_corruption_reports_checksum(tmp_path, saved):
    data = bytearray(saved.read_bytes())
    data[-3] ^= 0x01
    saved.write_bytes(bytes(data))
    with pytest.raises(StateFileError, match="checksum mismatch"):
        SubspaceState.load(saved)


def test_wrong_version_is_rejected(tmp_path, saved):
    for version in ("3", "0", "1.0", ""):
        bad = edited(tmp_path, saved, meta=lambda m: m.update(format_version=version))
        with pytest.raises(StateFileError, match="format_version"):
            SubspaceState.load(bad)


def test_wrong_format_name_is_rejected(tmp_path, saved):
    bad = edited(tmp_path, saved, meta=lambda m: m.update(format="something.else"))
    with pytest.raises(StateFileError, match="format"):
        SubspaceState.load(bad)


def test_non_safetensors_files_are_rejected(tmp_path):
    cases = {
        "empty": b"",
        "text": b"hello, this is definitely not a state file\n" * 10,
        "random": np.random.default_rng(12).bytes(4096),
        "npy": None,
        "json": json.dumps({"format": "subspace_ref.state"}).encode(),
    }
    for name, data in cases.items():
        path = tmp_path / name
        if data is None:
            np.save(path.with_suffix(".npy"), np.zeros(10))
            path = path.with_suffix(".npy")
        else:
            path.write_bytes(data)
        with pytest.raises(StateFileError, match="not a safetensors file|truncated|metadata"):
            SubspaceState.load(path)


def test_plain_safetensors_without_our_metadata_is_rejected(tmp_path):
    path = tmp_path / "plain"
    safetensors.numpy.save_file({"key_coef": np.zeros((1, 1, 1, 1))}, str(path))
    with pytest.raises(StateFileError, match="metadata"):
        SubspaceState.load(path)
    safetensors.numpy.save_file({"x": np.zeros(3)}, str(path), metadata={"format": "other"})
    with pytest.raises(StateFileError, match="format"):
        SubspaceState.load(path)


class _Boom:
    def __reduce__(self):
        return (open, (os.environ["SUBSPACE_TEST_MARKER"], "w"))  # loading would create the marker


def test_pickle_file_is_rejected_without_running_code(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("SUBSPACE_TEST_MARKER", str(marker))
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(StateFileError):
        SubspaceState.load(path)
    assert not marker.exists()


@pytest.mark.parametrize(
    "edit, match",
    [
        (dict(tensors=lambda t: t.update(key_coef=t["key_coef"][:, :, :-1])), "key_coef"),
        (dict(tensors=lambda t: t.update(value_coef=t["value_coef"][:, :, :, :1])), "value_coef"),
        (dict(tensors=lambda t: t.update(gamma=np.ones(3))), "gamma"),
        (dict(tensors=lambda t: t.update(sketch_keys=t["sketch_keys"][:, :, :-1])), "sketch_keys"),
        (dict(tensors=lambda t: t.update(key_bases=t["key_bases"][:, :1])), "key_bases"),
        (dict(tensors=lambda t: t.pop("sketch_values")), "missing"),
        (dict(tensors=lambda t: t.update(extra=np.zeros(1))), "unexpected"),
        (dict(tensors=lambda t: t.update(key_coef=t["key_coef"].astype(np.float32))), "dtype"),
        (dict(tensors=lambda t: t.update(num_chunks=t["num_chunks"].astype(np.int32))), "dtype"),
        (dict(tensors=lambda t: t["num_chunks"].__setitem__((0, 0), 0)), "num_chunks"),
        (dict(tensors=lambda t: t["num_chunks"].__setitem__((0, 0), 99)), "num_chunks"),
        (dict(tensors=lambda t: t["chunk_starts"].__setitem__((0, 0, 0), 1)), "chunk_starts"),
        (dict(tensors=lambda t: t["chunk_starts"].__setitem__((0, 0, 1), 0)), "chunk_starts"),
        (dict(tensors=lambda t: t["chunk_starts"].__setitem__((1, 1, 1), 10**6)), "chunk_starts"),
        (dict(tensors=lambda t: t["key_coef"].__setitem__((0, 0, 0, 0), np.nan)), "NaN"),
        (dict(tensors=lambda t: t["sketch_values"].__setitem__((0, 0, 0, 0), np.inf)), "NaN or Inf"),
        (dict(tensors=lambda t: t["gamma"].__setitem__(0, -1.0)), "gamma"),
        (dict(tensors=lambda t: t["key_bases"].__setitem__((0, 0, 0, 1), 1.0)), "rank 1"),  # head 0 has rank 1
        (dict(tensors=lambda t: t["sketch_keys"].__setitem__((0, 0, -1, 0), 1.0)), "fill count"),
        (dict(state=lambda s: s.update(num_tokens=s["num_tokens"] + 1)), "key_coef"),
        (dict(state=lambda s: s.update(num_tokens=-1)), "num_tokens"),
        (dict(state=lambda s: s.update(batched=False)), "unbatched"),
        (dict(state=lambda s: s.update(kind="exotic")), "kind"),
        (dict(state=lambda s: s.update(dtype="int8")), "dtype"),
        (dict(state=lambda s: s["policy"].update(tau_k=1.5)), "tau_k"),
        (dict(state=lambda s: s["policy"].update(ell_k=1)), "ell_k"),
        (dict(state=lambda s: s["policy"].update(warmup=7)), "warmup"),
        (dict(state=lambda s: s["policy"].update(max_chunk="3")), "max_chunk"),
        (dict(state=lambda s: s["policy"].update(rank_k=[2, 2, 2])), "heads"),
        (dict(state=lambda s: s["policy"].pop("tau_v")), "policy fields"),
        (dict(state=lambda s: s["sketch"].update(filled_k=10**6)), "filled_k"),
        (dict(state=lambda s: s.update(sketch=None)), "sketch"),
        (dict(meta=lambda m: m.update(state="{not json")), "JSON"),
        (dict(meta=lambda m: m.update(state="[1, 2]")), "JSON object"),
    ],
)
def test_inconsistent_files_are_rejected(tmp_path, saved, edit, match):
    """Files whose checksum is valid but whose content is inconsistent (crafted, or written by a
    buggy writer) are rejected by the consistency checks, each with a message naming the problem."""
    bad = edited(tmp_path, saved, **edit)
    with pytest.raises(StateFileError, match=match):
        SubspaceState.load(bad)


def test_static_state_with_sketch_tensors_is_rejected(tmp_path):
    state = make_state("static", np.random.default_rng(13), tokens=3)
    state.save(tmp_path / "s")
    bad = edited(tmp_path, tmp_path / "s", tensors=lambda t: t.update(sketch_keys=np.zeros((1, 2, 4, 6))))
    with pytest.raises(StateFileError, match="unexpected"):
        SubspaceState.load(bad)


def test_state_error_is_a_value_error():
    assert issubclass(StateFileError, ValueError)


def test_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        SubspaceState.load(tmp_path / "nope")


def test_saving_something_else_is_a_type_error(tmp_path):
    with pytest.raises(TypeError, match="SubspaceState"):
        persistence.save_state({"not": "a state"}, tmp_path / "x")
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------- atomic writes
def _assert_old_file_intact(path, old_bytes, old_state):
    assert path.read_bytes() == old_bytes
    assert_same_state(old_state, SubspaceState.load(path))
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name], "temporary file left behind"


def _two_states(tmp_path):
    rng = np.random.default_rng(14)
    old = make_state("adaptive", rng, tokens=5)
    path = tmp_path / "state.safetensors"
    old.save(path)
    new = make_state("adaptive", rng, tokens=40)
    return path, old, new, path.read_bytes()


def test_write_failing_midway_leaves_old_file_intact(tmp_path, monkeypatch):
    path, old, new, old_bytes = _two_states(tmp_path)
    real = persistence._write_all

    def half_then_fail(fh, data):
        real(fh, data[: len(data) // 2])
        fh.flush()
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(persistence, "_write_all", half_then_fail)
    with pytest.raises(OSError, match="simulated"):
        new.save(path)
    _assert_old_file_intact(path, old_bytes, old)


def test_serializer_failing_leaves_old_file_intact(tmp_path, monkeypatch):
    path, old, new, old_bytes = _two_states(tmp_path)

    def boom(tensors, metadata):
        raise RuntimeError("serializer crashed (simulated)")

    monkeypatch.setattr(persistence, "_serialize", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        new.save(path)
    _assert_old_file_intact(path, old_bytes, old)


@pytest.mark.parametrize("target", ["fsync", "replace"])
def test_fsync_or_rename_failing_leaves_old_file_intact(tmp_path, monkeypatch, target):
    path, old, new, old_bytes = _two_states(tmp_path)

    def boom(*args, **kwargs):
        raise OSError(5, f"{target} failed (simulated)")

    monkeypatch.setattr(persistence.os, target, boom)
    with pytest.raises(OSError, match="simulated"):
        new.save(path)
    monkeypatch.undo()
    _assert_old_file_intact(path, old_bytes, old)


def test_interrupt_during_write_leaves_old_file_intact(tmp_path, monkeypatch):
    path, old, new, old_bytes = _two_states(tmp_path)

    def interrupted(fh, data):
        fh.write(data[:100])
        raise KeyboardInterrupt

    monkeypatch.setattr(persistence, "_write_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        new.save(path)
    _assert_old_file_intact(path, old_bytes, old)


def test_failed_first_save_creates_nothing(tmp_path, monkeypatch):
    state = make_state("static", np.random.default_rng(15), tokens=2)
    monkeypatch.setattr(persistence, "_serialize", lambda t, m: (_ for _ in ()).throw(RuntimeError("simulated")))
    with pytest.raises(RuntimeError):
        state.save(tmp_path / "new")
    assert list(tmp_path.iterdir()) == []


def test_successful_save_replaces_and_keeps_mode(tmp_path):
    path, old, new, old_bytes = _two_states(tmp_path)
    os.chmod(path, 0o640)
    new.save(str(path))  # str paths work as well as Path
    assert_same_state(new, SubspaceState.load(path))
    assert os.stat(path).st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
