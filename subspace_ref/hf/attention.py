"""The attention function a transformers model calls when its cache is a :class:`SubspaceCache`.

Routing (spec/models.md "Routing"). transformers 5.x attention modules do, per layer::

    key_states, value_states = past_key_values.update(key_states, value_states, layer_idx)
    attn_output, _ = ALL_ATTENTION_FUNCTIONS[config._attn_implementation](
        module, query_states, key_states, value_states, attention_mask, scaling=..., dropout=..., **kwargs)

:func:`register` adds :func:`subspace_attention` under the name :data:`ATTN_IMPLEMENTATION`
(and the sdpa mask builder under the same name); :func:`use_subspace_attention` selects it for
one model (``model.set_attn_implementation``). Nothing in transformers is patched.

The decode step, in order (spec/models.md "Routing"):

1. the model's attention module calls ``cache.update(key, value, layer_idx)``: the cache layer
   (:class:`~subspace_ref.hf.SubspaceLayer`, or :class:`~subspace_ref.hf.GroupedLayer` for a
   layer state with heterogeneous heads) keeps the post-RoPE keys and values as *pending*,
   tags the key tensor with itself (:func:`tag`) and returns it;
2. the module calls :func:`subspace_attention` with that key tensor; :func:`tagged_layer` reads
   the layer back, and the layer's ``attend_pending`` appends the pending tokens to its state
   and attends: one ``subspace_ref.attend`` call for a single query per sequence (decode), the
   causal evaluator of :mod:`subspace_ref.hf.causal_attention` for a block (prefill);
3. on any error the layer's ``abandon`` drops the pending tokens, so nothing is half appended.

The tag (:data:`TAG`, set by :func:`tag`, read by :func:`tagged_layer`, removed by
:func:`untag`) is the only link between ``update`` and the attention call: the call itself
carries its layer, with no registry of pending layers, so caches, models and threads are
independent. It is set and read only through these three functions.

Untagged keys (a ``DynamicCache``, a sliding layer kept stock, or no cache) go to the model's
previous implementation ("sdpa", or the module's own eager function) unchanged, so the model
behaves exactly as before. Observers (:func:`observe`, used by
:mod:`subspace_ref.hf.capture`) see one model's post-RoPE queries, keys and values.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from subspace_ref.capabilities import require

#: The name under which :func:`subspace_attention` is registered in transformers.
ATTN_IMPLEMENTATION = "subspace_ref"

#: Attribute a cache layer's ``update`` sets on the key tensor it returns (module docstring).
TAG = "_subspace_ref_layer"


def tag(keys: torch.Tensor, layer) -> torch.Tensor:
    """Mark ``keys`` (the tensor a cache layer's ``update`` returns) as pending in ``layer``."""
    setattr(keys, TAG, layer)
    return keys


def tagged_layer(keys) -> Any:
    """The cache layer whose pending keys ``keys`` are; None for any other tensor (a
    ``DynamicCache``'s keys, a layer kept stock, a tag left on a tensor no longer pending)."""
    layer = getattr(keys, TAG, None)
    return layer if layer is not None and layer.pending_keys is keys else None


def untag(keys) -> None:
    """Take :data:`TAG` off a key tensor a layer's ``update`` returned (nothing if it has none)."""
    if keys is not None and hasattr(keys, TAG):
        delattr(keys, TAG)


#: Attribute a :class:`~subspace_ref.hf.graph_cache.GraphSubspaceLayer` sets, once, on its
#: coefficient tensor C (what its ``update`` returns as keys): the link to its layer that
#: ``torch.compile`` traces (a tensor attribute read is a constant of the graph).
GRAPH_TAG = "_subspace_ref_graph_layer"


def graph_layer(keys) -> Any:
    """The graph cache layer whose coefficients ``keys`` are; None for any other tensor."""
    return getattr(keys, GRAPH_TAG, None)


#: Attribute of an attention module holding the observers of :func:`observe` (per model).
OBSERVERS = "_subspace_ref_observers"


# ----------------------------------------------------------------------------- registration
def implementation_name(fallback: str = "sdpa") -> str:
    """The registered name of :func:`subspace_attention` whose untagged calls (layers not held
    by a :class:`SubspaceCache`: a ``DynamicCache``, sliding layers kept stock, no cache) go to
    ``fallback``, the implementation the model had: "sdpa" is :data:`ATTN_IMPLEMENTATION`."""
    return ATTN_IMPLEMENTATION if fallback in ("sdpa", ATTN_IMPLEMENTATION) or is_subspace(fallback) else f"{ATTN_IMPLEMENTATION}:{fallback}"


def is_subspace(name: str | None) -> bool:
    """Whether ``name`` is one of the names :func:`register` gives :func:`subspace_attention`."""
    return isinstance(name, str) and (name == ATTN_IMPLEMENTATION or name.startswith(ATTN_IMPLEMENTATION + ":"))


def register(fallback: str = "sdpa") -> str:
    """Register :func:`subspace_attention` and the matching mask builder in transformers.

    Registering only adds a name (idempotent); no model uses it until selected
    (:func:`use_subspace_attention`).

    Parameters
    ----------
    fallback : str
        Where calls without a subspace cache layer go: "sdpa" or "eager" (the model's previous
        implementation), or a name this function returned.

    Returns
    -------
    str
        The registered name (:func:`implementation_name`): :data:`ATTN_IMPLEMENTATION` for
        "sdpa", ``"subspace_ref:eager"`` for "eager".

    Raises
    ------
    ValueError
        If ``fallback`` is another implementation (e.g. "flash_attention_2").

    Examples
    --------
    ::

        from subspace_ref.hf import register

        register()         # 'subspace_ref'
        register("eager")  # 'subspace_ref:eager'
    """
    import functools

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    if fallback not in ("sdpa", "eager") and not is_subspace(fallback):
        raise ValueError(f'the subspace attention falls back to "sdpa" or "eager" for layers it does not hold, not {fallback!r}')
    name = implementation_name(fallback)
    fn = subspace_attention if name == ATTN_IMPLEMENTATION else functools.partial(subspace_attention, fallback=fallback)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, eager_mask if fallback == "eager" else sdpa_mask)
    return name


