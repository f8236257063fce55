"""``SubspaceCache``: a transformers ``Cache`` whose layers hold :class:`~subspace_ref.SubspaceState` s
(:class:`~subspace_ref.hf.SubspaceLayer`) or :class:`~subspace_ref.LayerState` s (grouped layers).

Usage::

    from subspace_ref.hf import SubspaceCache, static_states, use_subspace_attention

    use_subspace_attention(model)                       # once per model (see attention.py)
    cache = SubspaceCache(model.config, static_states(bases), backend="torch")
    out = model.generate(ids, cache=cache, max_new_tokens=32, do_sample=False)

Each layer's state is built on the layer's first ``update`` by a *state factory*
(:mod:`subspace_ref.hf.state_factories`), or given ready-made as one state per layer. The cache
stores only what the state stores (coefficients, bases, sketches): ``update`` hands the new
post-RoPE keys and values to the attention function, which appends them to the state and
computes attention from it (spec/models.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache

from subspace_ref.capabilities import require, state_reasons
from subspace_ref.hf import attention as _attn
from subspace_ref.hf.cache_layer import SubspaceLayer
from subspace_ref.hf.grouped_layer import GroupedLayer
from subspace_ref.hf.state_factories import StateFactory, StateSpec
from subspace_ref.hf_requirements import require_cache_api
from subspace_ref.layer_state import HeadGroup, LayerState
from subspace_ref.registry import get_backend
from subspace_ref.state import SubspaceState


class SubspaceCache(Cache):
    """A transformers ``Cache`` whose layers each hold a :class:`SubspaceState` (spec/models.md).

    ``config``: the model's config (its layers and their types; and the cache checks that the
    model selected the subspace attention, see :func:`~subspace_ref.hf.use_subspace_attention`).
    ``states``: a state factory (``factory(StateSpec) -> SubspaceState``, called on a layer's
    first update) or one ready state per layer. ``backend``: the registered backend
    ``subspace_ref.attend`` uses; states are converted to its array family (``state.to(...)``)
    on the keys' device, and on a torch-family backend to the model's dtype when the model
    computes in float16/bfloat16 (the backend accumulates in float32). ``prefill``:
    ``"coefficient"`` (vectorised causal coefficient-space attention, default) or ``"attend"``
    (one ``subspace_ref.attend`` call per prompt position; slow, for cross-checks).
    ``sliding``: the layers a config marks as sliding-window (Mistral, Gemma2): ``"stock"``
    keeps transformers' own sliding cache layer for them (only full-attention layers are
    compressed), ``"compress"`` compresses them too (the model's sliding mask then restricts
    each query to its window in coefficient space; the compressed tokens stay stored).
    ``max_crop_block``: windowed, adaptive and rotating layers keep a restore point at the start
    of each forward (a failed forward goes back to it) and, for forwards of at most this many
    tokens, the forward's keys and values, so ``crop`` (assisted and prompt-lookup decoding) can
    take back that forward's tokens exactly (:meth:`SubspaceLayer.crop`).

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config.
    states : StateFactory or sequence of SubspaceState / LayerState
        A factory (e.g. :class:`~subspace_ref.hf.static_states`) or one empty batched state
        per layer.
    backend : str
        A registered backend name ("torch", "numpy", "triton", ...).
    prefill : str
        "coefficient" or "attend".
    sliding : str
        "stock" or "compress".
    max_crop_block : int
        Longest forward whose tokens ``crop`` can take back from non-static layers.

    Raises
    ------
    ImportError
        On a transformers older than :data:`~subspace_ref.hf_requirements.MIN_TRANSFORMERS`
        (both versions named).
    ValueError
        On a bad option, an unknown backend, or a state count other than the layer count.
    RuntimeError
        If the backend is not available on this machine; at the first ``update``, if the
        model has not selected the subspace attention.

    Examples
    --------
    ::

        import torch
        from subspace_ref.hf import SubspaceCache, capture, static_states
        from subspace_ref.models.default_model import load_model

        model, config = load_model("default")
        ids = torch.tensor([list(b"def read_config(path):\\n    return json.load(open(path))\\n")])
        bases = capture(model, ids).calibrate(rank_k=16, rank_v=16)
        cache = SubspaceCache.for_model(model, static_states(bases), backend="torch")
        out = model.generate(ids, cache=cache, max_new_tokens=8, do_sample=False)
        cache.get_seq_length(), cache.nbytes, cache.full_cache_nbytes
    """

    def __init__(
        self,
        config,
        states: StateFactory | Sequence[SubspaceState],
        *,
        backend: str = "torch",
        prefill: str = "coefficient",
        sliding: str = "stock",
        max_crop_block: int = 64,
    ):
        require_cache_api(type(self).__name__)
        from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, get_layer_types_and_kwargs

        if prefill not in ("coefficient", "attend"):
            raise ValueError(f'prefill must be "coefficient" or "attend", got {prefill!r}')
        if sliding not in ("stock", "compress"):
            raise ValueError(f'sliding must be "stock" or "compress", got {sliding!r}')
        self.config = config
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        num_layers = text.num_hidden_layers
        if callable(states):
            self.factory, given = states, [None] * num_layers
        else:
            given = list(states)
            if len(given) != num_layers:
                raise ValueError(f"{len(given)} states given for a model of {num_layers} layers")
            self.factory = None
        impl = get_backend(backend)  # ValueError naming the registered backends
        available = impl.availability()
        if not available:
            raise RuntimeError(f"backend {backend!r} is not available on this machine: {available.reason}")
        self.backend = backend
        self.family = impl.array_family
        self.prefill = prefill
        self.sliding = sliding
        if isinstance(max_crop_block, bool) or not isinstance(max_crop_block, int) or max_crop_block < 0:
            raise ValueError(f"max_crop_block must be an int >= 0, got {max_crop_block!r}")
        self.max_crop_block = max_crop_block
        compressed = ("full_attention", "sliding_attention") if sliding == "compress" else ("full_attention",)
        types, kwargs = get_layer_types_and_kwargs(text)
        layers = [
            SubspaceLayer(self, i, given[i]) if kind in compressed else DYNAMIC_LAYER_TYPE_MAPPING[kind](**kw)
            for i, (kind, kw) in enumerate(zip(types, kwargs))
        ]
        super().__init__(layers=layers)
        self._state_layers: list | None = None  # state_layers, made once per set of layers (set_layer)

    @classmethod
    def for_model(cls, model, states: StateFactory | Sequence[SubspaceState], **kwargs: Any) -> "SubspaceCache":
        """Select the subspace attention implementation for ``model`` and return a cache for it.

        The selection stays after the cache is gone; :func:`~subspace_ref.hf.compress` limits it
        to a block.

        Parameters
        ----------
        model : transformers.PreTrainedModel
            The model (its config is the cache's).
        states : StateFactory or sequence of states
            As in the class.
        **kwargs
            The class's keywords.

        Returns
        -------
        SubspaceCache
            Example: the class's.
        """
        cache = cls(model.config, states, **kwargs)  # a refused cache leaves the model as it was
        _attn.use_subspace_attention(model)
        return cache

    def check_model_attention(self) -> None:
        """Raise RuntimeError unless the model selected the subspace attention: any other
        implementation would attend only the new tokens (each layer's ``update`` calls this)."""
        impl = getattr(self.config, "_attn_implementation", _attn.ATTN_IMPLEMENTATION)
        if not _attn.is_subspace(impl):
            raise RuntimeError(
                f"the model uses attn_implementation={impl!r}, which would attend only the new tokens of a SubspaceCache; "
                "open subspace_ref.hf.compress(model, ...) or call subspace_ref.hf.use_subspace_attention(model) first"
            )

    @property
    def subspace_layers(self) -> list:
        """The compressed layers: :class:`SubspaceLayer` s and grouped layers of :class:`LayerState` s."""
        return [layer for layer in self.layers if isinstance(layer, (SubspaceLayer, GroupedLayer))]

    @property
    def state_layers(self) -> list[SubspaceLayer]:
        """The layers that hold one state each: the :class:`SubspaceLayer` s, a grouped layer's
        children in its place; what a forward's restore points and rollback act on."""
        if self._state_layers is None:  # each layer's update asks (begin_forward); set_layer forgets it
            self._state_layers = [c for layer in self.subspace_layers for c in (layer.children if isinstance(layer, GroupedLayer) else [layer])]
        return list(self._state_layers)

    def set_layer(self, layer_idx: int, layer) -> None:
        """Put ``layer`` in place of layer ``layer_idx`` (a layer built on its first update, or reset)."""
        self.layers[layer_idx] = layer
        self._state_layers = None

    def begin_forward(self, layer_idx: int) -> None:
        """Called by each layer's update: the first compressed layer's update starts a forward,
        whose tokens :meth:`rollback_forward` can give back; it first checks that the model
        attends through the cache (:meth:`check_model_attention`), once per forward."""
        layers = self._state_layers if self._state_layers is not None else self.state_layers
        if layers and layers[0].layer_idx == layer_idx:
            self.check_model_attention()
            for layer in layers:
                layer.keep_restore_point()

    def rollback_forward(self) -> None:
        """Give back the tokens the current forward appended (static states by truncation, the
        others through their restore point when the forward kept one)."""
        for layer in self.subspace_layers:
            layer._clear_pending()
        for layer in self.state_layers:
            if layer.state is None:
                continue
            if layer.truncate_reason() is None:
                layer.truncate(layer._forward_start)
            elif layer._restore_point is not None:
                layer.restore()

    def grouped_layer(self, layer_idx: int, layer: LayerState, dtype: torch.dtype, device: torch.device) -> GroupedLayer:
        """The cache layer of an adopted :class:`LayerState` (what a layer whose factory gives one becomes)."""
        return GroupedLayer(self, layer_idx, layer, dtype, device)

    def adopt(self, state: SubspaceState | LayerState, spec: StateSpec) -> SubspaceState | LayerState:
        """``state`` checked against the layer's shapes and moved to the backend's array family,
        the keys' device and (torch family, half-precision model) the model's dtype; ValueError
        with the backend's reasons if it refuses the state. A :class:`LayerState` group by group."""
        if isinstance(state, LayerState):
            if state.kv_heads != spec.heads:
                raise ValueError(f"layer {spec.layer_idx}: layer state {state!r} has {state.kv_heads} KV heads, the model {spec.heads}")
            groups = [HeadGroup(g.heads, self.adopt(g.state, replace(spec, heads=len(g.heads))), g.key_identity, g.value_identity) for g in state.groups]
            return LayerState(state.kv_heads, groups)
        if state.batch != spec.batch or state.kv_heads != spec.heads or state.d != spec.head_dim or state.d_v != spec.value_dim:
            raise ValueError(
                f"layer {spec.layer_idx}: state {state!r} (batch {state.batch}) does not fit the model's "
                f"batch {spec.batch}, {spec.heads} KV heads of size {spec.head_dim}/{spec.value_dim}"
            )
        if not state.batched:
            raise ValueError(f"layer {spec.layer_idx}: the cache needs batched states (built with batch=N); the factories here do so")
        if state.num_tokens:
            raise ValueError(f"layer {spec.layer_idx}: the state already holds {state.num_tokens} tokens; give empty states")
        held_family = "numpy" if isinstance(state.layout.key_coef, np.ndarray) else type(state.layout.key_coef).__module__.split(".")[0]
        half = self.family == "torch" and spec.dtype in (torch.float16, torch.bfloat16) and str(state.dtype).endswith("float32")
        if half or held_family != self.family or state.engine != self.backend or (self.family == "torch" and state.layout.key_coef.device != spec.device):
            # appends then run on the chosen backend itself (e.g. triton's projection kernel)
            state = state.to(self.backend, device=spec.device if self.family == "torch" else None, dtype=spec.dtype if half else None)
        require(state_reasons(self.backend, get_backend(self.backend), state), f"layer {spec.layer_idx}: backend {self.backend!r} refuses this state")
        return state

    # -- facts
    @property
    def states(self) -> list[SubspaceState | LayerState | None]:
        """Per layer, the state it holds (None for a layer kept stock or not yet built)."""
        compressed = self.subspace_layers
        return [layer.state if any(layer is c for c in compressed) else None for layer in self.layers]

    @property
    def nbytes(self) -> int:
        """Bytes the cache really holds: the states' (coefficients, bases in use, sketches) plus
        the keys and values of layers kept stock (sliding windows)."""
        compressed = self.subspace_layers
        held = sum(s.nbytes for s in self.states if s is not None)
        return held + sum(_stock_nbytes(layer) for layer in self.layers if not any(layer is c for c in compressed))

    @property
    def full_cache_nbytes(self) -> int:
        """Bytes the stock ``DynamicCache`` takes for the same tokens in the model's dtype (for a
        bfloat16 model, 2 bytes per key and value entry): every ratio is against this."""
        total = 0
        compressed = self.subspace_layers
        for layer in self.layers:
            if not any(layer is c for c in compressed):
                total += _stock_nbytes(layer)
            elif layer.state is not None:
                st = layer.state
                total += st.batch * st.kv_heads * st.num_tokens * (st.d + st.d_v) * layer.dtype.itemsize
        return total


def _stock_nbytes(layer) -> int:
    return sum(x.nbytes for x in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(x, torch.Tensor))


__all__ = ["SubspaceCache"]
