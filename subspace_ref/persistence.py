"""Saving and loading a :class:`~subspace_ref.state.SubspaceState` (schema: ``spec/persistence.md``).

The file is a safetensors file: a JSON header followed by raw little-endian array bytes. Nothing in
it is executed on load (no pickle), so loading an untrusted file can at worst raise
:class:`StateFileError`. Every array is stored cut to its live range, every hyper-parameter goes
into the header's metadata as JSON, and a SHA-256 checksum over both catches corruption.

Round trips are bit-exact. A state saved from torch (or cupy) arrays loads as a NumPy state of the
same dtype, except bfloat16, which NumPy lacks: its bits are stored as uint16 and load as float32
holding exactly the same values (``state.to("torch", dtype=torch.bfloat16)`` gets the original
back). Continue on another backend with :meth:`SubspaceState.to`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from typing import Any

import numpy as np

from subspace_ref import _checks
from subspace_ref.arrays import array_family, to_numpy
from subspace_ref.basis_storage import FORMATS, float8_dtype
from subspace_ref.capabilities import NotSupportedError
from subspace_ref.layout import STATE_ARRAYS, PackedLayout, SketchBuffers, live_arrays
from subspace_ref.policies import AdaptivePolicy, RotatingPolicy, StaticPolicy
from subspace_ref.policies._online import sketch_size, warmup_length
from subspace_ref.policies.adaptive import sketch_options, trigger_order
from subspace_ref.formats import CoefficientFormat, side_formats
from subspace_ref.quantization import packed_width
from subspace_ref.rope import RopeParams
from subspace_ref.window import ExactWindow, after_sinks_threshold, compressed_count, options, sink_option

FORMAT_NAME = "subspace_ref.state"
FORMAT_VERSION = 1
#: Version 2 (spec/persistence.md) adds what version 1 cannot describe: bases stored in a format
#: of their own (header "bases"; for int8 bases per-row scales; spec/storage.md S5) and an exact
#: window (header "window", tensors window_keys/window_values; spec/window.md). A state with
#: neither is written as version 1, byte for byte as before, so older readers still read it.
EXTENDED_VERSION = 2
READ_VERSIONS = (FORMAT_VERSION, EXTENDED_VERSION)

#: Tensor names by group. The scales are present for int8 coefficients only (spec A10), the
#: sketch tensors for online states only.
LAYOUT_TENSORS = ("key_coef", "value_coef", "key_bases", "value_bases", "chunk_starts", "num_chunks", "gamma")
SCALE_TENSORS = ("key_scale", "value_scale")
SKETCH_TENSORS = ("sketch_keys", "sketch_values")
BASIS_SCALE_TENSORS = ("key_basis_scale", "value_basis_scale")  # int8 bases only (version 2)
WINDOW_TENSORS = ("window_keys", "window_values")  # exact window only (version 2)
SINK_TENSORS = ("sink_keys", "sink_values")  # attention sinks only (version 2, spec/window.md W7)
#: Arrays of the state enumeration (subspace_ref.layout.STATE_ARRAYS) that no file holds, and why.
UNSAVED = {"ring_keys": "ring_warm_start > 0 (spec/sketch_variants.md S1.6)", "ring_values": "ring_warm_start > 0 (spec/sketch_variants.md S1.6)"}
#: Tensor names in file and checksum order: the state enumeration's order.
#: int4/int2 coefficients only (version 2, header "group"; spec/quantization.md Q5)
LOW_BIT_TENSORS = ("key_group_scale", "key_group_zero", "key_tail", "value_token_scale", "value_token_zero")
TENSOR_ORDER = tuple(a.name for a in STATE_ARRAYS if a.name not in UNSAVED)

_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_WRITE_BLOCK = 1 << 20


def _policy_classes() -> dict[str, type]:
    return {cls.kind: cls for cls in (StaticPolicy, AdaptivePolicy, RotatingPolicy)}


def _unpersisted(policy) -> list:
    """Policy fields marked ``metadata={"persisted": False}`` (StaticPolicy.rope): never written,
    loaded as their default None; a state where one is set is refused by :func:`save_state`."""
    return [f for f in dataclasses.fields(policy) if f.metadata.get("persisted", True) is False]


def _optional(policy) -> list:
    """Policy fields marked ``metadata={"optional": True}`` (the online-sketch variants): written
    only when they differ from their neutral default, which a reader assumes when one is absent,
    so a plain state's file is the version 1 file it always was."""
    return [f for f in dataclasses.fields(policy) if f.metadata.get("optional", False)]