def use_subspace_attention(model) -> str:
    """Select the subspace attention for ``model``, registering it first.

    Untagged calls keep the model's current "sdpa" or "eager" implementation, so without a
    :class:`SubspaceCache` the model computes exactly what it did. The selection lasts until
    undone; :func:`compress` and :func:`subspace_attention_enabled` undo it on exit.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model whose ``config._attn_implementation`` is switched.

    Returns
    -------
    str
        The implementation it replaced (e.g. "sdpa").

    Examples
    --------
    ::

        from subspace_ref.hf import use_subspace_attention
        from subspace_ref.models.default_model import load_model

        model, config = load_model("default")
        previous = use_subspace_attention(model)     # 'sdpa'
        config._attn_implementation                  # 'subspace_ref'
        model.set_attn_implementation(previous)      # undo
    """
    previous = model.config._attn_implementation
    model.set_attn_implementation(register(previous))
    return previous


@contextlib.contextmanager
def subspace_attention_enabled(model) -> Iterator[None]:
    """Context manager: :func:`use_subspace_attention` on entry, the previous implementation on exit.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model to switch for the block.

    Returns
    -------
    contextlib.AbstractContextManager[None]
        Yields nothing; on exit the model's previous implementation is back.

    Examples
    --------
    ::

        from subspace_ref.hf import subspace_attention_enabled
        from subspace_ref.models.default_model import load_model

        model, config = load_model("default")
        with subspace_attention_enabled(model):
            config._attn_implementation              # 'subspace_ref'
        config._attn_implementation                  # 'sdpa'
    """
    previous = use_subspace_attention(model)
    try:
        yield
    finally:
        if not is_subspace(previous):
            model.set_attn_implementation(previous)


@contextlib.contextmanager
def observe(model, fn: Callable[..., None]) -> Iterator[None]:
    """Call ``fn`` on every call of :func:`subspace_attention` made by ``model``'s attention
    modules while the context is open (other models are not observed).

    The model must have the subspace attention selected (:func:`subspace_attention_enabled`);
    :func:`~subspace_ref.hf.capture` is built on this.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model whose attention modules are observed.
    fn : callable
        ``fn(module, query, key, value)``: ``query`` (B, H_q, n, d) and ``key``/``value``
        (B, H, n, d) post-RoPE, the tensors the cache's ``update`` received (or, without a
        cache, would have received).

    Returns
    -------
    contextlib.AbstractContextManager[None]
        Yields nothing; on exit ``fn`` is removed.

    Examples
    --------
    ::

        import torch
        from subspace_ref.hf import observe, subspace_attention_enabled
        from subspace_ref.models.default_model import load_model

        model, config = load_model("default")
        seen = []
        with subspace_attention_enabled(model), observe(model, lambda m, q, k, v: seen.append(k.shape)):
            model(input_ids=torch.tensor([list(b"import os")]))
        seen[0]                                      # torch.Size([1, 2, 9, 64]), one per layer
    """
    modules = [m for m in model.modules() if hasattr(m, "layer_idx")]
    for m in modules:
        m.__dict__.setdefault(OBSERVERS, []).append(fn)
    try:
        yield
    finally:
        for m in modules:
            m.__dict__[OBSERVERS].remove(fn)


