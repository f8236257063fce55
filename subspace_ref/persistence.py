"""Saving and loading a :class:`~subspace_ref.state.SubspaceState` (schema: ``spec/persistence.md``).

The file is a safetensors file: a JSON header followed by raw little-endian array bytes. Nothing in
it is executed on load (no pickle), so loading an untrusted file can at worst raise
:class:`StateFileError`. Every array is stored cut to its live range, every hyper-parameter goes
into the header's metadata as JSON, and a SHA-256 checksum over both catches corruption.

Round trips are bit-exact. A state saved from torch (or cupy) arrays loads as a NumPy state of the
same dtype, except bfloat16, which NumPy lacks: its bits are stored as uint16 and load as float32
holding exactly the same values (``state.to("torch", dtype=torch.bfloat16)`` gets the original
back). Continue on another backend with :meth:`SubspaceState.to`.

This module writes and reads files (states and layer states); the schema (names, versions, tensor
groups, checksum, the header's objects) is :mod:`subspace_ref._persistence_header` and the arrays'
checks on load are :mod:`subspace_ref._persistence_arrays`. Their public names are re-exported here.
"""


import dataclasses
import json
import os
import tempfile
from typing import Any

import numpy as np

from subspace_ref._persistence_arrays import build_state
from subspace_ref._persistence_header import (  # noqa: F401  (re-exported: the file schema)
    BASIS_SCALE_TENSORS,
    EXTENDED_VERSION,
    FORMAT_NAME,
    FORMAT_VERSION,
    LAYOUT_TENSORS,
    LOW_BIT_TENSORS,
    READ_VERSIONS,
    SCALE_TENSORS,
    SINK_TENSORS,
    SKETCH_TENSORS,
    TENSOR_ORDER,
    UNSAVED,
    WINDOW_TENSORS,
    StateFileError,
    _FLOAT_DTYPES,
    _canonical_json,
    _expected_dtypes,
    _extended_coefficients,
    _fail,
    _optional,
    _unpersisted,
    _version_2_features,
    _written_optional,
    checksum,
)
from subspace_ref.arrays import array_family, to_numpy
from subspace_ref.basis_storage import NATIVE, is_native
from subspace_ref.capabilities import NotSupportedError
from subspace_ref.formats import side_formats
from subspace_ref.layout import PackedLayout, live_arrays

_WRITE_BLOCK = 1 << 20


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
    extended = not is_native(_bases(state)) or getattr(state, "window", None) is not None or bool(_written_optional(state.policy))
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


def _bases(state) -> str:
    return getattr(state.layout, "basis_format", NATIVE)



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
    extra = {} if is_native(_bases(state)) else {"bases": _bases(state)}  # version 2 only
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
    return build_state(header, tensors, path)


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
