"""Per-token log-likelihoods under a compressed cache in one (or a few) forward passes.

:func:`teacher_forced` runs the model over the whole token sequence with a fresh
:class:`SubspaceCache`. Each layer appends the sequence's post-RoPE keys and values to its state
*in order*, so every token is projected with exactly the basis its decode step would use, and
every position ``p`` attends the compressed tokens ``<= p`` of the state as decoding would see it
after step ``p`` (static and adaptive states: a causal mask over the coefficient logits; rotating
states: the block is cut after each refresh token, see ``SubspaceLayer.attend_pending``). By
induction over layers and positions the logits equal those of token-by-token decoding
(:func:`decode_token_by_token`) up to floating-point summation order; spec/models.md gives the
argument and tests/test_hf_cache.py checks it for static, adaptive and rotating states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from subspace_ref.hf.attention import subspace_attention_enabled
from subspace_ref.hf.cache import SubspaceCache
from subspace_ref.hf.state_factories import StateFactory
from subspace_ref.hf_requirements import require_cache_api


@dataclass
class LogLikelihood:
    """``token_logprobs[b, t] = log p(x_{t+1} | x_{<=t})`` for t = 0..T-2 (float64, (B, T-1)).

    ``logits`` (B, T, V) when asked for; ``cache_nbytes`` / ``full_cache_nbytes``: the states'
    bytes and those of the uncompressed K/V of the same tokens (0 for the stock cache).

    Parameters
    ----------
    token_logprobs : numpy.ndarray
        (B, T-1) float64.
    logits : torch.Tensor or None
        (B, T, V), when kept.
    cache_nbytes, full_cache_nbytes : int
        The cache's bytes and the stock cache's for the same tokens.

    Examples
    --------
    See :func:`teacher_forced`.
    """

    token_logprobs: np.ndarray
    logits: torch.Tensor | None
    cache_nbytes: int
    full_cache_nbytes: int

    @property
    def nll(self) -> float:
        """Mean negative log-likelihood per predicted token (nats)."""
        return float(-self.token_logprobs.mean())

    @property
    def ppl(self) -> float:
        """Perplexity, exp(nll)."""
        return math.exp(self.nll)

    @property
    def compression(self) -> float:
        """full_cache_nbytes / cache_nbytes (nan for the stock cache)."""
        return self.full_cache_nbytes / self.cache_nbytes if self.cache_nbytes else float("nan")


def as_batch(input_ids: Any, device: Any = None) -> torch.Tensor:
    """Token ids as a (B, T) int64 tensor: a 1-D sequence becomes one row."""
    ids = torch.as_tensor(np.asarray(input_ids) if not isinstance(input_ids, torch.Tensor) else input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] < 1:
        raise ValueError(f"input_ids must be (T,) or (B, T) with T >= 1, got shape {tuple(ids.shape)}")
    return ids.to(device=device, dtype=torch.long)


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


def _blocks(T: int, block_size: int | None) -> list[tuple[int, int]]:
    size = T if block_size is None else int(block_size)
    if size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return [(a, min(T, a + size)) for a in range(0, T, size)]


def _forward_logits(model, ids: torch.Tensor, cache, block_size: int | None) -> torch.Tensor:
    """Logits (B, T, V) of one pass over ``ids`` with ``cache``, fed in blocks (the model's
    ``cache=`` keyword: ImportError on a transformers without it, as the caches raise)."""
    require_cache_api("teacher_forced")
    out = []
    for a, b in _blocks(ids.shape[1], block_size):
        res = model(input_ids=ids[:, a:b], cache=cache, use_cache=True)
        cache = res.cache
        out.append(res.logits)
    return torch.cat(out, dim=1)


def _token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> np.ndarray:
    logp = torch.log_softmax(logits[:, :-1].to(torch.float64), dim=-1)
    return logp.gather(-1, ids[:, 1:, None])[..., 0].cpu().numpy()


@torch.no_grad()
def teacher_forced(
    model,
    input_ids: Any,
    states: StateFactory | None = None,
    *,
    backend: str = "torch",
    block_size: int | None = None,
    prefill: str = "coefficient",
    keep_logits: bool = False,
) -> LogLikelihood:
    """Log-likelihood of every token of ``input_ids`` ((T,) or (B, T), no padding).

    ``states=None``: the stock model with a ``DynamicCache`` (the baseline). Otherwise a
    :class:`SubspaceCache` of ``states`` (a state factory) on ``backend``: the result equals
    token-by-token decoding with that cache. ``block_size`` feeds the sequence in blocks of that
    many tokens (bounding the logits' memory); the result does not depend on it, up to rounding.
    The model's attention implementation is switched to the subspace one for the call and restored.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Run in eval mode.
    input_ids : tensor or array
        (T,) or (B, T) token ids, T >= 1.
    states : StateFactory, optional
        None: the stock cache.
    backend : str
        Backend of the :class:`SubspaceCache`.
    block_size : int, optional
        Tokens per forward; default all at once.
    prefill : str
        "coefficient" or "attend" (:class:`SubspaceCache`).
    keep_logits : bool
        Keep the logits in the result.

    Returns
    -------
    LogLikelihood
        Per-token log-probabilities, ``nll``, ``ppl`` and the cache's bytes.

    Raises
    ------
    ValueError
        If ``input_ids`` is not (T,) or (B, T), or ``block_size < 1``.

    Examples
    --------
    ::

        import torch
        from subspace_ref.hf import capture, static_states, teacher_forced
        from subspace_ref.models.default_model import load_model

        model, config = load_model("default")
        ids = torch.tensor([list(b"def read_config(path):\\n    return json.load(open(path))\\n")])
        bases = capture(model, ids).calibrate(rank_k=16, rank_v=16)
        stock = teacher_forced(model, ids)
        ours = teacher_forced(model, ids, static_states(bases))
        ours.token_logprobs.shape                    # (1, 55)
        ours.nll - stock.nll, ours.compression       # the cost in nats, and full / compressed bytes
    """
    from transformers import DynamicCache

    model.eval()
    ids = as_batch(input_ids, _model_device(model))
    if states is None:
        cache = DynamicCache(config=model.config)
        logits = _forward_logits(model, ids, cache, block_size)
        return LogLikelihood(_token_logprobs(logits, ids), logits if keep_logits else None, 0, 0)
    with subspace_attention_enabled(model):
        cache = SubspaceCache(model.config, states, backend=backend, prefill=prefill)
        logits = _forward_logits(model, ids, cache, block_size)
    return LogLikelihood(_token_logprobs(logits, ids), logits if keep_logits else None, cache.nbytes, cache.full_cache_nbytes)


def perplexity(model, input_ids: Any, states: StateFactory | None = None, **kwargs: Any) -> float:
    """exp(mean NLL) of ``input_ids`` under ``states`` (None: the stock model); see :func:`teacher_forced`.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model.
    input_ids : tensor or array
        (T,) or (B, T) token ids.
    states : StateFactory, optional
        None: the stock cache.
    **kwargs
        Keywords of :func:`teacher_forced`.

    Returns
    -------
    float
        The perplexity.

    Examples
    --------
    ::

        import torch
        from subspace_ref.hf import perplexity
        from subspace_ref.models.default_model import load_model

        model, config = load_model("default")
        ids = torch.tensor([list(b"def read_config(path):\\n    return json.load(open(path))\\n")])
        perplexity(model, ids)                       # the stock cache's, a float > 1
    """
    return teacher_forced(model, input_ids, states, **kwargs).ppl


@torch.no_grad()
def decode_token_by_token(model, input_ids: Any, states: StateFactory | None = None, *, backend: str = "torch") -> torch.Tensor:
    """Logits (B, T, V) from T forward calls of one token each: the decoding the teacher-forced
    path reproduces (every attention goes through ``subspace_ref.attend``). For checks; slow.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model.
    input_ids : tensor or array
        (T,) or (B, T) token ids.
    states : StateFactory, optional
        None: the stock cache.
    backend : str
        Backend of the :class:`SubspaceCache`.

    Returns
    -------
    torch.Tensor
        Logits (B, T, V).

    Examples
    --------
    ::

        import torch
        from subspace_ref.hf import capture, decode_token_by_token, static_states, teacher_forced
        from subspace_ref.models.default_model import load_model

        model, config = load_model("default")
        ids = torch.tensor([list(b"def read_config(path):\\n    return json.load(open(path))\\n")])
        factory = static_states(capture(model, ids).calibrate(rank_k=16, rank_v=16))
        slow = decode_token_by_token(model, ids, factory)
        fast = teacher_forced(model, ids, factory, keep_logits=True).logits
        torch.allclose(slow, fast, atol=1e-4)        # True
    """
    from transformers import DynamicCache

    model.eval()
    ids = as_batch(input_ids, _model_device(model))
    if states is None:
        return _forward_logits(model, ids, DynamicCache(config=model.config), 1)
    with subspace_attention_enabled(model):
        cache = SubspaceCache(model.config, states, backend=backend)
        return _forward_logits(model, ids, cache, 1)


__all__ = ["LogLikelihood", "as_batch", "decode_token_by_token", "perplexity", "teacher_forced"]
