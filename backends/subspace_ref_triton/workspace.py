"""A decode step that can be captured in a CUDA graph: :class:`DecodeWorkspace`.

``decode.decode_attention`` sizes its grid from the token count T (a host int), allocates its
partials and output per call and, through ``subspace_ref.attend``, checks its inputs on the host:
~100 us of host work per step, and nothing a CUDA graph can replay once T changes. The workspace
fixes everything that a graph bakes in, once, from the cache's *capacity*:

* the token count lives on the device (``num_tokens``, a one-element int64 tensor); the split
  kernel reads it and derives the split length from it (``DEVICE_T``), so the grid
  ``(N * H, S)`` depends on the capacity and the occupancy only;
* S fills the device's resident program slots once (``occupancy.full_wave_splits`` with the
  compiled kernel's registers and shared memory), splits of T beyond the current one are empty
  and merge as the identity (spec A3.2);
* the partials and the output are allocated here (and, with ``fused_merge``, the counters of
  the one-launch split + merge, ``decode.fused_launch``, which every launch leaves at zero);
  :meth:`attend` allocates nothing, reads no device value on the host and synchronises nothing
  (``tests/test_triton_launch.py`` runs it under a guard that raises on any of these).

With ``rope`` (a pre-RoPE static state, spec/rope.md P3) the step is the pre-RoPE kernel's
(``rope_decode.split_launch`` with the device count, its angle tables built here once over the
capacity) and the same merge (spec A3.2), so a graph captures a pre-RoPE cache's step too. A
windowed graph layer's exact sinks and ring join the merge launch (``exact``, spec/models.md
M11.14 step 4), read up to a device count as well.

The layout's tensors must stay the ones the workspace was built on (a graph replays their
addresses): build the state with its final capacity (``layout.with_capacity``) first, and advance
``num_tokens`` on the device as tokens are appended (:meth:`advance`), or let :meth:`append`
project and write new tokens at the device count and advance it (a static float or int8 state),
so that a whole decode step, ``append`` then :meth:`attend`, is three launches and one add.
"""

from __future__ import annotations

import math

import torch

from subspace_ref_triton import decode, project, rope_decode, window_decode
from subspace_ref_triton._common import cdiv, interpreting
from subspace_ref_triton.occupancy import full_wave_splits


