"""Calibrated bases as an artifact: ``save_pretrained(dir)`` / ``from_pretrained(dir)``
(spec/models.md M10).

A directory holds ``subspace_bases.safetensors`` (per layer ``layers.{i}.B`` (H, r, d),
``layers.{i}.E`` (H, r_v, d_v), ``layers.{i}.gamma`` (H,)) and ``subspace_bases.json`` (format
version, basis kind, per-layer per-head ranks, γ, coefficient bits, basis storage format, the
hash of the model config the bases were calibrated for, how they were calibrated, and an
optional per-head allocation record). Loading checks the tensors against the ranks written in
the JSON and, given a model config, the config hash: bases calibrated for another architecture
are refused with a ValueError naming both hashes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from subspace_ref.calibration import StaticBasis

TENSORS = "subspace_bases.safetensors"
METADATA = "subspace_bases.json"
FORMAT_VERSION = 1
#: Config fields that change what a layer's keys and values are (shapes, positions, layer
#: types); names of files, dtypes and the attention implementation do not.
ARCHITECTURE_FIELDS = (
    "model_type",
    "architectures",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",
    "rotary_pct",
    "layer_types",
    "sliding_window",
    "use_sliding_window",
    "query_pre_attn_scalar",
    "n_embd",
    "n_layer",
    "n_head",
)


def config_hash(config) -> str:
    """SHA-256 of the config's architecture fields (:data:`ARCHITECTURE_FIELDS`, canonical JSON).

    Bases are tied to this hash: :meth:`CalibratedBases.from_pretrained` and :func:`compress`
    refuse bases of another architecture.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        A model config (a multimodal one: its decoder text config is hashed).

    Returns
    -------
    str
        64 hex digits; unchanged by dtype, file names or the attention implementation.

    Examples
    --------
    ::

        from subspace_ref.hf import config_hash
        from subspace_ref.models.default_model import load_model

        model, config = load_model("default")
        h = config_hash(config)                      # 64 hex digits
        config._attn_implementation = "eager"
        config_hash(config) == h                     # True
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    values = text.to_dict() if hasattr(text, "to_dict") else dict(vars(text))
    picked = {name: values[name] for name in ARCHITECTURE_FIELDS if values.get(name) is not None}
    return hashlib.sha256(json.dumps(picked, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class CalibratedBases:
    """Static bases of every layer of one model, with what is needed to use them again.

    ``layers``: one :class:`StaticBasis` per layer (None for a layer left uncompressed, e.g. a
    sliding-window layer kept stock). ``coefficient_bits``: 16 (float coefficients in the
    model's dtype) or 8 (spec A10 INT8), for every head of bases without an allocation.
    ``basis_format``: how states store the bases (spec/storage.md S1). ``config_hash``:
    :func:`config_hash` of the model calibrated. ``allocation``: the per-head
    :class:`~subspace_ref.allocation.Allocation` (ranks, bits and basis kinds of each head, the
    exact window and sinks, the key group) the bases were made for (saved with its
    ``to_dict()``, read back with ``from_dict``), or None; with one, :meth:`states` builds
    exactly what it says (:class:`~subspace_ref.hf.allocated_states`) and ``coefficient_bits``
    must be left at 16. ``calibration``: free-form facts (tokens, energy, compression ratio asked).

    Parameters
    ----------
    layers : tuple of StaticBasis or None
        One per model layer.
    config_hash : str
        :func:`config_hash` of the model the bases belong to (:meth:`for_model` computes it).
    coefficient_bits : int
        16 or 8.
    basis_format : str
        Storage of the bases in states ("float16", "native", ...).
    kind : str
        Only "static".
    allocation : Allocation or None
        The per-head allocation the bases were made for.
    calibration : dict
        Free-form facts, saved in the JSON.

    Raises
    ------
    ValueError
        On bits other than 8/16, a kind other than "static", or an allocation that does not
        match ``layers`` or comes with ``coefficient_bits=8``.
    TypeError
        If ``allocation`` is not an :class:`~subspace_ref.allocation.Allocation`.

    Examples
    --------
    ::

        import torch
        from subspace_ref.hf import CalibratedBases, capture, compress
        from subspace_ref.models.default_model import load_model

        model, config = load_model("default")
        ids = torch.tensor([list(b"def read_config(path):\\n    return json.load(open(path))\\n")])
        bases = CalibratedBases.for_model(model, capture(model, ids).calibrate(rank_k=16, rank_v=16))
        bases.save_pretrained("bases/")
        bases = CalibratedBases.from_pretrained("bases/", config)   # refuses another architecture
        with compress(model, bases) as kv:
            out = kv.generate(ids, max_new_tokens=8, do_sample=False)
    """

    layers: tuple[StaticBasis | None, ...]
    config_hash: str
    coefficient_bits: int = 16
    basis_format: str = "float16"
    kind: str = "static"
    allocation: Any = None
    calibration: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.coefficient_bits not in (8, 16):
            raise ValueError(f"coefficient_bits must be 8 or 16, got {self.coefficient_bits!r}")
        if self.kind != "static":
            raise ValueError(f'kind: only "static" bases are artifacts, got {self.kind!r}')
        if self.allocation is not None:
            from subspace_ref.allocation import Allocation

            if not isinstance(self.allocation, Allocation):
                raise TypeError(f"allocation must be an Allocation or None, got {type(self.allocation).__name__}")
            if self.coefficient_bits != 16:
                raise ValueError(f"coefficient_bits: an allocation sets each head's bits; leave coefficient_bits at 16, got {self.coefficient_bits}")
            if len(self.layers) != self.allocation.layers or any(b is None for b in self.layers):
                raise ValueError(f"layers: an allocation of {self.allocation.layers} layers needs a StaticBasis for each, got {len(self.layers)} entries")

    @classmethod
    def for_model(cls, model_or_config, layers, **kwargs: Any) -> "CalibratedBases":
        """Bases for ``model_or_config``, its :func:`config_hash` computed.

        Parameters
        ----------
        model_or_config : transformers.PreTrainedModel or PretrainedConfig
            The model the bases were calibrated on.
        layers : iterable of StaticBasis or None
            One per layer (e.g. :meth:`ModelCapture.calibrate`'s list).
        **kwargs
            The other fields (``coefficient_bits``, ``basis_format``, ``allocation``,
            ``calibration``).

        Returns
        -------
        CalibratedBases
            See the class's example.
        """
        config = getattr(model_or_config, "config", model_or_config)
        return cls(tuple(layers), config_hash(config), **kwargs)

    @property
    def coefficients(self) -> str:
        """The ``coefficients`` argument of :class:`~subspace_ref.hf.static_states`."""
        return "int8" if self.coefficient_bits == 8 else "float"

    def states(self, config=None, **kwargs: Any):
        """The state factory of these bases (keywords override its options).

        Parameters
        ----------
        config : transformers.PretrainedConfig or model, optional
            The model's config; required when an allocation has pre-RoPE heads (their RoPE).
        **kwargs
            Options of the factory (e.g. ``window``, ``dtype``).

        Returns
        -------
        allocated_states or static_states
            With an allocation, :class:`~subspace_ref.hf.allocated_states`; else
            :class:`~subspace_ref.hf.static_states` with ``coefficient_bits``.

        Raises
        ------
        ValueError
            If pre-RoPE heads come without ``config`` (or a ``rope`` keyword).
        """
        if self.allocation is not None:
            from subspace_ref.hf.allocated_states import allocated_states
            from subspace_ref.rope import RopeParams

            pre_rope = any(h.key_basis == "pre_rope" for layer in self.allocation.heads for h in layer)
            if pre_rope and config is None and "rope" not in kwargs:
                raise ValueError("config: these bases have pre-RoPE heads; give the model's config (compress(model, bases) does) to rotate them")
            rope = RopeParams.from_config(getattr(config, "config", config)) if pre_rope and config is not None else None
            return allocated_states(list(self.layers), self.allocation, **(dict(rope=rope, basis_format=self.basis_format) | kwargs))
        from subspace_ref.hf.state_factories import static_states

        options = dict(coefficients=self.coefficients, basis_format=self.basis_format) | kwargs
        return static_states(list(self.layers), **options)

    def metadata(self) -> dict:
        """The JSON :meth:`save_pretrained` writes beside the tensors (ranks, γ, hash, facts)."""
        return dict(
            format_version=FORMAT_VERSION,
            kind=self.kind,
            config_hash=self.config_hash,
            coefficient_bits=self.coefficient_bits,
            basis_format=self.basis_format,
            calibration=self.calibration,
            allocation=None if self.allocation is None else self.allocation.to_dict(),
            layers=[None if b is None else dict(rank_k=list(b.rank_k), rank_v=list(b.rank_v), gamma=[float(g) for g in b.gamma]) for b in self.layers],
        )

    def save_pretrained(self, directory) -> Path:
        """Write the two files into ``directory`` (created if needed).

        Parameters
        ----------
        directory : str or os.PathLike
            Where ``subspace_bases.safetensors`` and ``subspace_bases.json`` go.

        Returns
        -------
        pathlib.Path
            ``directory``. Example: the class's.
        """
        from safetensors.numpy import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for i, b in enumerate(self.layers):
            if b is not None:
                tensors |= {f"layers.{i}.{name}": np.ascontiguousarray(getattr(b, name)) for name in ("B", "E", "gamma")}
        save_file(tensors, str(out / TENSORS))
        (out / METADATA).write_text(json.dumps(self.metadata(), indent=1, sort_keys=True) + "\n")
        return out

    @classmethod
    def from_pretrained(cls, directory, config=None) -> "CalibratedBases":
        """Read what :meth:`save_pretrained` wrote.

        Parameters
        ----------
        directory : str or os.PathLike
            A directory :meth:`save_pretrained` wrote.
        config : transformers.PretrainedConfig or model, optional
            When given, the bases must have been calibrated for the same architecture.

        Returns
        -------
        CalibratedBases
            Example: the class's.

        Raises
        ------
        FileNotFoundError
            If a file is missing.
        ValueError
            On another format version, or a config hash other than ``config``'s (both named).
        """
        from safetensors.numpy import load_file

        src = Path(directory)
        for name in (TENSORS, METADATA):
            if not (src / name).is_file():
                raise FileNotFoundError(f"directory {str(src)!r} holds no {name} (write it with CalibratedBases.save_pretrained)")
        meta = json.loads((src / METADATA).read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{src / METADATA}: format_version {meta.get('format_version')!r}, this library reads {FORMAT_VERSION}")
        if config is not None:
            expected = config_hash(getattr(config, "config", config))
            if expected != meta["config_hash"]:
                raise ValueError(f"config: these bases were calibrated for config hash {meta['config_hash'][:12]}, the model given has {expected[:12]}")
        tensors = load_file(str(src / TENSORS))
        layers = []
        for i, entry in enumerate(meta["layers"]):
            if entry is None:
                layers.append(None)
                continue
            basis = StaticBasis(
                B=tensors[f"layers.{i}.B"],
                E=tensors[f"layers.{i}.E"],
                gamma=tensors[f"layers.{i}.gamma"],
                rank_k=tuple(entry["rank_k"]),
                rank_v=tuple(entry["rank_v"]),
            )
            layers.append(basis)
        allocation = meta.get("allocation")
        if allocation is not None:
            from subspace_ref.allocation import Allocation

            allocation = Allocation.from_dict(allocation)
        return cls(
            tuple(layers),
            meta["config_hash"],
            coefficient_bits=meta["coefficient_bits"],
            basis_format=meta["basis_format"],
            kind=meta["kind"],
            allocation=allocation,
            calibration=meta.get("calibration") or {},
        )


__all__ = ["CalibratedBases", "config_hash"]