def _written_optional(policy) -> list:
    return [f for f in _optional(policy) if getattr(policy, f.name) != f.default]


class StateFileError(ValueError):
    """A file that is not a valid saved state: not safetensors, truncated, corrupted, of another
    format or version, or with arrays inconsistent with each other or with the hyper-parameters."""


# --------------------------------------------------------------------------------------- saving
def save_state(state, path) -> None:
    """Write ``state`` to ``path`` atomically (temp file in the same directory, fsync, rename).

    A failure at any point (including a crash) leaves a previous file at ``path`` untouched.
    """
    path = os.fspath(path)
    tensors, header, version = _state_record(state)
    metadata = {"format": FORMAT_NAME, "format_version": str(version), "state": _canonical_json(header)}
    metadata["checksum"] = checksum(tensors, metadata)
    data = _serialize(tensors, metadata)
    _write_atomic(path, data)


def _state_record(state) -> tuple[dict[str, np.ndarray], dict[str, Any], int]:
    """(tensors, header, format version) of ``state``'s file (spec/persistence.md), or the
    refusal of a state this schema does not describe, before anything is written."""
    if not isinstance(getattr(state, "layout", None), PackedLayout):
        raise TypeError(f"state must be a SubspaceState, got {type(state).__name__}")
    for f in _unpersisted(state.policy):
        if f.name == "rope":  # written in the header's "rope" (version 2, spec/persistence.md)
            continue
        if getattr(state.policy, f.name) is not None:  # refuse rather than drop it (before any write)
            raise NotSupportedError(
                "cannot save this state",
                [
                    f"a state with policy field {f.name}={getattr(state.policy, f.name)!r} cannot be saved: this schema does not describe it ({f.metadata.get('spec', 'spec/rope.md §5')})"
                ],
            )
    tensors, dtype_name = _tensors_of(state)
    header = _state_header(state, dtype_name)
    # the oldest version that describes the state
    extended = _bases(state) != "native" or getattr(state, "window", None) is not None or bool(_written_optional(state.policy))
    extended = extended or _extended_coefficients(_coefficients(state)) or _rope(state) is not None
    extended = extended or "tokens_over_tau" in (header["sketch"] or {})  # spec A7.4.1's counter, version 2
    return tensors, header, EXTENDED_VERSION if extended else FORMAT_VERSION


#: A layer state's file (spec/persistence.md §6): its head groups' states in one file.
LAYER_FORMAT_NAME = "subspace_ref.layer_state"
LAYER_FORMAT_VERSION = 1


def save_layer(kv_heads: int, groups: list[tuple[tuple[int, ...], dict[str, bool], Any]], path) -> None:
    """Write a layer state (spec/persistence.md §6) to ``path`` atomically: ``groups`` holds per
    head group its KV heads, its flags ({"key_identity": .., "value_identity": ..}) and its
    state. Each group's tensors are those of its state's own file, named ``group.{i}.{name}``;
    the metadata's "layer" lists the groups with their state headers and format versions."""
    path = os.fspath(path)
    tensors, entries = {}, []
    for i, (heads, flags, state) in enumerate(groups):
        own, header, version = _state_record(state)
        tensors |= {f"group.{i}.{name}": x for name, x in own.items()}
        entries.append({"heads": [int(h) for h in heads], **{k: bool(v) for k, v in flags.items()}, "format_version": str(version), "state": header})
    metadata = {"format": LAYER_FORMAT_NAME, "format_version": str(LAYER_FORMAT_VERSION), "layer": _canonical_json({"kv_heads": int(kv_heads), "groups": entries})}
    metadata["checksum"] = checksum(tensors, metadata, _layer_order(len(groups)))
    _write_atomic(path, _serialize(tensors, metadata))


