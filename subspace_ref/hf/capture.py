"""Record the post-RoPE keys, values and queries of every layer and head from a model run.

:func:`capture` runs the model (stock attention: the subspace attention implementation without
a subspace cache is transformers' sdpa) and records, through :func:`subspace_ref.hf.attention.observe`,
the tensors the attention function receives: exactly what a cache's ``update`` receives, i.e.
keys and queries *after* RoPE for Llama and GPT-NeoX, and for GPT-2 (no RoPE) the split of
``c_attn``. Grouped-query models give H KV heads of keys/values and H_q = g H query heads.

``rope=False`` additionally undoes the rotation (for the "RoPE on/off" spectra of seed 001 §11
and the pre- vs post-RoPE basis ablation of seed 003): the cos/sin the model's rotary module
produced are recorded by a forward hook on that module (this model instance only) and each key
and query is rotated back, ``x = x_rot cos - rotate_half(x_rot) sin`` on the rotary dimensions.
The model itself still runs with RoPE, so later layers see the real hidden states.

:class:`ModelCapture` feeds :func:`subspace_ref.calibrate` (static bases per layer) and gives the
per-head singular values for spectra.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import torch

from subspace_ref.calibration import StaticBasis, calibrate
from subspace_ref.hf.attention import observe, subspace_attention_enabled
from subspace_ref.hf.teacher_forced import as_batch


@dataclass
class LayerCapture:
    """One layer's recorded vectors, tokens of all sequences concatenated in order:
    ``keys`` (H, N, d), ``values`` (H, N, d_v), ``queries`` (H_q, N, d) or None.

    Parameters
    ----------
    keys, values : numpy.ndarray
        (H, N, d) and (H, N, d_v).
    queries : numpy.ndarray or None
        (H_q, N, d), when recorded.

    Examples
    --------
    See :func:`capture`.
    """

    keys: np.ndarray
    values: np.ndarray
    queries: np.ndarray | None

    @property
    def heads(self) -> int:
        """KV heads H."""
        return self.keys.shape[0]

    @property
    def query_heads(self) -> int:
        """Query heads H_q (0 when queries were not recorded)."""
        return 0 if self.queries is None else self.queries.shape[0]


@dataclass
class ModelCapture:
    """Per-layer captures of a model run; ``rope`` tells whether keys/queries are post-RoPE.

    Parameters
    ----------
    layers : list of LayerCapture
        One per layer, in layer order.
    rope : bool
        True: post-RoPE keys/queries; False: RoPE undone.
    sequences : int
        How many sequences were run.
    meta : dict
        Facts (``model_type``).

    Examples
    --------
    See :func:`capture`.
    """

    layers: list[LayerCapture]
    rope: bool = True
    sequences: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Tokens recorded per layer."""
        return self.layers[0].keys.shape[1] if self.layers else 0

    def calibrate(self, *, rank_k: Any = None, rank_v: Any = None, energy: Any = None, gamma: Any = "unit") -> list[StaticBasis]:
        """One :class:`StaticBasis` per layer (spec A5) via :func:`subspace_ref.calibrate`.

        ``rank_k``/``rank_v``/``energy``/``gamma`` are one value for all layers or a list with
        one per layer. ``gamma="mse"`` fits the logits with the recorded queries.

        Parameters
        ----------
        rank_k, rank_v : int, tuple or list, optional
            Key/value ranks (an int, a per-head tuple, or a list with one per layer).
        energy : float or list, optional
            Energy fraction picking the ranks when they are not given.
        gamma : str, float or list
            "unit", "mse" (needs recorded queries) or a value.

        Returns
        -------
        list of StaticBasis
            One per layer; :class:`~subspace_ref.hf.static_states` takes it.
        """

        def at(value, i):
            return value[i] if isinstance(value, (list, tuple)) and not isinstance(value, str) and len(value) == len(self.layers) else value

        out = []
        for i, layer in enumerate(self.layers):
            g = at(gamma, i)
            queries = layer.queries if isinstance(g, str) and g == "mse" else None
            out.append(calibrate(layer.keys, layer.values, rank_k=at(rank_k, i), rank_v=at(rank_v, i), energy=at(energy, i), queries=queries, gamma=g))
        return out

    def spectra(self) -> list[dict[str, np.ndarray]]:
        """Per layer: {"keys": (H, min(N, d)), "values": (H, min(N, d_v))} singular values,
        uncentred (spec A5: attention uses raw keys), largest first.

        Returns
        -------
        list of dict of str to numpy.ndarray
            One dict per layer.
        """
        return [
            {
                "keys": np.linalg.svd(layer.keys, compute_uv=False),
                "values": np.linalg.svd(layer.values, compute_uv=False),
            }
            for layer in self.layers
        ]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of transformers' ``apply_rotary_pos_emb`` (rotate_half convention, possibly
    partial: the first cos.shape[-1] dimensions rotate) for x (B, H, n, d), cos/sin (B, n, r).

    Each plane is multiplied by [[c, -s], [s, c]]; its inverse is [[c, s], [-s, c]] / (c^2 + s^2).
    The division matters: the model computes cos/sin in float32 (c^2 + s^2 = 1 only to ~6e-8)
    and some RoPE types scale both by an attention factor."""
    r = cos.shape[-1]
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat(((rot * cos - _rotate_half(rot) * sin) / (cos * cos + sin * sin), rest), dim=-1)


def _rotary_modules(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]


@torch.no_grad()
def capture(
    model,
    sequences: Iterable[Any] | Any,
    *,
    dtype: Any = np.float64,
    queries: bool = True,
    rope: bool = True,
    max_tokens: int | None = None,
) -> ModelCapture:
    """Run ``model`` on each sequence of token ids ((T,) or (B, T) each, or one (B, T) tensor)
    and record every layer's keys, values and (``queries=True``) queries as NumPy ``dtype``.

    ``rope=False`` records them with RoPE undone (see the module docstring; GPT-2 has no RoPE,
    so both are the same). ``max_tokens`` stops recording once that many tokens are held.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Run in eval mode, without a cache; its attention implementation is restored after.
    sequences : tensor, array or iterable of them
        Token ids.
    dtype : numpy dtype
        Of the recorded arrays.
    queries : bool
        Record queries too (needed for ``gamma="mse"``).
    rope : bool
        False: undo RoPE on keys and queries.
    max_tokens : int, optional
        Stop once this many tokens are recorded (the arrays are cut to it).

    Returns
    -------
    ModelCapture
        One :class:`LayerCapture` per layer.

    Raises
    ------
    ValueError
        With ``rope=False``, if the model has no single rotary embedding module (GPT-2 aside).

    Examples
    --------
    ::

        import torch
        from subspace_ref.hf import capture
        from subspace_ref.models.default_model import load_model

        model, config = load_model("default")
        ids = torch.tensor([list(b"def read_config(path):\\n    return json.load(open(path))\\n")])
        cap = capture(model, ids)
        cap.num_tokens, cap.layers[0].keys.shape     # 56, (2, 56, 64)
        bases = cap.calibrate(rank_k=16, rank_v=16)  # one StaticBasis per layer
        cap.spectra()[0]["keys"].shape               # (2, 56)
    """
    model.eval()
    if isinstance(sequences, torch.Tensor) and sequences.ndim == 2 or isinstance(sequences, np.ndarray) and sequences.ndim == 2:
        sequences = [sequences]
    elif isinstance(sequences, torch.Tensor) and sequences.ndim == 1:
        sequences = [sequences]
    device = next(model.parameters()).device
    rec: dict[int, dict[str, list[np.ndarray]]] = {}
    rotary: dict[str, torch.Tensor] = {}
    hooks = []
    if not rope:
        mods = _rotary_modules(model)
        if not mods and getattr(model.config, "model_type", "") not in ("gpt2",):
            raise ValueError(f"rope=False: no rotary embedding module found in {type(model).__name__}")
        if len(mods) > 1:
            raise ValueError(f"rope=False: {len(mods)} rotary embedding modules in {type(model).__name__}; only one is supported")
        for m in mods:
            hooks.append(m.register_forward_hook(lambda _m, _i, out: rotary.update(cos=out[0], sin=out[1])))

    def to_np(x: torch.Tensor) -> np.ndarray:  # (B, H, n, d) -> (H, B n, d)
        x = x.detach().to(torch.float64 if np.dtype(dtype) == np.float64 else torch.float32)
        return x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3]).cpu().numpy()

    def record(module, q, k, v):
        idx = module.layer_idx
        if not rope and rotary:
            q, k = _unrotate(q, rotary["cos"], rotary["sin"]), _unrotate(k, rotary["cos"], rotary["sin"])
        slot = rec.setdefault(idx, {"keys": [], "values": [], "queries": []})
        slot["keys"].append(to_np(k))
        slot["values"].append(to_np(v))
        if queries:
            slot["queries"].append(to_np(q))

    count = 0
    try:
        with subspace_attention_enabled(model), observe(model, record):
            for seq in sequences:
                ids = as_batch(seq, device)
                model(input_ids=ids, use_cache=False)
                count += 1
                if max_tokens is not None and rec and sum(x.shape[1] for x in rec[min(rec)]["keys"]) >= max_tokens:
                    break
    finally:
        for h in hooks:
            h.remove()
    layers = []
    for idx in sorted(rec):
        slot = rec[idx]
        cut = slice(None, max_tokens)
        layers.append(
            LayerCapture(
                keys=np.concatenate(slot["keys"], axis=1)[:, cut],
                values=np.concatenate(slot["values"], axis=1)[:, cut],
                queries=np.concatenate(slot["queries"], axis=1)[:, cut] if queries else None,
            )
        )
    return ModelCapture(layers, rope=rope, sequences=count, meta={"model_type": getattr(model.config, "model_type", None)})


__all__ = ["LayerCapture", "ModelCapture", "capture"]
