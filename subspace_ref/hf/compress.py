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
from subspace_ref.hf.graph_cache import GraphSubspaceCache, model_graph_refusals
from subspace_ref.hf.state_factories import StateFactory, static_states


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
        or ``"auto"`` on a CUDA ``device`` (default: the model's) when the model and every
        layer's state pass :func:`model_graph_refusals` and no cache option asks for the SubspaceCache."""
        if self.graph != "auto":
            return self.graph
        device = torch.device(device if device is not None else self.model.device)
        return device.type == "cuda" and not self.cache_options and not model_graph_refusals(self.model.config, self.factory, device, self.model.dtype)

    def generate(self, *args: Any, **kwargs: Any):
        """``model.generate`` with a fresh cache (unless ``cache`` is given): when
        :meth:`uses_graph`, a :class:`GraphSubspaceCache` of :func:`generation_capacity` tokens
        (transformers then compiles the decode step, with CUDA graphs on CUDA), else :meth:`cache`.

        Parameters
        ----------
        *args, **kwargs
            Those of ``model.generate``.

        Returns
        -------
        torch.Tensor or transformers.GenerateOutput
            What ``model.generate`` returns.

        Raises
        ------
        ValueError
            If a given ``GraphSubspaceCache`` cannot hold the prompt and the tokens asked for.
        """
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        cache = kwargs.get("cache")
        if cache is None and ids is not None and self.uses_graph():
            kwargs["cache"] = self.graph_cache(generation_capacity(self.model, ids.shape[-1], kwargs, round_to=CAPACITY_STEP))
        elif cache is None:
            kwargs["cache"] = self.cache()
        elif isinstance(cache, GraphSubspaceCache) and ids is not None:  # a compiled step cannot check its capacity (M11.5)
            need = generation_capacity(self.model, ids.shape[-1], kwargs)
            if need > cache.max_cache_len:
                raise ValueError(f"cache: max_cache_len = {cache.max_cache_len} holds fewer than the {need} tokens of the prompt and max_new_tokens")
        return self.model.generate(*args, **kwargs)


#: :meth:`Compressed.generate` rounds a graph cache's capacity up to a multiple of this, so that
#: prompts of similar lengths share one compiled step (each capacity compiles and captures anew).
CAPACITY_STEP = 256


def generation_capacity(model, prompt_tokens: int, kwargs: dict, round_to: int = 1) -> int:
    """Tokens a ``generate`` call with ``kwargs`` can reach: prompt + ``max_new_tokens``, else
    ``max_length``, else prompt + 20 within ``max_position_embeddings`` (transformers'
    ``_prepare_generated_length`` defaults), rounded up to a multiple of ``round_to``."""
    config = kwargs.get("generation_config") or model.generation_config
    new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    length = kwargs.get("max_length", getattr(config, "max_length", None))
    if new is not None:
        total = prompt_tokens + int(new)
    elif length is not None:
        total = int(length)
    else:
        total = prompt_tokens + 20
        limit = getattr(model.config, "max_position_embeddings", None)
        total = min(total, limit) if limit else total
    return -(-max(total, 1) // round_to) * round_to


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
        (compiled, CUDA graphs on CUDA): "auto" does on CUDA when the model and every layer's
        state can be held by one and no ``cache_options`` are given; True always (refused, with
        the reasons, when they cannot, or with ``cache_options``); False never.
    **cache_options
        Keywords of :class:`SubspaceCache` (``backend``, ``prefill``, ``sliding``, ...),
        checked before anything changes.

    Returns
    -------
    contextlib.AbstractContextManager[Compressed]
        Yields the :class:`Compressed`; on exit the previous implementation is back.

    Raises
    ------
    ImportError
        On a transformers older than :data:`~subspace_ref.hf_requirements.MIN_TRANSFORMERS`
        (:class:`SubspaceCache`'s check, before anything changes).
    ValueError
        If :class:`CalibratedBases` were calibrated for another configuration, or an option is bad.
    subspace_ref.capabilities.NotSupportedError
        With ``graph=True``, if the model or a layer's state cannot be held by a
        :class:`GraphSubspaceCache` (the reasons named).
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
    if not (graph is True or graph is False or graph == "auto"):
        raise ValueError(f'graph must be True, False or "auto", got {graph!r}')
    if graph is True and cache_options:
        raise ValueError(f"graph=True: the options {sorted(cache_options)} are SubspaceCache options; a GraphSubspaceCache takes none")
    if graph is True:
        require(model_graph_refusals(model.config, factory, model.device, model.dtype), "graph=True: a GraphSubspaceCache does not hold")
    with subspace_attention_enabled(model):
        yield Compressed(model, factory, cache_options, graph)


__all__ = ["CAPACITY_STEP", "Compressed", "as_factory", "compress", "generation_capacity"]
