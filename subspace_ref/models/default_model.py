"""Load the project's default model, or any local transformers causal LM.

The default model is a 4-layer byte-level Llama (hidden 256, 4 query heads and 2 KV heads of
size 64, RoPE, context 1024) trained from scratch on the Python standard library by
:mod:`subspace_ref.lab.train_default_model`. Its weights (float32 safetensors), config and
training report ship inside the package under ``subspace_ref/data/stdlib_llama`` and are read
through :mod:`importlib.resources`, so loading never touches the network.

Token ids are byte values: encode text with :func:`encode` (UTF-8 bytes) and decode with
:func:`decode`.

This module imports torch and transformers (the ``models`` extra); :mod:`subspace_ref` itself
never imports it.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

import torch

DEFAULT_MODEL_NAME = "stdlib_llama"
#: Names that :func:`load_model` maps to the shipped default model.
DEFAULT_ALIASES = frozenset({"default", DEFAULT_MODEL_NAME, f"subspace_ref/{DEFAULT_MODEL_NAME}"})
FILES = ("model.safetensors", "config.json", "training_report.json")


class ModelNotFoundError(FileNotFoundError):
    """A model is neither a local directory nor in the local Hugging Face cache."""


def default_model_dir():
    """The shipped model directory as an :mod:`importlib.resources` Traversable."""
    try:
        root = resources.files("subspace_ref")
    except (ModuleNotFoundError, TypeError):  # pragma: no cover - unusual installs
        root = Path(__file__).resolve().parent.parent
    return root.joinpath("data", DEFAULT_MODEL_NAME)


def default_model_files() -> dict[str, Any]:
    """``{file name: Traversable}`` for the shipped files (they may not all exist)."""
    d = default_model_dir()
    return {name: d.joinpath(name) for name in FILES}


def load_training_report() -> dict:
    """The shipped ``training_report.json`` (corpus stats, schedule, losses, n-gram baseline)."""
    return json.loads(default_model_files()["training_report.json"].read_text(encoding="utf-8"))


def load_default_config():
    """The shipped :class:`transformers.LlamaConfig`."""
    from transformers import LlamaConfig

    return LlamaConfig.from_dict(json.loads(default_model_files()["config.json"].read_text(encoding="utf-8")))


def load_default_model(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
):
    """Return ``(model, config)``: the shipped default model in eval mode (float32 by default).

    ``attn_implementation`` (``"eager"``, ``"sdpa"``) is passed to the config; ``"eager"`` is
    the one that can return attention weights.
    """
    from safetensors.torch import load as load_safetensors
    from transformers import LlamaForCausalLM

    config = load_default_config()
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    files = default_model_files()
    state = load_safetensors(files["model.safetensors"].read_bytes())
    model = LlamaForCausalLM(config)  # ~3M parameters: the throw-away init is cheap
    model.load_state_dict(state, strict=True)
    model = model.to(device=device, dtype=dtype)
    model.eval()
    return model, model.config


def _looks_like_path(name: str) -> bool:
    return (
        name.startswith((".", "/", "~"))
        or os.sep in name
        or (os.altsep is not None and os.altsep in name)
        or name.count("/") > 1
        or os.path.isabs(name)
    )


def load_model(
    name_or_path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **kwargs: Any,
):
    """Return ``(model, config)`` for a causal LM, in eval mode, without using the network.

    ``name_or_path`` is ``"default"`` / ``"stdlib_llama"`` (the shipped model), a local
    directory holding a transformers checkpoint, or a Hugging Face model id already in the
    local cache (``local_files_only=True``). Anything else raises :class:`ModelNotFoundError`
    with the message ``model X not found locally: ... pass a local path or pre-download it``.
    Extra keyword arguments go to ``AutoModelForCausalLM.from_pretrained``.
    """
    name = os.fspath(name_or_path)
    if name in DEFAULT_ALIASES:
        return load_default_model(dtype=dtype, device=device, attn_implementation=kwargs.get("attn_implementation"))

    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelNotFoundError(
                f"model {name!r} not found locally: {path} is a file, not a checkpoint directory; "
                "pass a local path or pre-download it"
            )
        source = str(path)
    elif _looks_like_path(name):
        raise ModelNotFoundError(
            f"model {name!r} not found locally: no such directory {path}; pass a local path or pre-download it"
        )
    else:
        source = name

    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(source, local_files_only=True, dtype=dtype, **kwargs)
    except (OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelNotFoundError(
            f"model {name!r} not found locally: {reason}; pass a local path or pre-download it "
            "(e.g. huggingface-cli download on a machine with network access)"
        ) from None
    model = model.to(device)
    model.eval()
    return model, model.config


def encode(text: str | bytes) -> torch.Tensor:
    """Token ids (byte values) of ``text`` (UTF-8) as a 1-D ``torch.long`` tensor."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return torch.tensor(list(data), dtype=torch.long)


def decode(ids) -> str:
    """Text of byte token ids (invalid UTF-8 replaced)."""
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