def _layer_order(groups: int) -> list[str]:
    return [f"group.{i}.{name}" for i in range(groups) for name in TENSOR_ORDER]


def load_layer_parts(path) -> tuple[int, list[tuple[tuple[int, ...], dict[str, bool], tuple]]]:
    """What :func:`save_layer` wrote: (kv_heads, [(heads, flags, state parts)]), each group's
    parts checked as a state file's are (:func:`load_parts`); StateFileError naming the problem."""
    with open(os.fspath(path), "rb") as fh:
        data = fh.read()
    metadata, _ = _read_header(data, path)
    if metadata.get("format") != LAYER_FORMAT_NAME:
        raise StateFileError(f"{path}: format is {metadata.get('format')!r}, expected {LAYER_FORMAT_NAME!r} (not a saved LayerState)")
    if metadata.get("format_version") != str(LAYER_FORMAT_VERSION):
        raise StateFileError(f"{path}: format_version is {metadata.get('format_version')!r}; this version of subspace_ref reads layer files of version {LAYER_FORMAT_VERSION} only")
    layer = _json_entry(metadata, "layer", path)
    if not isinstance(layer, dict) or type(layer.get("kv_heads")) is not int or not isinstance(layer.get("groups"), list) or not layer["groups"]:
        _fail(path, f"layer must hold an int kv_heads and a non-empty list of groups, got {layer!r}")
    order = _layer_order(len(layer["groups"]))
    tensors = _decode(data, path, order)
    _check_checksum(tensors, metadata, path, order)
    out, seen = [], []
    for i, entry in enumerate(layer["groups"]):
        if not isinstance(entry, dict) or set(entry) != {"heads", "key_identity", "value_identity", "format_version", "state"}:
            _fail(path, f"group {i} must hold heads, key_identity, value_identity, format_version and state, got {entry!r}")
        heads = entry["heads"]
        if not isinstance(heads, list) or not heads or not all(type(h) is int and 0 <= h < layer["kv_heads"] for h in heads):
            _fail(path, f"group {i}: heads must be a non-empty list of KV heads in [0, {layer['kv_heads']}), got {heads!r}")
        seen += heads
        prefix = f"group.{i}."
        own = {name[len(prefix) :]: x for name, x in tensors.items() if name.startswith(prefix)}
        parts = _state_from_record(entry["state"], entry["format_version"], own, f"{path} (group {i})")
        out.append((tuple(heads), {"key_identity": bool(entry["key_identity"]), "value_identity": bool(entry["value_identity"])}, parts))
    if sorted(seen) != list(range(layer["kv_heads"])):
        _fail(path, f"the groups' heads {sorted(seen)} must be each of the {layer['kv_heads']} KV heads exactly once")
    return layer["kv_heads"], out


