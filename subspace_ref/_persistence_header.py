"""The schema of a saved state's file (spec/persistence.md): its names, versions and tensor
groups, and the header's policy, RoPE and window objects, written and checked.

Part of :mod:`subspace_ref.persistence`, which re-exports every public name here; the arrays are
checked in :mod:`subspace_ref._persistence_arrays`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import numpy as np

from subspace_ref import _checks
from subspace_ref.basis_storage import NATIVE, file_dtype_name, is_native
from subspace_ref.formats import CoefficientFormat, side_formats
from subspace_ref.layout import STATE_ARRAYS
from subspace_ref.policies import AdaptivePolicy, RotatingPolicy, StaticPolicy
from subspace_ref.policies._online import sketch_size, warmup_length
from subspace_ref.policies.adaptive import sketch_options, trigger_order
from subspace_ref.rope import RopeParams
from subspace_ref.window import options, sink_option

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



def _fail(path, message: str):
    raise StateFileError(f"{path}: {message}")



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



def _expected_dtypes(dtype_name: str, coefficients: str, stored: bool, bases: str = NATIVE) -> dict[str, str]:
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
    if not is_native(bases):
        encoded = file_dtype_name(bases, stored)
        out.update(key_bases=encoded, value_bases=encoded)
    return out



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
