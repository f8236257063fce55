"""What the vLLM plugin serves, decided once at start-up without importing vLLM or torch
(docs/vllm.md).

:func:`bases_directory` finds the bases directory named by vLLM's ``additional_config``
(``{"subspace_bases": DIR}``) or kept beside the checkpoint (``<model>/subspace_bases``).
:func:`make_plan` loads it as a :class:`~subspace_ref.hf.CalibratedBases`, checks it against the
served model (config hash, heads, head sizes), and turns it into the per-layer arrays the
attention backend projects with: bases decoded from their storage format exactly as the
library's states decode them, zero rows padding every layer to one kernel head size, γ per KV
head. Everything vLLM's paged cache cannot hold yet is refused here with a
:class:`SubspaceConfigError` naming it, before any worker starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: The additional_config key naming the bases directory (a path; null or false: no bases).
BASES_KEY = "subspace_bases"
#: Opt-in exact zero padding of uneven widths (r_k != r_v, or layers of different ranks).
PAD_KEY = "subspace_pad"
#: Where a checkpoint's own bases live when additional_config names none.
DEFAULT_DIRNAME = "subspace_bases"

#: The library's state options (``subspace_ref.hf.static_states`` keywords) as additional_config
#: keys: the value that means "off", and why vLLM's paged cache cannot hold anything else yet.
UNSUPPORTED_OPTIONS: dict[str, tuple[Any, str]] = {
    "subspace_rope": (
        None,
        "pre-RoPE bases: each cached key would be rebuilt and rotated to its position at every read "
        "(spec/rope.md P3); vLLM's paged kernels dot the query with stored keys as they are. Needs a kernel that "
        "rebuilds keys (the library's CPU kernels do it; vLLM's do not). Calibrate post-RoPE bases (the default)",
    ),
    "subspace_coefficients": (
        "float",
        "low-bit coefficients (spec A10 int8, spec/quantization.md int4/int2) carry per-token or per-group scales "
        "that vLLM's paged cache has no slot for; its fp8 cache is another format that the library has no "
        "reference path for. Use float coefficients",
    ),
    "subspace_window": (0, "an exact window keeps the last tokens' full keys and values beside the coefficients: a second cache of another head size"),
    "subspace_min_tokens": (0, "min_tokens keeps the first tokens exact: a second cache of another head size"),
    "subspace_sinks": (0, "exact sinks keep the first tokens' full keys and values: a second cache of another head size"),
    "subspace_state": (
        "static",
        "adaptive and rotating states change their bases as tokens arrive (spec A7/A8): a cached coefficient "
        "is only meaningful with the basis of its chunk, which vLLM's paged kernels cannot look up per token",
    ),
    "subspace_share": ("kv_head", "share='query_head' stores values per query head: not vLLM's per-KV-head cache layout"),
    "subspace_compress": ("both", "one-sided compression keeps one side at the full head size: r_k != r_v, one head size per cache"),
}
KNOWN_KEYS = (BASES_KEY, PAD_KEY, *UNSUPPORTED_OPTIONS)
#: Calibration facts that would mark an artifact as pre-RoPE (the artifact format has no field of its own).
PRE_ROPE_FACTS = ("rope", "pre_rope")


class SubspaceConfigError(ValueError):
    """A configuration the plugin refuses to serve, with what is wrong and what to do."""

    def __init__(self, message: str):
        super().__init__(f"subspace_ref.vllm: {message}")


def options(additional_config: Any) -> dict:
    """The plugin's keys of vLLM's ``additional_config``: unknown ``subspace_*`` keys and state
    options the paged cache cannot hold are refused.

    Parameters
    ----------
    additional_config : dict or None
        vLLM's ``additional_config``; anything but a dict counts as empty.

    Returns
    -------
    dict
        ``{key: value}`` of the accepted ``subspace_*`` keys.

    Raises
    ------
    SubspaceConfigError
        On an unknown key, an option the paged cache cannot hold, or a non-boolean
        ``subspace_pad``.

    Examples
    --------
    ::

        from subspace_ref.vllm.config import SubspaceConfigError, options

        options({"subspace_bases": "bases/", "other": 1})   # {'subspace_bases': 'bases/'}
        try:
            options({"subspace_coefficients": "int8"})
        except SubspaceConfigError as e:
            print(e)                                        # why the paged cache cannot hold it
    """
    if not isinstance(additional_config, dict):
        return {}
    mine = {k: v for k, v in additional_config.items() if isinstance(k, str) and k.startswith("subspace_")}
    for key, value in mine.items():
        if key not in KNOWN_KEYS:
            raise SubspaceConfigError(f"unknown additional_config key {key!r}; the plugin reads {', '.join(KNOWN_KEYS)}")
        if key in UNSUPPORTED_OPTIONS:
            off, why = UNSUPPORTED_OPTIONS[key]
            if not _is_off(value, off):
                raise SubspaceConfigError(f"{key}={value!r} is not supported by vLLM's paged cache: {why}")
    if PAD_KEY in mine and not isinstance(mine[PAD_KEY], bool):
        raise SubspaceConfigError(f"{PAD_KEY} must be true or false, got {mine[PAD_KEY]!r}")
    return mine


def _is_off(value: Any, off: Any) -> bool:
    if off is None:
        return value in (None, False, 0, "none", "")
    return value == off


def bases_directory(additional_config: Any, model: str | None) -> Path | None:
    """The bases directory to serve with, or None for stock vLLM.

    ``additional_config["subspace_bases"]``: a directory (must exist), or null/false for none.
    Without the key: ``<model>/subspace_bases`` when the model is a local directory holding one.

    Parameters
    ----------
    additional_config : dict or None
        vLLM's ``additional_config``.
    model : str or None
        The served model (a path or a hub id).

    Returns
    -------
    pathlib.Path or None
        The directory, or None for stock vLLM.

    Raises
    ------
    SubspaceConfigError
        If the named directory does not exist or is not a path, or :func:`options` refuses.

    Examples
    --------
    See :func:`make_plan`.
    """
    opts = options(additional_config)
    if BASES_KEY in opts:
        value = opts[BASES_KEY]
        if value in (None, False, ""):
            return None
        if not isinstance(value, (str, Path)):
            raise SubspaceConfigError(f"{BASES_KEY} must be a directory path, got {value!r}")
        path = Path(value).expanduser()
        if not path.is_dir():
            raise SubspaceConfigError(f"{BASES_KEY}: no such directory {str(path)!r} (make one with `subspace-kv calibrate --bases-out DIR`)")
        return path
    if model and Path(model).is_dir() and (Path(model) / DEFAULT_DIRNAME).is_dir():
        return Path(model) / DEFAULT_DIRNAME
    return None


def read_bases(directory: Path, hf_config: Any):
    """The :class:`~subspace_ref.hf.CalibratedBases` in ``directory``, refused with the reason
    when it is missing, corrupt, of another kind, low-bit, pre-RoPE or for another model.

    Parameters
    ----------
    directory : pathlib.Path
        A directory ``CalibratedBases.save_pretrained`` wrote.
    hf_config : transformers.PretrainedConfig
        The checkpoint's config as transformers reads it (its hash must match the bases').

    Returns
    -------
    CalibratedBases
        The bases.

    Raises
    ------
    SubspaceConfigError
        For each refusal above, naming it.

    Examples
    --------
    See :func:`make_plan`.
    """
    from subspace_ref.hf.artifact import FORMAT_VERSION, METADATA, TENSORS, CalibratedBases, config_hash

    for name in (METADATA, TENSORS):
        if not (directory / name).is_file():
            raise SubspaceConfigError(f"bases directory {str(directory)!r} holds no {name}: not a CalibratedBases directory (write one with save_pretrained)")
    try:
        meta = json.loads((directory / METADATA).read_text())
    except (OSError, ValueError) as e:
        raise SubspaceConfigError(f"{directory / METADATA} is not readable JSON: {e}") from e
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise SubspaceConfigError(f"{directory / METADATA}: format_version {meta.get('format_version') if isinstance(meta, dict) else None!r}, this library reads {FORMAT_VERSION}")
    kind = meta.get("kind")
    if kind != "static":
        raise SubspaceConfigError(f"{directory}: bases of kind {kind!r}: {UNSUPPORTED_OPTIONS['subspace_state'][1]}")
    bits = meta.get("coefficient_bits")
    if bits != 16:
        raise SubspaceConfigError(f"{directory}: coefficient_bits={bits!r}: {UNSUPPORTED_OPTIONS['subspace_coefficients'][1]}")
    if meta.get("allocation") is not None:
        refuse_allocation(directory, meta["allocation"])
    facts = meta.get("calibration") or {}
    if any(facts.get(k) not in (None, False, "post") for k in PRE_ROPE_FACTS):
        raise SubspaceConfigError(f"{directory}: calibrated on pre-RoPE keys: {UNSUPPORTED_OPTIONS['subspace_rope'][1]}")
    expected = config_hash(hf_config)
    if meta.get("config_hash") != expected:
        source = facts.get("source")
        raise SubspaceConfigError(
            f"{directory}: bases for another model: calibrated for config hash {str(meta.get('config_hash'))[:12]}"
            f"{f' ({source})' if source else ''}, the served model has {expected[:12]}"
        )
    try:
        return CalibratedBases.from_pretrained(directory, hf_config)
    except Exception as e:  # a corrupt file surfaces as whatever safetensors or the checks raise
        raise SubspaceConfigError(f"bases directory {str(directory)!r} is corrupt: {type(e).__name__}: {e}") from e


def refuse_allocation(directory: Path, allocation: Any) -> None:
    """An artifact's per-head allocation (``subspace_ref.allocation.Allocation.to_dict()``) is
    served only when every head is what a static state holds: float coefficients on both sides,
    a post-RoPE (or RoPE-plane) key basis, a subspace value basis, no exact window or sinks."""
    if not isinstance(allocation, dict):
        raise SubspaceConfigError(f"{directory}: allocation is not a dict: {allocation!r}")
    if allocation.get("window", 0) or allocation.get("sinks", 0):
        raise SubspaceConfigError(
            f"{directory}: the allocation keeps an exact window of {allocation.get('window', 0)} tokens and {allocation.get('sinks', 0)} sinks: "
            f"{UNSUPPORTED_OPTIONS['subspace_window'][1]}"
        )
    for i, layer in enumerate(allocation.get("heads") or ()):
        for h, head in enumerate(layer):
            where = f"{directory}: the allocation's layer {i} head {h}"
            if head.get("bits_k", 16) != 16 or head.get("bits_v", 16) != 16:
                raise SubspaceConfigError(f"{where} stores {head.get('bits_k')}/{head.get('bits_v')}-bit key/value coefficients: {UNSUPPORTED_OPTIONS['subspace_coefficients'][1]}")
            if head.get("key_basis", "post_rope") == "pre_rope":
                raise SubspaceConfigError(f"{where} has a pre-RoPE key basis: {UNSUPPORTED_OPTIONS['subspace_rope'][1]}")
            if head.get("key_basis", "post_rope") not in ("post_rope", "plane") or head.get("value_basis", "subspace") != "subspace":
                raise SubspaceConfigError(
                    f"{where} keeps keys ({head.get('key_basis')}) or values ({head.get('value_basis')}) at their full size: a head size other than "
                    "the subspace heads' in one cache (vLLM's cache has one)"
                )


@dataclass(frozen=True)
class LayerBases:
    """One layer's bases for all KV heads at the plan's rank r (zero rows pad lower ranks):
    ``B`` (H, r, d) and ``E`` (H, r, d_v) decoded from the artifact's storage format in float32,
    ``gamma`` (H,), and the artifact's own widths ``rank_k``/``rank_v``."""

    B: np.ndarray
    E: np.ndarray
    gamma: np.ndarray
    rank_k: int
    rank_v: int