class DecodeWorkspace:
    """Preallocated, graph-capturable coefficient-space attention (spec A2, A3, A3.2) of queries
    (N, H_q, d) in ``dtype`` over ``layout`` (a torch :class:`~subspace_ref.layout.PackedLayout`
    at its final capacity). ``num_tokens``: a one-element int64 device tensor the caller advances
    (default: the workspace's own, see :meth:`advance`). ``fixed_tail``: the owner of an int4/int2
    layout writes its ``key_tail`` in place (the graph cache, spec/models.md M11.8), so the
    layout is taken; without it such layouts are refused. ``rope``: the
    :class:`~subspace_ref.rope.RopeParams` of a pre-RoPE static state's layout (spec/rope.md P3),
    attended by the pre-RoPE kernel, compressed token t at position ``first_position + t``
    (spec/window.md W10: the sinks before it)."""

    def __init__(self, layout, query_heads: int, dtype, scale: float | None = None, num_splits: int | None = None, fused_merge: bool = False,
                 num_tokens=None, fixed_tail: bool = False, rope=None, first_position: int = 0):
        if rope is not None and fused_merge:
            raise ValueError("fused_merge is not built for the pre-RoPE kernel (rope): it merges in a second launch")
        if not fixed_tail and any(layout.side_format(which).low_bits for which in ("key", "value")):
            # a state's int4/int2 append writes the unfinished key group into a new key_tail tensor
            # (spec/quantization.md Q2.1), whose address a captured graph would not follow
            raise ValueError("DecodeWorkspace does not take int4/int2 layouts: every append replaces their key_tail tensor; use decode.decode_attention"
                             " (or pass fixed_tail=True for a layout whose key_tail is written in place, as the graph cache's)")
        N, H, capacity = layout.key_coef.shape[:3]
        d, d_v = layout.key_bases.shape[4], layout.value_bases.shape[4]
        self.layout = layout
        self.device = layout.key_coef.device
        self.scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        # the count is the caller's when given (a cache's own device count, advanced by its appends)
        self.num_tokens = torch.full((1,), int(layout.num_tokens), dtype=torch.int64, device=self.device) if num_tokens is None else num_tokens
        q_shape = (N, query_heads, d)
        self.rope = rope
        # the pre-RoPE kernel's angle tables over the capacity, once (its step then allocates nothing)
        self.tables = None if rope is None else rope_decode.rope_tables(rope, d, rope_decode.default_block_t(layout.key_bases.dtype), self.device,
                                                                        capacity=capacity, first_position=first_position)
        if num_splits is None:
            probe = torch.empty(q_shape, dtype=dtype, device=self.device)
            if rope is None:
                launch, _ = decode.split_launch(probe, layout, self.scale, 0, 1, num_tokens=self.num_tokens)
            else:
                launch, _ = rope_decode.split_launch(probe, layout, rope, self.scale, 0, num_tokens=self.num_tokens, num_splits=1, tables=self.tables)
            if self.device.type == "cuda" and not interpreting():
                sms = torch.cuda.get_device_properties(self.device).multi_processor_count
                num_splits = full_wave_splits(N * H, capacity, decode.resident_programs(launch, self.device), sms, decode.MIN_SPLIT_TOKENS)
            else:  # the interpreter runs programs one after another
                num_splits = max(1, min(cdiv(capacity, decode.MIN_SPLIT_TOKENS), 4))
        self.num_splits = int(num_splits)
        f32 = dict(dtype=torch.float32, device=self.device)
        self.partials = (torch.empty((N, query_heads, self.num_splits), **f32), torch.empty((N, query_heads, self.num_splits), **f32),
                         torch.empty((N, query_heads, self.num_splits, d_v), **f32))
        self.out = torch.empty((N, query_heads, d_v), dtype=dtype, device=self.device)
        # one launch for split + merge (decode.fused_launch), off by default: timed slower under a CUDA graph (docs/gpu.md)
        self.counters = torch.zeros(N * H, dtype=torch.int32, device=self.device) if fused_merge else None
        self.chunk = torch.zeros((N, H), dtype=torch.int64, device=self.device)  # the static basis of every head, for append

    def launches(self, q, layout=None, num_tokens=None, exact=None):
        """The split and merge launches of one step over ``q`` (built, not run); with
        ``fused_merge`` the one split launch that also merges. ``layout`` and ``num_tokens``
        replace the workspace's own for this step: tensors of the same shapes and dtypes (what
        a compiled graph hands an operator in place of the buffers it reads). ``exact``: a
        windowed graph layer's ``(keys, values, count[, heads])`` (spec/models.md M11.14 step 4),
        whose exact part the merge launch adds (:func:`~subspace_ref_triton.window_decode.exact_merge_launch`)."""
        layout = self.layout if layout is None else layout
        num_tokens = self.num_tokens if num_tokens is None else num_tokens
        if self.rope is not None:
            split, _ = rope_decode.split_launch(q, layout, self.rope, self.scale, 0, num_tokens=num_tokens, num_splits=self.num_splits, outputs=self.partials,
                                                tables=self.tables)
        elif self.counters is not None:
            if exact is not None:
                raise ValueError("fused_merge does not take an exact part: build the workspace without it")
            split, _ = decode.split_launch(q, layout, self.scale, 0, self.num_splits, num_tokens=num_tokens, outputs=self.partials,
                                           fused=(self.out, self.counters))
            return (split,)
        else:
            split, _ = decode.split_launch(q, layout, self.scale, 0, self.num_splits, num_tokens=num_tokens, outputs=self.partials)
        if exact is None:
            merge, _ = decode.merge_launch(*self.partials, self.out.dtype, out=self.out)
        else:
            keys, values, count, *heads = exact
            merge = window_decode.exact_merge_launch(q, keys, values, self.scale, self.partials, self.out, count, *heads)
        return split, merge

    def attend(self, q, layout=None, num_tokens=None, exact=None):
        """Spec A3 of q (N, H_q, d) over the first ``num_tokens`` tokens: ``self.out``, overwritten
        by every call. No allocation, no host sync; q must have the workspace's shape and dtype.
        ``layout``, ``num_tokens``, ``exact``: as :meth:`launches` (with ``exact``, the exact
        tokens too: spec A3.2 over both parts)."""
        for launch in self.launches(q, layout, num_tokens, exact):
            launch.run()
        return self.out

    def append(self, keys, values) -> None:
        """Spec A6 step 1 for n new tokens, keys (N, H, n, d) and values (N, H, n, d_v), of a
        static post-RoPE layout with float or int8 coefficients: ``c = B k`` and ``E v`` written
        at rows T .. T + n - 1 (int8: quantised per token, spec A10), T read on the device, then
        T advanced by n. One launch and one add, graph-capturable (no allocation, no host
        read); the caller keeps T + n within the capacity, which a graph cannot check."""
        lay = self.layout
        if self.rope is not None or lay.key_bases.shape[2] != 1 or any(lay.side_format(w).low_bits for w in ("key", "value")):
            raise ValueError("DecodeWorkspace.append writes a static post-RoPE layout with float or int8 coefficients "
                             "(pre-RoPE keys are un-rotated first, spec/rope.md P3; int4/int2 keys complete their groups, spec/quantization.md Q2.1)")
        # int8 on one side only is refused by project_launch, which checks outputs against scales
        scales = dict(out_key_scale=lay.key_scale, out_value_scale=lay.value_scale) if lay.key_coef.dtype == torch.int8 else {}
        launch, _ = project.project_launch(keys, values, lay.key_bases, lay.value_bases, self.chunk, lay.key_coef, lay.value_coef, out_row=self.num_tokens,
                                           **scales)
        if launch is not None:
            launch.run()
        self.advance(keys.shape[2])

    def advance(self, count: int = 1) -> None:
        """Count ``count`` more tokens, on the device (graph-capturable)."""
        self.num_tokens.add_(count)