def _serialize(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    """The safetensors encoding (a module attribute so tests can make it fail)."""
    import safetensors.numpy

    return safetensors.numpy.save(tensors, metadata=metadata)


def _write_all(fh, data: bytes) -> None:
    """Write ``data`` in blocks (a module attribute so tests can make a write fail midway)."""
    view = memoryview(data)
    for start in range(0, len(view), _WRITE_BLOCK):
        fh.write(view[start : start + _WRITE_BLOCK])


def _write_atomic(path: str, data: bytes) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    mode = os.stat(path).st_mode & 0o777 if os.path.exists(path) else 0o644
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            _write_all(fh, data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable; not every platform can open a directory
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def _dtype_name(x: Any) -> str:
    return str(x.dtype).removeprefix("torch.")


def _host(x: Any) -> np.ndarray:
    """A C-contiguous little-endian NumPy copy of x; bfloat16 as its raw bits in uint16."""
    if array_family(x) == "torch" and _dtype_name(x) == "bfloat16":
        import torch

        out = x.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)
    else:
        out = to_numpy(x)
    if "float8_e4m3fn" in str(out.dtype):  # float8 bases (version 2): their bits, as uint8
        out = np.ascontiguousarray(out).view(np.uint8)
    out = np.ascontiguousarray(out)
    return out.astype(out.dtype.newbyteorder("<"), copy=True)


def _coefficients(state) -> str:
    return state.layout.coefficients


def _sketch_header(sk) -> dict[str, int]:
    """The header's "sketch" object: fill counts, rows seen, and spec A7.4.1's tokens_over_tau,
    written only when not 0 (version 2), so files without it are byte for byte as before."""
    out = {"filled_k": int(sk.filled_k), "filled_v": int(sk.filled_v), "rows_seen": int(sk.rows_seen)}
    if getattr(sk, "tokens_over_tau", 0):
        out["tokens_over_tau"] = int(sk.tokens_over_tau)
    return out


def _version_2_features(header: dict) -> list[str]:
    """What in a header only version 2 describes (spec/persistence.md), by name."""
    found = [name for name in ("window", "bases", "group", "rope") if name in header]
    if isinstance(header.get("sketch"), dict) and "tokens_over_tau" in header["sketch"]:
        found.append("tokens_over_tau")
    if _has_optional_fields(header):
        found.append("optional policy fields")
    if _extended_coefficients(header.get("coefficients")):
        found.append(f"{header['coefficients']} coefficients")
    return found


def _extended_coefficients(coefficients: Any) -> bool:
    """Whether a header's ``coefficients`` need version 2: low-bit codes on a side, or two formats."""
    try:
        key_format, value_format = side_formats(coefficients)
    except (ValueError, TypeError):
        return False  # refused with its reason when the state is built
    return bool(key_format.low_bits or value_format.low_bits) or key_format != value_format


def _side_tensors(key_format: CoefficientFormat, value_format: CoefficientFormat) -> tuple[str, ...]:
    """The tensors the sides' formats add, in file order."""
    added = set(key_format.arrays("key")) | set(value_format.arrays("value"))
    return tuple(name for name in TENSOR_ORDER if name in added)


def _bases(state) -> str:
    return getattr(state.layout, "basis_format", "native")


def _expected_dtypes(dtype_name: str, coefficients: str, stored: bool, bases: str = "native") -> dict[str, str]:
    """Dtype of every tensor of a state; ``stored``: as in the file (bfloat16 as uint16, float8
    bases as uint8)."""
    floating = "uint16" if stored and dtype_name == "bfloat16" else dtype_name
    out = {name: floating for name in TENSOR_ORDER}
    out.update(chunk_starts="int64", num_chunks="int64", key_scale="float32", value_scale="float32")
    out.update(key_basis_scale="float32", value_basis_scale="float32")
    out.update({name: "float16" for name in LOW_BIT_TENSORS if name != "key_tail"})
    for side, fmt in zip(("key", "value"), side_formats(coefficients)):
        if fmt.code_dtype is not None:
            out[f"{side}_coef"] = fmt.code_dtype
    if bases != "native":
        encoded = {"float16": "float16", "int8": "int8", "float8_e4m3": "uint8" if stored else "float8_e4m3fn"}[bases]
        out.update(key_bases=encoded, value_bases=encoded)
    return out


def _tensors_of(state) -> tuple[dict[str, np.ndarray], str]:
    lay = state.layout
    cut = live_arrays(state)
    if state.sketches is not None and state.sketches.ring_keys is not None:  # spec/sketch_variants.md S1.6
        raise NotSupportedError(
            "cannot save this state",
            [f"ring_warm_start={state.policy.ring_warm_start}: spec/persistence.md (format version {EXTENDED_VERSION}) does not describe ring buffers"],
        )
    unknown = sorted(set(cut) - set(TENSOR_ORDER))
    if unknown:  # an array this schema does not describe: refuse rather than drop it
        raise NotSupportedError("cannot save this state", [f"arrays {unknown}: spec/persistence.md (format version {EXTENDED_VERSION}) does not describe them"])
    dtype_name = _dtype_name(lay.gamma)
    if dtype_name not in _FLOAT_DTYPES:
        raise TypeError(f"cannot save a state of dtype {dtype_name}; expected one of {', '.join(_FLOAT_DTYPES)}")
    want = _expected_dtypes(dtype_name, _coefficients(state), stored=False, bases=_bases(state))
    tensors = {}
    for name in TENSOR_ORDER:
        if name not in cut:
            continue
        x = cut[name]
        if name in ("chunk_starts", "num_chunks"):
            tensors[name] = _host(x).astype("<i8")
            continue
        if _dtype_name(x) != want[name]:
            raise TypeError(f"cannot save: {name} has dtype {_dtype_name(x)}; a {dtype_name} state with {_coefficients(state)} coefficients has {want[name]}")
        tensors[name] = _host(x)
    return tensors, dtype_name


def _state_header(state, dtype_name: str) -> dict[str, Any]:
    policy = state.policy
    fields = {}
    for f in dataclasses.fields(policy):
        if f in _unpersisted(policy) or (f in _optional(policy) and f not in _written_optional(policy)):
            continue
        value = getattr(policy, f.name)
        fields[f.name] = [int(x) for x in value] if isinstance(value, tuple) else value
    lay = state.layout
    sk = state.sketches
    extra = {} if _bases(state) == "native" else {"bases": _bases(state)}  # version 2 only
    if side_formats(_coefficients(state))[0].low_bits:  # version 2 only: low-bit keys have groups
        extra["group"] = int(lay.group)
    rope = _rope(state)
    if rope is not None:  # version 2 only: every number JSON writes as float64 repr reads back exactly
        extra["rope"] = {"inv_freq": [float(x) for x in rope.inv_freq], "layout": rope.layout, "attention_scaling": rope.attention_scaling}
    if getattr(state, "window", None) is not None:  # version 2 only
        extra["window"] = {"size": state.window.size, "min_tokens": state.window.min_tokens, "lookahead": state.window.lookahead}
        if state.window.sinks:  # written only when there are sinks: older windowed files stay byte for byte
            extra["window"]["sinks"] = state.window.sinks
    return extra | {
        "kind": policy.kind,
        "policy": fields,
        "batched": bool(state.batched),
        "num_tokens": int(lay.num_tokens),
        "dtype": dtype_name,
        "coefficients": _coefficients(state),
        "sketch": None if sk is None else _sketch_header(sk),
        "saved_from": state.engine,
    }


def _rope(state):
    """The pre-RoPE parameters of a static state (spec/rope.md P2), else None."""
    return getattr(state.policy, "rope", None)


def _rope_from(header: dict[str, Any], policy, path):
    """``policy`` with the header's "rope" (spec/rope.md §5), checked by RopeParams itself."""
    spec = header.get("rope")
    if spec is None:
        return policy
    if policy.kind != "static":
        _fail(path, f"rope is set on a {policy.kind} state; only static states have pre-RoPE bases")
    if not isinstance(spec, dict) or set(spec) != {"inv_freq", "layout", "attention_scaling"}:
        _fail(path, f"rope must be an object with inv_freq, layout and attention_scaling, got {spec!r}")
    freq = spec["inv_freq"]
    if not isinstance(freq, list) or not all(type(x) in (int, float) for x in freq):
        _fail(path, f"rope.inv_freq must be a list of numbers, got {freq!r}")
    try:
        rope = RopeParams(np.array(freq, dtype=np.float64), layout=spec["layout"], attention_scaling=spec["attention_scaling"])
    except (TypeError, ValueError) as err:
        _fail(path, f"rope is invalid: {err}")
    return dataclasses.replace(policy, rope=rope)


def _canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def checksum(tensors: dict[str, np.ndarray], metadata: dict[str, str], order: Any = None) -> str:
    """``"sha256:" + hex`` of the metadata (``checksum`` left out) and the tensors, as
    spec/persistence.md §3 describes: the same bytes give the same digest on every machine.
    ``order``: the file's tensor order (default: a state file's, :data:`TENSOR_ORDER`)."""
    order = TENSOR_ORDER if order is None else order
    h = hashlib.sha256()
    h.update(_canonical_json({k: v for k, v in metadata.items() if k != "checksum"}).encode())
    # every tensor, in file order; names outside it (refused on load anyway) after, sorted
    for name in [n for n in order if n in tensors] + sorted(set(tensors) - set(order)):
        x = np.ascontiguousarray(tensors[name])
        x = x.astype(x.dtype.newbyteorder("<"), copy=False)
        h.update(b"\0" + name.encode() + b"\0" + x.dtype.str.encode() + b"\0" + _canonical_json(list(x.shape)).encode() + b"\0")
        h.update(x.tobytes())
    return "sha256:" + h.hexdigest()


# -------------------------------------------------------------------------------------- loading
def load_parts(path) -> tuple:
    """The parts of a state written by :func:`save_state`, as NumPy arrays: (policy, layout,
    sketches, batched, engine "numpy", window), the arguments of ``SubspaceState(...)``
    (``SubspaceState.load`` builds it; this module imports no state class).

    Raises :class:`StateFileError` naming the problem for a file that is not safetensors, is
    truncated or corrupted, has another format name or version, or holds inconsistent arrays.
    """
    with open(os.fspath(path), "rb") as fh:
        data = fh.read()
    metadata, _ = _read_header(data, path)
    _check_format(metadata, path)
    tensors = _decode(data, path)
    _check_checksum(tensors, metadata, path)
    header = _json_entry(metadata, "state", path)
    return _state_from_record(header, metadata["format_version"], tensors, path)


def _check_checksum(tensors: dict[str, np.ndarray], metadata: dict[str, str], path, order: Any = None) -> None:
    expected = checksum(tensors, metadata, order)
    if metadata.get("checksum") != expected:
        raise StateFileError(f"{path}: checksum mismatch (stored {metadata.get('checksum')!r}, computed {expected!r}); the file is corrupted")


def _json_entry(metadata: dict[str, str], name: str, path) -> Any:
    try:
        return json.loads(metadata[name])
    except (json.JSONDecodeError, TypeError, KeyError) as err:
        raise StateFileError(f"{path}: metadata {name!r} is not valid JSON ({err})") from None


def _state_from_record(header: Any, format_version: str, tensors: dict[str, np.ndarray], path) -> tuple:
    """The parts of one state from its header, the version it was written as, and its tensors."""
    # the writer uses the oldest version that describes the state (spec/persistence.md)
    needs = _version_2_features(header) if isinstance(header, dict) else []
    expected_version = str(EXTENDED_VERSION if needs else FORMAT_VERSION)
    if format_version != expected_version:
        raise StateFileError(
            f"{path}: format_version is {format_version!r}, but a state "
            + (f"with {', '.join(needs)} is written as version {expected_version}" if needs else f"with no version 2 feature is written as version {expected_version}")
        )
    return _build_state(header, tensors, path)


def _read_header(data: bytes, path) -> tuple[dict[str, str], dict[str, Any]]:
    if len(data) < 8:
        raise StateFileError(f"{path}: not a safetensors file ({len(data)} bytes; a safetensors file starts with an 8-byte header length)")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        if n > 100_000_000:
            raise StateFileError(f"{path}: not a safetensors file (header length field reads {n} bytes)")
        raise StateFileError(f"{path}: file is truncated: the header alone needs {n + 8} bytes, the file has {len(data)}")
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StateFileError(f"{path}: not a safetensors file, or its header is corrupted (header is not JSON: {err})") from None
    if not isinstance(header, dict):
        raise StateFileError(f"{path}: not a safetensors file (header is not a JSON object)")
    metadata = header.pop("__metadata__", None)
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise StateFileError(f"{path}: no subspace_ref metadata in the safetensors header (not a saved SubspaceState)")
    payload = len(data) - 8 - n
    try:
        needed = max((int(e["data_offsets"][1]) for e in header.values()), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise StateFileError(f"{path}: safetensors header is corrupted (bad tensor entry)") from None
    if needed > payload:
        raise StateFileError(f"{path}: file is truncated: the header describes {needed} bytes of array data, the file holds {payload}")
    return metadata, header


def _check_format(metadata: dict[str, str], path) -> None:
    if metadata.get("format") != FORMAT_NAME:
        raise StateFileError(f"{path}: format is {metadata.get('format')!r}, expected {FORMAT_NAME!r} (not a saved SubspaceState)")
    version = metadata.get("format_version")
    if version not in [str(v) for v in READ_VERSIONS]:
        raise StateFileError(f"{path}: format_version is {version!r}; this version of subspace_ref reads versions {', '.join(map(str, READ_VERSIONS))} only")


def _decode(data: bytes, path, order: Any = None) -> dict[str, np.ndarray]:
    import safetensors.numpy
    from safetensors import SafetensorError

    order = TENSOR_ORDER if order is None else order
    try:
        tensors = safetensors.numpy.load(data)
    except (SafetensorError, ValueError, TypeError) as err:
        raise StateFileError(f"{path}: corrupted safetensors file ({err})") from None
    unknown = sorted(set(tensors) - set(order))
    if unknown:
        raise StateFileError(f"{path}: unexpected arrays {unknown}; a saved {'state' if order is TENSOR_ORDER else 'layer'} holds only {list(order)}")
    return tensors


# ------------------------------------------------------------------------------ validation, build
def _fail(path, message: str):
    raise StateFileError(f"{path}: {message}")


def _has_optional_fields(header: dict[str, Any]) -> bool:
    """Whether the header's policy holds a field that only version 2 writes (an optional one)."""
    cls = _policy_classes().get(header.get("kind"))
    fields = header.get("policy")
    return cls is not None and isinstance(fields, dict) and any(f.name in fields for f in _optional(cls))


def _policy_from(header: dict[str, Any], path):
    """The policy dataclass from its JSON fields: every field present, each of its declared type,
    then the constructors' own checks."""
    classes = _policy_classes()
    kind = header.get("kind")
    if kind not in classes:
        _fail(path, f"kind is {kind!r}; expected one of {sorted(classes)}")
    cls = classes[kind]
    names = [f.name for f in dataclasses.fields(cls) if f not in _unpersisted(cls) and f not in _optional(cls)]
    optional = [f.name for f in _optional(cls)]
    fields = header.get("policy")
    if not isinstance(fields, dict) or not set(names) <= set(fields) <= set(names) | set(optional):
        _fail(
            path,
            f"policy fields are {sorted(fields) if isinstance(fields, dict) else fields!r}; a {kind} state has {sorted(names)}"
            + (f" and optionally {sorted(optional)}" if optional else ""),
        )
    try:
        values = {}
        for f in dataclasses.fields(cls):
            if f in _unpersisted(cls) or (f in _optional(cls) and f.name not in fields):
                continue  # left at its default: None for unpersisted fields, neutral for optional ones
            values[f.name] = _typed(f.name, str(f.type), fields[f.name])
        policy = cls(**values)
        if kind == "static":
            return policy
        if min(policy.rank_k + policy.rank_v) < 1:
            raise ValueError(f"ranks of an online state must be >= 1, got {list(policy.rank_k)}/{list(policy.rank_v)}")
        sketch_size("ell_k", policy.ell_k, policy.rank_k, "rank_k")
        sketch_size("ell_v", policy.ell_v, policy.rank_v, "rank_v")
        warmup_length(policy.warmup, policy.rank_k, policy.rank_v)
        for name in ("tau_k", "tau_v"):
            if hasattr(policy, name):
                _checks.open_unit_interval(name, getattr(policy, name))
        for name in ("max_chunk", "refresh_every"):
            if hasattr(policy, name):
                _checks.positive_int(name, getattr(policy, name))
        if hasattr(policy, "fd_stride"):  # spec/sketch_variants.md S1.6: no file holds ring buffers
            sketch_options(policy.ring_warm_start, policy.fd_stride, policy.reuse_angle, policy.sketch_reset)
            trigger_order(policy.trigger)
            if policy.ring_warm_start:
                raise ValueError("ring_warm_start > 0 states are never saved (their ring buffers have no tensor in this format)")
        return policy
    except (TypeError, ValueError) as err:
        _fail(path, f"invalid {kind} policy: {err}")


def _typed(name: str, annotation: str, value: Any) -> Any:
    """``value`` from JSON checked against a policy field's annotation (tuple of ints, int, float, bool, str)."""
    if annotation.startswith("tuple"):
        if not isinstance(value, list) or not value or not all(type(x) is int and x >= 0 for x in value):
            raise ValueError(f"{name} must be a non-empty list of non-negative ints, got {value!r}")
        return tuple(value)
    if annotation == "int":
        if type(value) is not int:
            raise ValueError(f"{name} must be an int, got {value!r}")
        return value
    if annotation == "float":
        if type(value) not in (int, float):
            raise ValueError(f"{name} must be a number, got {value!r}")
        return float(value)
    if annotation == "float | None":
        return None if value is None else _typed(name, "float", value)
    if annotation == "bool":
        if type(value) is not bool:
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value
    if annotation == "str":
        if type(value) is not str:
            raise ValueError(f"{name} must be a string, got {value!r}")
        return value
    raise ValueError(f"policy field {name} has type {annotation}, which this reader cannot check")


def _build_state(header: Any, tensors: dict[str, np.ndarray], path):
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
    basis_format = header.get("bases", "native")
    if "bases" in header and basis_format not in FORMATS[1:]:
        _fail(path, f"bases is {basis_format!r}; a version {EXTENDED_VERSION} file stores them as one of {list(FORMATS[1:])}")
    online = policy.kind != "static"
    win = _window_options(header.get("window", None), policy.kind, path)
    expected_names = LAYOUT_TENSORS + _side_tensors(key_format, value_format) + (SKETCH_TENSORS if online else ())
    expected_names += (BASIS_SCALE_TENSORS if basis_format == "int8" else ()) + (WINDOW_TENSORS if win else ()) + (SINK_TENSORS if win and win[3] else ())
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
    if basis_format == "float8_e4m3":  # their bits, stored as uint8
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
    if basis_format == "int8":
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


def _window_options(win: Any, kind: str, path) -> tuple[int, int, int, int] | None:
    """(window, min_tokens, lookahead, sinks) from the header's ``window`` object (spec/window.md
    W1, W7; ``sinks`` absent means 0), checked by the constructors' own rules; None when the
    state has no exact tokens."""
    if win is None:
        return None
    keys = {"size", "min_tokens", "lookahead"}
    if not isinstance(win, dict) or set(win) - {"sinks"} != keys or not all(type(v) is int for v in win.values()):
        _fail(path, f"window must hold int size, min_tokens, lookahead (and sinks > 0 when there are sinks); got {win!r}")
    try:
        out = options(win["size"], win["min_tokens"], win["lookahead"], kind) + (sink_option(win.get("sinks", 0)),)
    except (TypeError, ValueError) as err:
        _fail(path, f"invalid window: {err}")
    if "sinks" in win and out[3] == 0:
        _fail(path, "window has sinks = 0; a state without sinks is saved without the key")
    if out[:2] == (0, 0) and out[3] == 0:
        _fail(path, "window has size = min_tokens = 0 and no sinks; such a state has no exact window and is saved without one")
    return out


def _widen(x: np.ndarray, dtype_name: str) -> np.ndarray:
    """Stored bfloat16 bits (uint16) as the float32 of the same value (NumPy has no bfloat16)."""
    return (x.astype(np.uint32) << 16).view(np.float32)