@dataclass(frozen=True)
class Plan:
    """What a model is served with.

    Each KV head's coefficients take ``rank`` slots; ``pack`` consecutive KV heads of a rank
    share one head of vLLM's cache of head size ``width`` (>= pack x rank, a size the kernel
    takes; the rest zero). Packing is exact: a query reads only its own head's slots (the others
    meet zeros in its projected query) and keeps only those slots of the output. It lets a rank
    below the kernel's smallest head size keep its full saving, e.g. two heads of r = 16 in one
    head of 32.

    Parameters
    ----------
    directory : str
        The bases directory.
    rank : int
        Coefficient slots per KV head (the largest rank; lower ones zero-padded).
    width : int
        Head size of vLLM's cache.
    pack : int
        KV heads per cache head.
    layers : tuple of LayerBases
        One per layer.
    head_size, head_size_v : int
        The model's key and value head sizes.
    num_kv_heads : int
        The model's KV heads.

    Examples
    --------
    See :func:`make_plan`.
    """

    directory: str
    rank: int
    width: int
    pack: int
    layers: tuple[LayerBases, ...]
    head_size: int
    head_size_v: int
    num_kv_heads: int

    @property
    def capacity_ratio(self) -> float:
        """Tokens the paged cache holds against stock for the same bytes: (d + d_v) pack / 2W."""
        return (self.head_size + self.head_size_v) * self.pack / (2 * self.width)

    def summary(self) -> str:
        ranks = ", ".join(f"{b.rank_k}/{b.rank_v}" for b in self.layers)
        layout = f"{self.pack} KV heads of rank {self.rank} per cache head of {self.width}" if self.pack > 1 else f"rank {self.rank} in cache heads of {self.width}"
        return (
            f"subspace bases {self.directory}: key/value ranks per layer {ranks}; {layout} (zero padding is exact), "
            f"for heads of {self.head_size}/{self.head_size_v}: {self.capacity_ratio:.2f}x the stock cache's tokens"
        )


