"""``with subspace_ref.hf.compress(model, bases) as kv: ...``: the subspace attention for one
model inside a block, caches made for it (spec/models.md M4).

Inside the block the model's attention implementation is the subspace one (falling back to
the model's own "sdpa" or "eager" for anything a :class:`SubspaceCache` does not hold, so a
``DynamicCache`` or no cache behaves as before); on exit the previous implementation is back.
Nothing else in the process changes: other models, other caches and threads are unaffected.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from subspace_ref.capabilities import require
from subspace_ref.hf.artifact import CalibratedBases
from subspace_ref.hf.attention import subspace_attention_enabled
from subspace_ref.hf.cache import SubspaceCache
from subspace_ref.hf.graph_cache import GraphSubspaceCache, graph_refusals
from subspace_ref.hf.state_factories import StateFactory, StateSpec, static_states


class Compressed:
    """What :func:`compress` yields: ``cache()`` makes a fresh :class:`SubspaceCache` for the
    model (pass it as ``cache``), one per generation.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model the block compresses.
    factory : StateFactory
        The state factory of its caches.
    cache_options : dict
        Keywords of :class:`SubspaceCache` (``backend``, ``prefill``, ``sliding``, ...).

    Examples
    --------
    See :func:`compress`.
    """

    def __init__(self, model, factory: StateFactory, cache_options: dict, graph: bool | str = "auto"):
        self.model = model
        self.factory = factory
        self.cache_options = cache_options
        self.graph = graph

    def cache(self, **overrides: Any) -> SubspaceCache:
        """A fresh, empty :class:`SubspaceCache` for the model.

        Parameters
        ----------
        **overrides
            :class:`SubspaceCache` keywords replacing the block's ``cache_options``.

        Returns
        -------
        SubspaceCache
            Pass it as ``cache=`` to ``model.generate`` or ``model(...)``; one per generation.
        """
        return SubspaceCache(self.model.config, self.factory, **(self.cache_options | overrides))

    def graph_cache(self, max_cache_len: int) -> GraphSubspaceCache:
        """A fresh :class:`GraphSubspaceCache` of ``max_cache_len`` tokens for the model: the
        cache ``torch.compile`` traces whole (spec/models.md M11)."""
        return GraphSubspaceCache(self.model.config, self.factory, max_cache_len=max_cache_len)

    def uses_graph(self, device=None) -> bool:
        """Whether :meth:`generate` decodes through a :class:`GraphSubspaceCache`: ``graph=True``,
        or ``"auto"`` on a CUDA ``device`` (default: the model's) when every layer's state
        passes :func:`graph_refusals` and no cache option asks for the SubspaceCache."""
        if self.graph != "auto":
            return bool(self.graph)
        device = torch.device(device if device is not None else self.model.device)
        return device.type == "cuda" and not self.cache_options and not model_graph_refusals(self.model, self.factory)

    def generate(self, *args: Any, **kwargs: Any):
        """``model.generate`` with a fresh cache (unless ``cache`` is given): a
        :class:`GraphSubspaceCache` of prompt + ``max_new_tokens`` tokens when :meth:`uses_graph`
        (transformers then compiles the decode step, with CUDA graphs on CUDA), else
        :meth:`cache`.

        Parameters
        ----------
        *args, **kwargs
            Those of ``model.generate``.

        Returns
        -------
        torch.Tensor or transformers.GenerateOutput
            What ``model.generate`` returns.
        """
        if "cache" not in kwargs:
            ids = args[0] if args else kwargs.get("input_ids")
            if self.uses_graph() and ids is not None:
                new = kwargs.get("max_new_tokens")
                capacity = ids.shape[-1] + new if new is not None else kwargs.get("max_length", self.model.generation_config.max_length)
                kwargs["cache"] = self.graph_cache(int(capacity))
            else:
                kwargs["cache"] = self.cache()
        return self.model.generate(*args, **kwargs)


def model_graph_refusals(model, factory: StateFactory) -> list[str]:
    """:func:`graph_refusals` of the state ``factory`` gives each full-attention layer of
    ``model`` (batch 1, the model's dtype and device), each reason prefixed with its layer."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = model.config.get_text_config(decoder=True)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    types, _ = get_layer_types_and_kwargs(text)
    reasons = []
    if getattr(text, "attn_logit_softcapping", None):  # Gemma2: its attention call passes softcap, which SDPA does not apply
        reasons.append(f"the model's attention soft-capping (attn_logit_softcapping = {text.attn_logit_softcapping})")
    for i, kind in enumerate(types):
        if kind == "full_attention":
            state = factory(StateSpec(i, 1, heads, head_dim, head_dim, model.dtype, model.device))
            reasons += [f"layer {i}: {r}" for r in graph_refusals(state)]
    return reasons


def as_factory(bases: Any, model=None) -> StateFactory:
    """A state factory from a :class:`CalibratedBases` (checked against ``model``'s config), a
    sequence of per-layer :class:`~subspace_ref.StaticBasis`, or a factory itself."""
    if isinstance(bases, CalibratedBases):
        if model is not None:
            from subspace_ref.hf.artifact import config_hash

            if config_hash(model.config) != bases.config_hash:
                raise ValueError("bases: calibrated for another model configuration (config hash differs)")
        return bases.states(None if model is None else model.config)
    if callable(bases):
        return bases
    if isinstance(bases, Sequence):
        return static_states(bases)
    raise TypeError(f"bases: expected CalibratedBases, a sequence of StaticBasis or a state factory, got {type(bases).__name__}")


@contextlib.contextmanager
def compress(model, bases: Any, *, graph: bool | str = "auto", **cache_options: Any) -> Iterator[Compressed]:
    """Select the subspace attention for ``model`` while the block runs and yield a
    :class:`Compressed` whose ``cache()`` builds :class:`SubspaceCache` objects of ``bases``.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model; only its attention implementation changes, and only inside the block.
    bases : CalibratedBases, sequence of StaticBasis, or state factory
        See :func:`as_factory`; :class:`CalibratedBases` are checked against ``model``'s config.
    graph : bool or "auto"
        Whether :meth:`Compressed.generate` decodes through a :class:`GraphSubspaceCache`
        (compiled, CUDA graphs on CUDA): "auto" does on CUDA when every layer's state can be
        held by one and no ``cache_options`` are given; True always (refused, with the reasons,
        when a state cannot be held); False never.
    **cache_options
        Keywords of :class:`SubspaceCache` (``backend``, ``prefill``, ``sliding``, ...),
        checked before anything changes.

    Returns
    -------
    contextlib.AbstractContextManager[Compressed]
        Yields the :class:`Compressed`; on exit the previous implementation is back.

    Raises
    ------
    ValueError
        If :class:`CalibratedBases` were calibrated for another configuration, or an option is bad.
    TypeError
        If ``bases`` is none of the accepted kinds.

    Examples
    --------
    ::

        import torch
        from subspace_ref.hf import capture, compress
        from subspace_ref.models.default_model import load_model

        model, config = load_model("default")
        ids = torch.tensor([list(b"def read_config(path):\\n    return json.load(open(path))\\n")])
        bases = capture(model, ids).calibrate(rank_k=16, rank_v=16)  # one StaticBasis per layer
        with compress(model, bases) as kv:
            out = kv.generate(ids, max_new_tokens=8, do_sample=False)
            cache = kv.cache()                                   # or a cache to pass yourself
            model(input_ids=ids, cache=cache)
        cache.nbytes < cache.full_cache_nbytes                   # True
    """
    factory = as_factory(bases, model)
    SubspaceCache(model.config, factory, **cache_options)  # bad options fail here, before anything changes
    if graph not in (True, False, "auto"):
        raise ValueError(f'graph must be True, False or "auto", got {graph!r}')
    if graph is True:
        require(model_graph_refusals(model, factory), "graph=True: a GraphSubspaceCache does not hold")
    with subspace_attention_enabled(model):
        yield Compressed(model, factory, cache_options, graph)


__all__ = ["Compressed", "as_factory", "compress", "model_graph_refusals"]
