"""A saved state's arrays checked against its header and each other, and the state's parts built
from them (spec/persistence.md §4-§5). Part of :mod:`subspace_ref.persistence`."""

from __future__ import annotations

from typing import Any

import numpy as np

from subspace_ref._persistence_header import (
    BASIS_SCALE_TENSORS,
    EXTENDED_VERSION,
    LAYOUT_TENSORS,
    LOW_BIT_TENSORS,
    SCALE_TENSORS,
    SINK_TENSORS,
    SKETCH_TENSORS,
    WINDOW_TENSORS,
    _FLOAT_DTYPES,
    _expected_dtypes,
    _fail,
    _policy_from,
    _rope_from,
    _side_tensors,
    _window_options,
)
from subspace_ref.basis_storage import FORMATS, NATIVE, float8_dtype, has_row_scales, is_float8_format, is_native
from subspace_ref.formats import side_formats
from subspace_ref.layout import PackedLayout, SketchBuffers
from subspace_ref.quantization import packed_width
from subspace_ref.window import ExactWindow, after_sinks_threshold, compressed_count

#: The basis formats a version 2 header's "bases" names (native bases are written without it).
STORED_FORMATS = tuple(f for f in FORMATS if not is_native(f))


def build_state(header: Any, tensors: dict[str, np.ndarray], path):
    if not isinstance(header, dict):
        _fail(path, "metadata 'state' is not a JSON object")
    policy = _rope_from(header, _policy_from(header, path), path)
    batched, T, dtype_name, sk = header.get("batched"), header.get("num_tokens"), header.get("dtype"), header.get("sketch")
    if type(batched) is not bool:
        _fail(path, f"batched must be true or false, got {batched!r}")
    if type(T) is not int or T < 0:
        _fail(path, f"num_tokens must be a non-negative int, got {T!r}")
    if dtype_name not in _FLOAT_DTYPES:
        _fail(path, f"dtype is {dtype_name!r}; expected one of {list(_FLOAT_DTYPES)}")
    coefficients = header.get("coefficients")
    try:
        key_format, value_format = side_formats(coefficients)
    except ValueError as err:
        _fail(path, f"coefficients is {coefficients!r}: {err}")
    basis_format = header.get("bases", NATIVE)
    if "bases" in header and basis_format not in STORED_FORMATS:
        _fail(path, f"bases is {basis_format!r}; a version {EXTENDED_VERSION} file stores them as one of {list(STORED_FORMATS)}")
    online = policy.kind != "static"
    win = _window_options(header.get("window", None), policy.kind, path)
    expected_names = LAYOUT_TENSORS + _side_tensors(key_format, value_format) + (SKETCH_TENSORS if online else ())
    expected_names += (BASIS_SCALE_TENSORS if has_row_scales(basis_format) else ()) + (WINDOW_TENSORS if win else ()) + (SINK_TENSORS if win and win[3] else ())
    bits, value_bits, G = key_format.low_bits, value_format.low_bits, header.get("group", 0)
    if bits:
        if type(G) is not int or G < 1:
            _fail(path, f"group is {G!r}; {coefficients} coefficients need a positive int group size")
    elif "group" in header:
        _fail(path, f"group is set but coefficients are {coefficients}; only int4/int2 keys have key groups")
    missing = [n for n in expected_names if n not in tensors]
    extra = [n for n in tensors if n not in expected_names]
    if missing or extra:
        _fail(path, f"a {policy.kind} state with {coefficients} coefficients holds arrays {list(expected_names)}; missing {missing}, unexpected {extra}")

    want = _expected_dtypes(dtype_name, coefficients, stored=True, bases=basis_format)
    for name in expected_names:
        if str(tensors[name].dtype) != want[name]:
            _fail(path, f"{name} has dtype {tensors[name].dtype}; a {dtype_name} state with {coefficients} coefficients stores it as {want[name]}")
    arrays = {name: _widen(x, dtype_name) if want[name] == "uint16" else np.array(x, dtype=x.dtype.newbyteorder("=")) for name, x in tensors.items()}
    if is_float8_format(basis_format):  # their bits, stored as uint8
        for name in ("key_bases", "value_bases"):
            arrays[name] = arrays[name].view(float8_dtype())
            if not np.isfinite(arrays[name].astype(np.float32)).all():
                _fail(path, f"{name} contains NaN or Inf")
    kc = arrays["key_coef"]
    if kc.ndim != 4:
        _fail(path, f"key_coef has shape {kc.shape}; expected (N, H, num_tokens, r)")
    N, H, _, r = kc.shape
    kb = arrays["key_bases"]
    if bits and kb.ndim == 5:  # packed codes: the rank is the bases' row count
        r = kb.shape[3]
    if kb.ndim != 5 or kb.shape[:2] != (N, H) or kb.shape[3] != r:
        _fail(path, f"key_bases has shape {kb.shape}; expected ({N}, {H}, J, {r}, d)")
    J, d = kb.shape[2], kb.shape[4]
    if getattr(policy, "rope", None) is not None:
        try:
            policy.rope.planes(d)  # its rotary dims must fit the head size
        except ValueError as err:
            _fail(path, f"rope does not fit the keys (d = {d}): {err}")
    vb = arrays["value_bases"]
    if vb.ndim != 5 or vb.shape[:3] != (N, H, J):
        _fail(path, f"value_bases has shape {vb.shape}; expected ({N}, {H}, {J}, r_v, d_v)")
    r_v, d_v = vb.shape[3], vb.shape[4]
    shapes = {
        "key_coef": (N, H, T, packed_width(r, bits) if bits else r),
        "value_coef": (N, H, T, packed_width(r_v, value_bits) if value_bits else r_v),
        "chunk_starts": (N, H, J),
        "num_chunks": (N, H),
        "gamma": (H,),
    }
    if key_format.per_token_scale:
        shapes["key_scale"] = (N, H, T)
    if value_format.per_token_scale:
        shapes["value_scale"] = (N, H, T)
    if bits:
        shapes.update(key_group_scale=(N, H, T // G, r), key_group_zero=(N, H, T // G, r), key_tail=(N, H, G, r))
    if value_bits:
        shapes.update(value_token_scale=(N, H, T), value_token_zero=(N, H, T))
    if has_row_scales(basis_format):
        shapes["key_basis_scale"] = (N, H, J, r)
        shapes["value_basis_scale"] = (N, H, J, r_v)
    if online:
        shapes["sketch_keys"] = (N, H, 2 * policy.ell_k, d)
        shapes["sketch_values"] = (N, H, 2 * policy.ell_v, d_v)
    if win:
        e = arrays["window_keys"].shape[2] if arrays["window_keys"].ndim == 4 else -1
        shapes["window_keys"] = (N, H, e, d)
        shapes["window_values"] = (N, H, e, d_v)
    if win and win[3]:
        s = arrays["sink_keys"].shape[2] if arrays["sink_keys"].ndim == 4 else -1
        shapes["sink_keys"] = (N, H, s, d)
        shapes["sink_values"] = (N, H, s, d_v)
    for name, shape in shapes.items():
        if tuple(arrays[name].shape) != shape:
            _fail(path, f"{name} has shape {tuple(arrays[name].shape)}; expected {shape} (num_tokens = {T}, {J} chunks, ranks {r}/{r_v}, d = {d}, d_v = {d_v})")
    if not batched and N != 1:
        _fail(path, f"an unbatched state has batch size 1, but the arrays hold {N} sequences")
    if min(d, d_v, H, N, J) < 1:
        _fail(path, f"empty dimension: N={N}, H={H}, J={J}, d={d}, d_v={d_v}")
    if len(policy.rank_k) != H or len(policy.rank_v) != H:
        _fail(path, f"policy has ranks for {len(policy.rank_k)}/{len(policy.rank_v)} heads; the arrays hold {H}")
    if max(policy.rank_k) > r or max(policy.rank_v) > r_v or max(policy.rank_k) > d or max(policy.rank_v) > d_v:
        _fail(path, f"ranks {policy.rank_k}/{policy.rank_v} do not fit the basis arrays ({r} x {d}, {r_v} x {d_v})")
    if online and (r != max(policy.rank_k) or r_v != max(policy.rank_v)):
        _fail(path, f"basis arrays have {r}/{r_v} rows; an online state has max(rank_k)/max(rank_v) = {max(policy.rank_k)}/{max(policy.rank_v)}")

    for name, x in arrays.items():
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            _fail(path, f"{name} contains NaN or Inf")
    if not (arrays["gamma"] > 0).all():
        _fail(path, "gamma must be positive")
    for name in SCALE_TENSORS + BASIS_SCALE_TENSORS + ("key_group_scale", "value_token_scale"):
        if name in arrays and (arrays[name] < 0).any():
            _fail(path, f"{name} must be >= 0 (a per-row max |value| / 127)")

    num_chunks, starts = arrays["num_chunks"], arrays["chunk_starts"]
    if num_chunks.min() < 1 or num_chunks.max() != J:
        _fail(path, f"num_chunks must lie in [1, {J}] with maximum {J} (the stored chunks), got {num_chunks.min()}..{num_chunks.max()}")
    if not online or policy.kind == "rotating":
        if J != 1:
            _fail(path, f"a {policy.kind} state has exactly one chunk per head, the file holds {J}")
    for n in range(N):
        for h in range(H):
            j = int(num_chunks[n, h])
            s = starts[n, h, :j]
            if s[0] != 0 or (np.diff(s) < 1).any() or s[-1] > T:
                _fail(path, f"chunk_starts[{n}, {h}] = {s.tolist()} must start at 0 and increase strictly up to num_tokens = {T}")
            for name, bases, rank in (("key_bases", kb, policy.rank_k[h]), ("value_bases", vb, policy.rank_v[h])):
                if bases[n, h, :j, rank:].any():
                    _fail(path, f"{name}[{n}, {h}] has non-zero rows past the head's rank {rank}")

    sketches = None
    if online:
        counts = {"filled_k", "filled_v", "rows_seen"}
        if not isinstance(sk, dict) or not counts <= set(sk) <= counts | {"tokens_over_tau"} or not all(type(v) is int for v in sk.values()):
            _fail(path, f"sketch must hold int filled_k, filled_v, rows_seen and optionally tokens_over_tau; got {sk!r}")
        over, pairs = sk.get("tokens_over_tau", 0), arrays["key_coef"].shape[0] * arrays["key_coef"].shape[1]
        if not 0 <= over <= pairs * T or (over and policy.kind != "adaptive"):
            _fail(path, f"sketch tokens_over_tau = {over} must lie in [0, {pairs * T}] ((token, head) pairs of an adaptive state, spec A7.4.1)")
        for name, ell in (("filled_k", policy.ell_k), ("filled_v", policy.ell_v)):
            if not 0 <= sk[name] <= min(2 * ell, sk["rows_seen"]):
                _fail(path, f"sketch {name} = {sk[name]} must lie in [0, min(2 ell = {2 * ell}, rows_seen = {sk['rows_seen']})]")
        for name, filled in (("sketch_keys", sk["filled_k"]), ("sketch_values", sk["filled_v"])):
            if arrays[name][:, :, filled:].any():
                _fail(path, f"{name} has non-zero rows past its fill count {filled}")
        sketches = SketchBuffers(arrays["sketch_keys"], arrays["sketch_values"], sk["filled_k"], sk["filled_v"], sk["rows_seen"], tokens_over_tau=over)
    elif sk is not None:
        _fail(path, f"a static state has no sketch, got {sk!r}")

    exact = None
    if win:
        e = arrays["window_keys"].shape[2]
        size, min_tokens, lookahead, sinks = win
        s = arrays["sink_keys"].shape[2] if sinks else 0
        if s > sinks or (s < sinks and T + e > 0):
            _fail(path, f"{s} sink tokens for sinks = {sinks}: the first {sinks} tokens fill the sinks before any other is kept (spec/window.md W7)")
        if compressed_count(T + e, size, after_sinks_threshold(min_tokens, sinks)) != T:
            _fail(
                path,
                f"num_tokens = {T} compressed and {e} exact tokens do not fit window = {size}, min_tokens = {min_tokens}, sinks = {sinks} (spec/window.md W1, W7)",
            )
        sink_arrays = (arrays["sink_keys"], arrays["sink_values"]) if sinks else (None, None)
        exact = ExactWindow(size, min_tokens, lookahead, arrays["window_keys"], arrays["window_values"], sinks, *sink_arrays)

    names = LAYOUT_TENSORS + SCALE_TENSORS + BASIS_SCALE_TENSORS + LOW_BIT_TENSORS
    layout = PackedLayout(
        **{name: arrays[name] for name in names if name in arrays},
        num_tokens=T,
        basis_format=basis_format,
        key_format=key_format.name,
        value_format=value_format.name,
        group=G if bits else 0,
    )
    return policy, layout, sketches, batched, "numpy", exact



def _widen(x: np.ndarray, dtype_name: str) -> np.ndarray:
    """Stored bfloat16 bits (uint16) as the float32 of the same value (NumPy has no bfloat16)."""
    return (x.astype(np.uint32) << 16).view(np.float32)