def local_kv_heads(tp_rank: int, tp_size: int, total_kv_heads: int) -> range:
    """The global KV heads a tensor-parallel rank holds, as vLLM's QKVParallelLinear shards
    them: ``total/tp`` consecutive heads per rank, or one head replicated on ``tp/total``
    consecutive ranks when there are more ranks than KV heads."""
    check_tensor_parallel(tp_size * total_kv_heads, total_kv_heads, tp_size)  # the KV side of the check
    if tp_size >= total_kv_heads:
        replicas = tp_size // total_kv_heads
        return range(tp_rank // replicas, tp_rank // replicas + 1)
    n = total_kv_heads // tp_size
    return range(tp_rank * n, (tp_rank + 1) * n)


def check_tensor_parallel(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """Refuse a TP degree that vLLM cannot shard these heads by (query heads split evenly; KV
    heads split evenly, or each replicated on the same number of ranks)."""
    if tp_size < 1:
        raise SubspaceConfigError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    if num_heads % tp_size:
        raise SubspaceConfigError(f"tensor_parallel_size {tp_size} does not divide the model's {num_heads} query heads")
    if (tp_size >= num_kv_heads and tp_size % num_kv_heads) or (tp_size < num_kv_heads and num_kv_heads % tp_size):
        raise SubspaceConfigError(
            f"tensor_parallel_size {tp_size} does not divide the model's {num_kv_heads} KV heads, nor do they divide it "
            "(vLLM splits KV heads evenly or replicates each on the same number of ranks)"
        )


def kernel_width(width: int, supported) -> int:
    """The smallest head size the kernel takes that holds ``width`` coefficients (zero padding
    is exact), or a refusal naming the sizes."""
    fits = [s for s in sorted(supported) if s >= width]
    if not fits:
        raise SubspaceConfigError(f"rank {width} exceeds every head size vLLM's CPU attention kernel takes ({', '.join(map(str, sorted(supported)))})")
    return fits[0]


def cache_geometry(rank: int, local_kv_heads: int, supported) -> tuple[int, int]:
    """(pack, width): how many KV heads of ``rank`` share one cache head of ``width``, chosen for
    the fewest cache bytes per KV head (width / pack), then the least packing; ``pack`` divides
    the KV heads a rank holds."""
    kernel_width(rank, supported)  # refuses a rank no head size holds
    options = [(kernel_width(p * rank, supported) / p, p) for p in range(1, local_kv_heads + 1) if local_kv_heads % p == 0 and p * rank <= max(supported)]
    cost, pack = min(options)
    return pack, kernel_width(pack * rank, supported)


def _decoded(x: np.ndarray, fmt: str) -> np.ndarray:
    """The bases the library's states attend with: stored in ``fmt``, decoded to float32."""
    from subspace_ref.basis_storage import decode, encode

    stored, scale = encode(np.ascontiguousarray(x, dtype=np.float32), fmt, np.float32)
    return np.asarray(decode(stored, scale, np.float32), dtype=np.float32)


def _padded(x: np.ndarray, width: int) -> np.ndarray:
    out = np.zeros((x.shape[0], width, x.shape[2]), dtype=np.float32)
    out[:, : x.shape[1]] = x
    return out


def make_plan(
    bases,
    *,
    directory: str,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    head_size_v: int,
    supported_widths,
    pad: bool = False,
    tp_size: int = 1,
    kv_cache_dtype: str = "auto",
) -> Plan:
    """Check ``bases`` (:class:`~subspace_ref.hf.CalibratedBases`) against the served model and
    vLLM's settings and build the :class:`Plan`.

    Parameters
    ----------
    bases : CalibratedBases
        From :func:`read_bases`.
    directory : str
        Named in messages and the plan.
    num_layers, num_heads, num_kv_heads, head_size, head_size_v : int
        The served model's shapes.
    supported_widths : iterable of int
        Head sizes vLLM's CPU kernel takes.
    pad : bool
        ``subspace_pad``: zero-pad uneven ranks and stock layers (exact, less saving).
    tp_size : int
        Tensor-parallel degree.
    kv_cache_dtype : str
        Only "auto".

    Returns
    -------
    Plan
        The per-layer bases at one rank and the cache geometry.

    Raises
    ------
    SubspaceConfigError
        For anything the CPU paged cache cannot hold exactly, naming it and what to do.

    Examples
    --------
    ::

        import torch
        from subspace_ref.hf import CalibratedBases, capture
        from subspace_ref.models.default_model import load_model
        from subspace_ref.vllm.config import bases_directory, make_plan, read_bases

        model, config = load_model("default")
        ids = torch.tensor([list(b"def read_config(path):\\n    return json.load(open(path))\\n")])
        CalibratedBases.for_model(model, capture(model, ids).calibrate(rank_k=16, rank_v=16)).save_pretrained("bases/")
        directory = bases_directory({"subspace_bases": "bases/"}, model=None)   # Path('bases')
        bases = read_bases(directory, config)
        plan = make_plan(bases, directory=str(directory), num_layers=4, num_heads=4, num_kv_heads=2, head_size=64,
                         head_size_v=64, supported_widths=(32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512))
        plan.pack, plan.width, plan.capacity_ratio                            # (2, 32, 4.0)
    """
    if kv_cache_dtype not in ("auto", None):
        raise SubspaceConfigError(f"kv_cache_dtype={kv_cache_dtype!r}: {UNSUPPORTED_OPTIONS['subspace_coefficients'][1]}")
    check_tensor_parallel(num_heads, num_kv_heads, tp_size)
    layers = list(bases.layers)
    if len(layers) != num_layers:
        raise SubspaceConfigError(f"{directory}: bases for {len(layers)} layers, the model has {num_layers}")
    widths = []
    for i, b in enumerate(layers):
        if b is None:
            if not pad:
                raise SubspaceConfigError(
                    f"{directory}: layer {i} has no bases (kept stock); vLLM's cache has one head size for every layer. "
                    f'Set additional_config {PAD_KEY}=true to store it at full rank (identity bases, exact, no saving)'
                )
            widths.append((head_size, head_size_v))
            continue
        H, r_k, d = b.B.shape
        _, r_v, d_v = b.E.shape
        if H != num_kv_heads or d != head_size or d_v != head_size_v:
            raise SubspaceConfigError(
                f"{directory}: layer {i} has bases for {H} KV heads of size {d}/{d_v}, the model has {num_kv_heads} of size {head_size}/{head_size_v}"
            )
        widths.append((r_k, r_v))
    uneven = sorted({w for pair in widths for w in pair})
    if len(uneven) > 1 and not pad:
        which = [f"layer {i}: {rk}/{rv}" for i, (rk, rv) in enumerate(widths)]
        raise SubspaceConfigError(
            f"{directory}: key/value ranks differ ({', '.join(which)}); vLLM's CPU paged cache stores keys and values of every layer "
            f"at one head size (r_k != r_v needs a GPU backend with separate K/V widths). Calibrate one rank for keys and values, or set "
            f"additional_config {PAD_KEY}=true to zero-pad all to {max(uneven)} (exact; the cache then holds {max(uneven)} coefficients per side)"
        )
    rank = max(uneven)
    pack, width = cache_geometry(rank, max(1, num_kv_heads // tp_size), supported_widths)
    fmt = bases.basis_format
    out = []
    for b in layers:
        if b is None:
            eye_k = np.broadcast_to(np.eye(head_size, dtype=np.float32), (num_kv_heads, head_size, head_size))
            eye_v = np.broadcast_to(np.eye(head_size_v, dtype=np.float32), (num_kv_heads, head_size_v, head_size_v))
            out.append(LayerBases(_padded(eye_k, rank), _padded(eye_v, rank), np.ones(num_kv_heads, np.float32), head_size, head_size_v))
            continue
        B, E = _decoded(b.B, fmt), _decoded(b.E, fmt)
        gamma = np.asarray(b.gamma, dtype=np.float32)
        if not np.all(np.isfinite(gamma)) or np.any(gamma <= 0):
            raise SubspaceConfigError(f"{directory}: gamma must be positive and finite, got {gamma.tolist()}")
        out.append(LayerBases(_padded(B, rank), _padded(E, rank), gamma, b.B.shape[1], b.E.shape[1]))
    return Plan(str(directory), rank, width, pack, tuple(out), head_size, head_size_v, num_kv_heads)


__all__ = [
    "BASES_KEY",
    "DEFAULT_DIRNAME",
    "KNOWN_KEYS",
    "LayerBases",
    "PAD_KEY",
    "Plan",
    "SubspaceConfigError",
    "UNSUPPORTED_OPTIONS",
    "bases_directory",
    "cache_geometry",
    "check_tensor_parallel",
    "kernel_width",
    "local_kv_heads",
    "make_plan",
    "options",
    "read_bases",
    "refuse_allocation",
]
