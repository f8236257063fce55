"""Quantised coefficients at a fixed capacity, for the graph cache (spec/models.md M11.8).

A :class:`~subspace_ref.hf.GraphSubspaceLayer` with an int8 or int4/int2 side keeps a packed
layout (spec A9) whose arrays never move: tokens are written in place at a token count that
lives on the device, and read back whole, so that a compiled decode step needs no host value.
Formats as the layout defines them (spec A10, spec/quantization.md Q1-Q2); what differs from the
state's own append (:func:`~subspace_ref.quantization.store_low_bit`) is only *when* an
unfinished key group's codes are written: every token re-quantises its group from the fixed
``key_tail``, which no reader uses until the group is complete (M11.8).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from subspace_ref.basis_storage import decoded_state
from subspace_ref.layout import BY_NAME, GROUP, TOKEN, PackedLayout
from subspace_ref.quantization import check_fp16_range, dequantize_groups, dequantize_rows, pack, quantize_groups, quantize_rows, store_low_bit, unpack


def fixed_layout(state, device, dtype, capacity: int) -> PackedLayout:
    """The empty static ``state``'s layout as torch tensors on ``device`` (floating arrays in
    ``dtype``, bases decoded), every token array ``capacity`` rows long, rounded up to whole key
    groups when the keys are low-bit (a group's codes are written whole)."""
    lay = decoded_state(state.to("torch", device=device, dtype=dtype)).layout
    rows = -(-capacity // lay.group) * lay.group if lay.side_format("key").low_bits else capacity
    lay = lay.with_capacity(rows, 1)
    size = {TOKEN: rows, GROUP: rows // lay.group if lay.group else 0}

    def fit(name, x):
        axis = BY_NAME[name].axis
        return x[:, :, : size[axis]].contiguous() if axis in size else x

    return replace(lay.map_arrays(fit), num_tokens=0)


def sequence_arrays(lay: PackedLayout) -> dict[str, torch.Tensor]:
    """The layout's arrays of stored tokens, per sequence (batch first): each side's coefficients
    or codes and what its format adds (scales, zero points, the key tail)."""
    names = [name for which in ("key", "value") for name in (f"{which}_coef", *lay.side_format(which).arrays(which))]
    return {name: getattr(lay, name) for name in names}


def check_range(lay: PackedLayout, which: str, new: torch.Tensor) -> None:
    """The ValueError :func:`write` raises (Q1: low-bit coefficients finite and within float16's
    range, once rounded to the layout's dtype as :func:`write` rounds them) for ``new``
    coefficients of side ``which``, raised before anything is written (a host read)."""
    if lay.side_format(which).low_bits and new.numel():
        largest = float(new.to(lay.key_bases.dtype).abs().max())  # NaN stays NaN, which the check refuses
        check_fp16_range(largest, largest)


def write(lay: PackedLayout, which: str, count: torch.Tensor, new: torch.Tensor, eager: bool) -> tuple[int, torch.Tensor] | None:
    """Store the coefficients ``new`` (N, H, n, r) of tokens ``count .. count + n - 1`` of side
    ``which`` in place (M11.8 step 1), rounded to the layout's dtype first, as a state holds them.
    ``eager``: the count may be read on the host (range checks; a block of low-bit keys in one pass).

    For a block of low-bit keys (eager, n > 1), returns ``(first, rows)``: the float rows of
    slots ``first .. count + n - 1`` from the start of the group ``count`` falls in, the keys
    that queries inside the block see unquantised until their group completes (M11.8 step 3)."""
    fmt = lay.side_format(which)
    coef = getattr(lay, f"{which}_coef")
    new = new.to(lay.key_bases.dtype)
    n = new.shape[2]
    positions = torch.arange(n, device=coef.device) + count
    if fmt.per_token_scale:  # spec A10
        codes, scale = quantize_rows(new)
        coef.index_copy_(2, positions, codes)
        getattr(lay, f"{which}_scale").index_copy_(2, positions, scale)
    elif not fmt.low_bits:
        coef.index_copy_(2, positions, new.to(coef.dtype))
    elif which == "value":  # Q1 per token
        q, scale, zero = quantize_groups(new, fmt.low_bits, axis=-1, check_range=eager)
        coef.index_copy_(2, positions, pack(q, fmt.low_bits))
        lay.value_token_scale.index_copy_(2, positions, scale)
        lay.value_token_zero.index_copy_(2, positions, zero)
    elif eager and n > 1:  # Q2.1 as the state appends: whole groups at once, the rest to the tail
        start = int(count)
        first = start // lay.group * lay.group
        before = lay.key_tail[:, :, : start - first].to(new.dtype, copy=True)  # the tail is rewritten below
        view = replace(lay)
        store_low_bit(view, "key", start, start + n, new)
        lay.key_tail.copy_(view.key_tail)
        return first, torch.cat([before, new], dim=2)
    else:
        for i in range(n):
            _write_key_token(lay, count + i, new[:, :, i : i + 1], eager)
    return None


def _write_key_token(lay: PackedLayout, position: torch.Tensor, row: torch.Tensor, eager: bool) -> None:
    """M11.8 step 1 for one low-bit key at ``position`` (a device scalar): its row into the tail
    at ``position mod G``, then the tail quantised per channel (Q1) as group ``position // G``."""
    G, bits = lay.group, lay.side_format("key").low_bits
    slot, group = (position % G).view(1), (position // G).view(1)
    lay.key_tail.index_copy_(2, slot, row.to(lay.key_tail.dtype))
    q, scale, zero = quantize_groups(lay.key_tail, bits, axis=-2, check_range=eager)
    lay.key_coef.index_copy_(2, group * G + torch.arange(G, device=slot.device), pack(q, bits))
    lay.key_group_scale.index_copy_(2, group, scale[:, :, None])
    lay.key_group_zero.index_copy_(2, group, zero[:, :, None])


def read(lay: PackedLayout, which: str, count: torch.Tensor, dtype: torch.dtype, length: int) -> torch.Tensor:
    """Side ``which``'s coefficients of slots ``0 .. length - 1`` as every reader of the format
    reads them (A10 step 3; Q2.2: a key from its group's codes when the group is complete, else
    from the tail), in ``dtype``: (N, H, length, r). Slots from ``count`` on hold no token."""
    fmt = lay.side_format(which)
    coef = getattr(lay, f"{which}_coef")
    if fmt.per_token_scale:
        return dequantize_rows(coef[:, :, :length], getattr(lay, f"{which}_scale")[:, :, :length], dtype)
    if not fmt.low_bits:
        return coef[:, :, :length].to(dtype)
    width = getattr(lay, f"{which}_bases").shape[3]
    q = unpack(coef, fmt.low_bits, width)
    if which == "value":
        return dequantize_groups(q, lay.value_token_scale, lay.value_token_zero, -1, dtype)[:, :, :length]
    N, H, rows, _ = q.shape
    G = lay.group
    coded = dequantize_groups(q.reshape(N, H, rows // G, G, width), lay.key_group_scale, lay.key_group_zero, -2, dtype).reshape(N, H, rows, width)
    slots = torch.arange(rows, device=q.device)
    complete = count // G * G
    tail = lay.key_tail.index_select(2, (slots - complete).clamp(0, G - 1)).to(dtype)
    return torch.where((slots >= complete)[:, None], tail, coded)[:, :, :length]
