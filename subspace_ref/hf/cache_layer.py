"""``SubspaceLayer``: one layer of a :class:`~subspace_ref.hf.SubspaceCache`, holding a
:class:`~subspace_ref.SubspaceState`. Its ``update`` keeps the new post-RoPE keys and values as
pending; the attention function (:mod:`subspace_ref.hf.attention`) has the layer append them and
attend (:meth:`SubspaceLayer.attend_pending`). A layer whose factory gives a
:class:`~subspace_ref.LayerState` hands itself over to a grouped layer (:mod:`subspace_ref.hf.grouped_layer`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

import subspace_ref
from subspace_ref.arrays import clone
from subspace_ref.capabilities import require
from subspace_ref.hf import attention as _attn
from subspace_ref.hf import causal_attention as _causal
from subspace_ref.hf.state_factories import StateSpec
from subspace_ref.layer_state import HeadGroup, LayerState
from subspace_ref.layout import BY_NAME, FIXED, FIXED_ARRAYS, held_arrays, mapped_parts
from subspace_ref.operations import select_sequences
from subspace_ref.state import SubspaceState

#: The fixed-size arrays a one-call decode step gives a state afresh (``LayerAppender.commit``:
#: the exact window's and the key tail), as (part, attribute, name): see carry_restore_point.
ONE_CALL_REPLACED = tuple((BY_NAME[n].part, BY_NAME[n].attr, n) for n in ("window_keys", "window_values", "key_tail"))


class SubspaceLayer(CacheLayerMixin):
    """One layer of a :class:`SubspaceCache`: a :class:`SubspaceState` and nothing else.

    ``keys`` and ``values`` stay ``None``: the full K/V is never kept. Between a layer's
    ``update`` and its attention call the new tokens are *pending* (held only for that call).
    :class:`SubspaceCache` builds these; the methods are transformers' ``CacheLayerMixin``.

    Parameters
    ----------
    cache : SubspaceCache
        The cache holding the layer (its factory, backend and options).
    layer_idx : int
        The layer's index.
    state : SubspaceState, optional
        A ready empty state; default: the cache's factory builds it on the first ``update``.

    Examples
    --------
    ::

        import torch
        from subspace_ref.hf import SubspaceLayer, compress, full_rank_states
        from subspace_ref.models.default_model import load_model

        model, config = load_model("default")
        with compress(model, full_rank_states()) as kv:
            cache = kv.cache()
            model(input_ids=torch.tensor([list(b"import os")]), cache=cache)
        layer = cache.layers[0]
        isinstance(layer, SubspaceLayer), layer.state.num_tokens   # (True, 9)
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, cache, layer_idx: int, state: SubspaceState | None = None):  # cache: its SubspaceCache
        super().__init__()
        self.cache = cache  # a plain reference: a deep copy of the cache copies its layers with it
        self.layer_idx = layer_idx
        self._given = state
        self.state: SubspaceState | None = None
        self.pending_keys: torch.Tensor | None = None
        self.pending_values: torch.Tensor | None = None
        self._forward_start = 0  # tokens held when the current forward began (rollback point)
        self._restore_point: tuple[SubspaceState, dict] | None = None  # see keep_restore_point
        self._carried: tuple | None = None  # the next forward's restore point, made by a one-call step (carry_restore_point)
        self._forward_tokens: tuple | None = None  # the current forward's keys and values, while a restore point is kept
        self._decoder: tuple | None = None  # (admission, the backend's one-call decode step or None): see _one_call_step

    def __repr__(self) -> str:
        return f"SubspaceLayer({self.layer_idx}, {self.state!r})"

    # -- CacheLayerMixin
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, d = key_states.shape
        spec = StateSpec(self.layer_idx, B, H, d, value_states.shape[-1], key_states.dtype, key_states.device)
        state = self._given if self._given is not None else self.cache.factory(spec)
        if isinstance(state, LayerState):  # heads of different configurations: one child layer per head group
            self.cache.set_layer(self.layer_idx, self.cache.grouped_layer(self.layer_idx, self.cache.adopt(state, spec), key_states.dtype, key_states.device))
            return
        if not isinstance(state, SubspaceState):
            raise TypeError(f"layer {self.layer_idx}: the state factory returned {type(state).__name__}, expected a SubspaceState or a LayerState")
        self.state = self.cache.adopt(state, spec)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True
        self._forward_start = 0  # a layer built during a forward: its restore point is the empty state
        self.keep_restore_point()

    @torch.compiler.disable(reason="a SubspaceCache appends and attends in Python outside any graph")
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the new post-RoPE keys/values (B, H, n, d) as pending and return them tagged; the
        attention function appends them to the state and attends (see attention.py). Under
        ``torch.compile`` this and the attention function run eagerly (graph breaks around them)."""
        if not self.is_initialized:  # before a state is built for a model that would not attend through it (begin_forward checks each forward)
            self.cache.check_model_attention()
        if self.pending_keys is not None:
            self._clear_pending()  # the abandoned forward leaves nothing behind
            raise RuntimeError(
                f"layer {self.layer_idx}: the previous update was never consumed by the attention function (an earlier forward "
                f"failed, or the model does not pass the cache's keys to attn_implementation={_attn.ATTN_IMPLEMENTATION!r})"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            if self.cache.layers[self.layer_idx] is not self:  # it became a GroupedLayer
                return self.cache.layers[self.layer_idx].update(key_states, value_states, *args, **kwargs)
        st = self.state
        if key_states.ndim != 4 or key_states.shape[0] != st.batch or key_states.shape[1] != st.kv_heads or key_states.shape[3] != st.d:
            raise ValueError(f"layer {self.layer_idx}: keys of shape {tuple(key_states.shape)} do not fit the state {st!r} (batch {st.batch})")
        self.cache.begin_forward(self.layer_idx)
        self.pending_keys, self.pending_values = key_states, value_states
        _attn.tag(key_states, self)
        return key_states, value_states

    def get_seq_length(self) -> int:
        committed = 0 if self.state is None else self.state.num_tokens
        return committed + (0 if self.pending_keys is None else self.pending_keys.shape[2])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state = self._decoder = None  # (a decoder's arguments were made for the state's formats)
        self._clear_pending()
        self.is_initialized = False

    def offload(self):  # the state stays where the backend put it
        pass

    def prefetch(self):
        pass

    # -- editing the held tokens (crop for assisted decoding, batch indexing for beams)
    def truncate_reason(self) -> str | None:
        """Why the last tokens of this layer's state cannot be dropped by cutting its arrays
        (None: they can, at any length). Only states whose stored coefficients are their whole
        history qualify: static states without an exact window or sinks. The others are cut
        through the restore point of the current forward (:meth:`crop`)."""
        st = self.state
        if st is None:
            return None
        if st.kind != "static":
            return f"the {st.kind} state's sketches have absorbed the dropped tokens"
        if st.window is not None:
            return "tokens that left the exact window are projected and cannot be made exact again"
        if st.layout.side_format("key").low_bits:
            return f"{st.layout.coefficients} keys are quantised in groups of {st.layout.group} tokens: a finished group cannot give its tokens back to the float tail"
        return None

    @property
    def is_croppable(self) -> bool:
        """Every layer can be cropped, back to the start of its last forward at least (:meth:`crop`)."""
        return True

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens (static states: coefficients are per token)."""
        if self.state is not None and num_tokens < self.state.num_tokens:
            self.state.layout = replace(self.state.layout, num_tokens=num_tokens)

    def keep_restore_point(self) -> None:
        """At the start of a forward: remember what :meth:`restore` needs to bring a state that
        cannot be truncated back to its present tokens. Appends write only rows and chunk slots
        past the state's counts (spare until then), copy bases and coefficients in use before
        rewriting them (warm-up rows, rotating refreshes: ``PackedLayout.with_private_bases``,
        private rotated coefficients), and replace the layout, sketch and window objects and
        their small fixed-size arrays (sketch buffers, exact window and sinks, key tail, chunk
        counts) rather than write them. So the restore point shares the state's objects; each
        fixed-size torch array's version counter is kept with it and checked by :meth:`restore`
        (an in-place write since would be a bug: it raises rather than restore a changed state),
        and arrays of other families, which have no counter, are copied. (Crop also needs the
        forward's tokens, which :meth:`attend_pending` keeps for forwards of at most
        ``max_crop_block`` tokens, so a prefill's are not held twice.)"""
        self._restore_point = self._forward_tokens = None
        st, carried = self.state, self._carried
        self._carried = None
        if carried is not None and carried[0] is st and carried[1] is st.layout and carried[2] is st.sketches and carried[3] is st.window:
            self._restore_point = (SubspaceState(st.policy, st.layout, st.sketches, st.batched, st.engine, st.window), carried[4])
            self._forward_start = carried[5]
            return
        self._forward_start = self.get_seq_length()
        if st is None or self.truncate_reason() is None:
            return
        fixed = held_arrays(st, FIXED_ARRAYS)
        try:
            versions = {name: (x, x._version) for name, x in fixed.items()}
        except AttributeError:  # arrays of other families than torch: no version counter
            versions = None
        if versions is not None:
            self._restore_point = (SubspaceState(st.policy, st.layout, st.sketches, st.batched, st.engine, st.window), versions)
        else:
            parts = mapped_parts(st, lambda a, x: clone(x) if a.axis == FIXED else x)
            self._restore_point = (SubspaceState(st.policy, parts["layout"], parts["sketches"], st.batched, st.engine, parts["window"]), {})

    def carry_restore_point(self) -> None:
        """After a one-call decode step (``_one_call_step``, a grouped layer's too): the next
        forward's restore point made from this forward's, which :meth:`keep_restore_point` takes
        while the state still holds the parts the step left. The step replaced the layout and
        window objects and, of their fixed-size arrays, only those of :data:`ONE_CALL_REPLACED`
        (``LayerAppender.commit``); every other array is the same object, whose version kept at
        this forward's start stays the one :meth:`restore` checks (a write since is still seen)."""
        point, st = self._restore_point, self.state
        if point is None or not point[1]:  # no restore point, or arrays without version counters
            self._carried = None
            return
        versions = dict(point[1])
        for part, attr, name in ONE_CALL_REPLACED:
            x = getattr(getattr(st, part), attr)
            if x is None:
                versions.pop(name, None)
            else:
                versions[name] = (x, x._version)
        self._carried = (st, st.layout, st.sketches, st.window, versions, self._forward_start + 1)  # the step appended one token

    def restore(self) -> None:
        """Bring the state back to the start of the current forward (see :meth:`keep_restore_point`)."""
        point, versions = self._restore_point
        written = [name for name, (x, version) in versions.items() if x._version != version]
        if written:
            raise RuntimeError(f"layer {self.layer_idx}: the state's {', '.join(written)} changed in place since the forward began; cannot restore it")
        self.state, self._restore_point = point, None

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (transformers' convention: negative).

        Static states without a window and with float or int8 coefficients: their coefficients
        are cut, to any length. Others (windowed, adaptive, rotating, int4/int2 whose key groups
        are quantised as a whole): the state goes back to its restore point at the start
        of the last forward and the forward's tokens up to the new length are appended again,
        which gives exactly the state of appending only those tokens; so they crop only back
        to the start of the last forward of at most ``max_crop_block`` tokens (what assisted
        and prompt-lookup decoding do: they crop the rejected candidates of the last forward)."""
        if tokens_to_remove > 0:
            raise ValueError(f"tokens_to_remove: expected a negative number of tokens to remove, got {tokens_to_remove}")
        if not tokens_to_remove or self.state is None:
            return
        keep = max(0, self.state.num_tokens + tokens_to_remove)
        if self.truncate_reason() is None:
            self.truncate(keep)
            return
        start = self._forward_start
        if self._forward_tokens is None or keep < start:
            reason = f"{self.truncate_reason()}; it crops back only to the start of its last forward of at most {self.cache.max_crop_block} tokens"
            require([reason], f"layer {self.layer_idx}: cannot crop to {keep} tokens")
        keys, values = self._forward_tokens
        self.restore()
        self._forward_tokens = None
        if keep > start:
            self._append(keys[:, :, : keep - start], values[:, :, : keep - start])

    def _index_batch(self, index: Any) -> None:
        if self.state is None or self.state.num_tokens == 0 and self._given is None:
            self.state, self.is_initialized, self._decoder = None, False, None  # built again, at the new batch size
            return
        st = self.state
        if isinstance(st.layout.key_coef, np.ndarray):
            index = np.asarray(index.cpu() if isinstance(index, torch.Tensor) else index)
        else:
            index = torch.as_tensor(index, device=st.layout.key_coef.device)
        self.state = select_sequences(st, index)  # every state array gathered along the batch axis
        self._restore_point = self._forward_tokens = self._decoder = self._carried = None  # taken at the old batch

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._index_batch(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        batch = 0 if self.state is None else self.state.batch
        self._index_batch(torch.arange(batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._index_batch(indices)

    # -- attention
    def _clear_pending(self) -> None:
        _attn.untag(self.pending_keys)
        self.pending_keys = self.pending_values = None

    def abandon(self) -> None:
        """The forward failed: drop what is pending and give back every layer's tokens of this
        forward (static states; an online state's sketches cannot forget, see spec/models.md)."""
        self._clear_pending()
        self.cache.rollback_forward()

    def _append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        st = self.state
        if isinstance(st.layout.key_coef, np.ndarray):
            keys, values = _to_numpy(keys, st.dtype), _to_numpy(values, st.dtype)
        st.append(keys, values)

    def _attend_one(self, q: torch.Tensor, state: SubspaceState, scale: float) -> torch.Tensor:
        """subspace_ref.attend of q (B, H_q, d) over ``state``, back as q's tensor type."""
        x = _to_numpy(q, state.dtype) if isinstance(state.layout.key_coef, np.ndarray) else q
        out = subspace_ref.attend(x, state, backend=self.cache.backend, scale=scale)
        return out if isinstance(out, torch.Tensor) else torch.from_numpy(np.asarray(out)).to(device=q.device, dtype=q.dtype)

    def _attend_block(self, q: torch.Tensor, first_position: int, scale: float, exact: _causal.ExactPart | None, **masking: Any) -> torch.Tensor:
        """Queries q (B, H_q, m, d) at positions first_position.. over the state holding exactly
        tokens 0..first_position+m-1, each query causally (static/adaptive, or a rotating state
        with no refresh after first_position's append); ``exact``: the windowed state's
        :func:`~subspace_ref.hf.causal_attention.exact_part` taken before the block was appended."""
        st = self.state
        if q.shape[2] == 1 and not any(v is not None for v in masking.values()):
            return self._attend_one(q[:, :, 0], st, scale)[:, :, None]
        if self.cache.prefill == "attend":
            views = [self._attend_one(q[:, :, i], _causal.prefix_view(st, first_position + i + 1), scale) for i in range(q.shape[2])]
            return torch.stack(views, dim=2)
        return _causal.causal_attention(q, st, first_position, scale, exact=exact, **masking)

    def masked_reason(self) -> str | None:
        """Why this layer's state cannot attend under a per-token mask or soft-capping (None: it
        can, by :func:`~subspace_ref.hf.causal_attention.causal_attention`)."""
        st = self.state
        if st.kind == "rotating":
            return "a rotating state rewrites past coefficients at each refresh"
        if getattr(st.policy, "rope", None) is not None:
            return "a pre-RoPE state rotates keys by their cache index, which is not the position of a padded sequence"
        return None

    def _segments(self, n: int) -> list[tuple[int, int]]:
        """The pending block's queries cut into runs [a, b) that one causal evaluation covers:
        the whole block, except that a rotating state's query whose append runs a refresh
        (spec A8: all stored coefficients rewritten) stands alone; an int4/int2 state's query
        whose append finishes a key group (spec/quantization.md Q2: the group's tokens leave the
        float tail for their quantised reading) starts a run, so that no query sees a group that
        a later token of its run finished (nor scales that depend on tokens after it); and
        ``prefill="attend"`` on a windowed state (whose prefix views would need the evicted
        exact tokens) goes token by token."""
        st = self.state
        if n == 1 or (st.window is not None and self.cache.prefill == "attend"):
            return [(i, i + 1) for i in range(n)]
        if st.kind != "rotating" and not st.layout.side_format("key").low_bits:
            return [(0, n)]
        T0 = st.num_tokens
        compressed, _ = _causal.compressed_visible(st, np.arange(T0, T0 + n + 1))  # before and after each query's append
        cuts = {0, n}
        if st.layout.side_format("key").low_bits:  # key groups, whatever the value side stores
            G = st.layout.group
            cuts.update(np.flatnonzero(compressed[1:] // G > compressed[:-1] // G).tolist())
        if st.kind == "rotating":
            m, W = st.policy.refresh_every, st.policy.warmup
            t = np.arange(int(compressed[-1]))
            refreshed = np.concatenate([[0], np.cumsum((t >= W) & ((t + 1 - W) % m == 0))])  # refreshes among the first k compressed
            alone = np.flatnonzero(refreshed[compressed[1:]] > refreshed[compressed[:-1]])
            cuts.update(alone.tolist() + (alone + 1).tolist())
        cuts = sorted(cuts)
        return list(zip(cuts[:-1], cuts[1:]))

    def _one_call_step(self, query: torch.Tensor, scale: float) -> torch.Tensor | None:
        """A decode step's append and attention (``query`` (B, H_q, 1, d) -> (B, H_q, 1, d_v)) by
        one call of the backend's layer decode over the state as a one-group layer
        (spec/layer_state.md L5.3; torch/CPU: ``subspace_ref_torch.layer_decode``, which serves
        static states with a full exact window), asked once per admission as a grouped layer
        asks; None, with nothing changed, where it does not serve the step."""
        keys, values, st = self.pending_keys, self.pending_values, self.state
        admission = (keys.shape, values.shape, query.shape, keys.dtype, values.dtype, query.dtype, keys.device, scale)
        held = self._decoder
        if held is None or held[0] != admission:
            if st.engine != "torch" or st.kv_heads != st.heads or not st.num_tokens or keys.shape[2] != 1:
                return None  # (a per-query-head state is no layer of KV heads)
            try:
                from subspace_ref_torch.layer_decode import layer_decoder
            except ImportError:  # the torch backend's package is not installed
                layer_decoder = None
            heads = tuple(range(st.heads))
            decoder = None if layer_decoder is None else layer_decoder(LayerState(st.heads, [HeadGroup(heads, st)]), [heads], keys, values, query, scale)
            held = self._decoder = (admission, decoder)
        out = None if held[1] is None else held[1]([st], keys, values, query)
        if out is not None:
            self.take_pending(1)
            self.carry_restore_point()
        return out

    def take_pending(self, queries: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending keys and values (B, H, n, d), no longer pending and kept for a crop of
        this forward; ValueError unless ``queries`` == n."""
        keys, values = self.pending_keys, self.pending_values
        n = keys.shape[2]
        if queries != n:
            raise ValueError(f"layer {self.layer_idx}: {queries} queries for {n} new tokens")
        self._clear_pending()
        if self._restore_point is not None and n <= self.cache.max_crop_block:
            self._forward_tokens = (keys, values)
        return keys, values

    def attend_pending(self, query: torch.Tensor, scale: float, *, mask: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
        """Append the pending tokens and attend ``query`` (B, H_q, n, d) -> (B, H_q, n, d_v), each
        query position p seeing the state exactly as token-by-token decoding would at step p.

        One append of the n tokens (one call to the backend, which moves a block whole), then
        :func:`causal_attention` (or one ``attend`` call when n = 1), whatever the state kind
        but rotating: a refresh rewrites all stored coefficients, so a query whose append
        runs one is appended and attended alone (``attend`` on the refreshed state), the runs
        between them in one block each; int4/int2 states start a run at each query whose append
        finishes a key group (:meth:`_segments`). A windowed state's queries see its compressed part as
        it was at their step and every other token of theirs exactly (spec/window.md W2, W3;
        :func:`~subspace_ref.hf.causal_attention.exact_part`). A ``mask`` that is not the plain causal
        one (left padding, a sliding window) or ``softcap`` is applied to the logits by
        :func:`causal_attention` (refused for rotating and pre-RoPE states).
        """
        if query.shape[2] == 1 and mask is None and softcap is None:
            out = self._one_call_step(query, scale)
            if out is not None:
                return out
        st = self.state
        T0 = st.num_tokens
        if mask is not None or softcap is not None:
            what = "soft-capping" if mask is None else "a padding or sliding-window mask"
            require([self.masked_reason()] if self.masked_reason() else [], f"layer {self.layer_idx}: {what}")
        keys, values = self.take_pending(query.shape[2])
        n = keys.shape[2]
        outs = []
        single = mask is None and softcap is None  # a lone query goes to one attend call, which needs no exact part
        for a, b in self._segments(n):
            exact = None if single and b - a == 1 else _causal.exact_part(st, keys[:, :, a:b], values[:, :, a:b])
            self._append(keys[:, :, a:b], values[:, :, a:b])
            part_mask = None if mask is None else mask[:, :, a:b, : T0 + b]
            outs.append(self._attend_block(query[:, :, a:b], T0 + a, scale, exact, mask=part_mask, softcap=softcap))
        return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


def _to_numpy(x: torch.Tensor, dtype) -> np.ndarray:
    x = x.detach()
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    return x.cpu().numpy().astype(dtype, copy=False)


__all__ = ["SubspaceLayer"]