# ----------------------------------------------------------------------------- the function
def subspace_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, fallback: str = "sdpa", **kwargs):
    """The attention function registered as :data:`ATTN_IMPLEMENTATION` (transformers' signature).

    The layer is found through the call: the key tensor ``SubspaceLayer.update`` returned
    carries it (decoded in Python, outside compiled graphs), or the coefficient tensor of a
    :class:`~subspace_ref.hf.GraphSubspaceCache` layer does (traced by ``torch.compile``,
    spec/models.md M11); any other key goes to ``fallback``, also traced. Models call it; users
    select it with :func:`use_subspace_attention` or :func:`compress` rather than call it.

    Parameters
    ----------
    module : torch.nn.Module
        The calling attention module.
    query : torch.Tensor
        (B, H_q, n, d), post-RoPE.
    key, value : torch.Tensor
        (B, H, n, d) and (B, H, n, d_v): what the cache's ``update`` returned.
    attention_mask : torch.Tensor or None
        A transformers 4-d mask; a plain causal one is dropped (the state applies causality).
    scaling : float, optional
        Logit scale; default ``d ** -0.5``.
    dropout : float
        Refused (:class:`~subspace_ref.capabilities.NotSupportedError`) when nonzero in
        training mode.
    fallback : str
        "sdpa" or "eager": the implementation for untagged keys.
    **kwargs
        Passed to the fallback; ``softcap`` is applied, ``s_aux`` is refused.

    Returns
    -------
    tuple[torch.Tensor, None]
        ``(attn_output (B, n, H_q, d_v), None)``.

    Raises
    ------
    ValueError
        If the query heads are not a multiple of the layer's KV heads, or the mask's shape
        does not match. On any error the layer's pending tokens are dropped.

    Examples
    --------
    ::

        from transformers import AttentionInterface
        from subspace_ref.hf import ATTN_IMPLEMENTATION, register, subspace_attention

        register()
        AttentionInterface()[ATTN_IMPLEMENTATION] is subspace_attention   # True
    """
    for fn in list(module.__dict__.get(OBSERVERS, ())):
        fn(module, query, key, value)
    graph = graph_layer(key)
    if graph is not None:  # a GraphSubspaceCache's layer: traced whole by torch.compile (graph_cache.py)
        return graph.attention_call(module, query, attention_mask, scaling, dropout, kwargs), None
    layer = tagged_layer(key)
    if layer is None:  # traced as the model's own attention would be
        return fallback_attention(fallback, module)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    return _cache_attention(layer, module, query, attention_mask, scaling, dropout, **kwargs)


@torch.compiler.disable(reason="a SubspaceCache appends and attends in Python outside any graph")
def _cache_attention(layer, module, query, attention_mask, scaling, dropout, **kwargs):
    """:func:`subspace_attention` for a SubspaceCache layer's pending keys (spec/models.md M4)."""
    try:
        refused = ["attention dropout in training mode (call model.eval())"] if dropout and module.training else []
        refused += ["attention sinks (s_aux)"] if kwargs.get("s_aux") is not None else []
        require(refused, f"layer {layer.layer_idx}: the subspace cache does not support")
        if query.shape[1] % layer.state.heads:
            raise ValueError(f"{query.shape[1]} query heads for {layer.state.heads} KV heads")
        mask = None if attention_mask is None or is_plain_causal(attention_mask, query.shape[2], layer.get_seq_length()) else attention_mask
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        out = layer.attend_pending(query, float(scaling), mask=mask, softcap=kwargs.get("softcap"))  # (B, H_q, n, d_v)
    except BaseException:
        layer.abandon()  # nothing of this call stays pending or appended
        raise
    return out.transpose(1, 2).contiguous(), None


def fallback_attention(name: str, module) -> Callable[..., Any]:
    """The attention function ``name`` ("sdpa" or "eager") for ``module``: eager is the
    module's own ``eager_attention_forward`` (e.g. Gemma2's applies its soft-capping)."""
    if name == "eager":
        import sys

        return getattr(sys.modules[type(module).__module__], "eager_attention_forward")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def is_plain_causal(mask, query_length: int, kv_length: int) -> bool:
    """Whether ``mask`` is None or the plain causal mask of ``query_length`` queries ending a
    ``kv_length``-token sequence (True/0 = attend): then no per-token mask is needed.
    ValueError if ``mask`` is not a 4-d mask over those queries and tokens."""
    if mask is None:
        return True
    if not isinstance(mask, torch.Tensor) or mask.ndim != 4 or mask.shape[-1] != kv_length or mask.shape[-2] != query_length:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"attention_mask: expected a 4-d mask over {query_length} queries and {kv_length} tokens, got {shape}")
    past = kv_length - query_length
    causal = torch.arange(kv_length, device=mask.device)[None, :] <= (past + torch.arange(query_length, device=mask.device))[:, None]
    return bool(torch.equal(allowed_positions(mask), causal.expand(mask.shape)))


def allowed_positions(mask: torch.Tensor) -> torch.Tensor:
    """The boolean form of a transformers 4-d mask: True where a query may attend a token
    (boolean sdpa masks as they are; additive eager masks: 0 attends, the dtype minimum not)."""
    return mask if mask.dtype == torch.bool else mask == 0


__all__ = [
    "ATTN_IMPLEMENTATION",
    "allowed_positions",
    "fallback_attention",
    "graph_layer",
    "implementation_name",
    "is_plain_causal",
    "is_subspace",
    "observe",
    "register",
    "subspace_attention",
    "subspace_attention_enabled",
    "tag",
    "tagged_layer",
    "untag",
    "use_subspace_attention",
]
