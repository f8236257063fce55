"""Bases for any local transformers checkpoint at a requested compression ratio: the front door
(``subspace-kv calibrate --model PATH --compression-ratio R [--sinks S] [--window W] [--text FILE] [--loss fisher|proxy]``;
spec/models.md M10, spec/layer_state.md L6).

Calibration text: ``--text FILE``, else Python standard-library sources (present wherever
Python is). Tokens: the checkpoint's own tokenizer when it has one, else UTF-8 bytes for a
byte-level model (vocabulary of at least 256, as the shipped model).

Rules:

* ``allocator`` (the default): the measured-loss allocator (:mod:`subspace_ref.allocation`) over
  every candidate of each KV head (post-RoPE, pre-RoPE, plane and identity key bases; subspace
  and identity value bases; float/int8/int4/int2 coefficients), ``R`` of the fp16 cache's bytes
  with ``S`` sinks and a ``W``-token exact window counted; the loss is ``fisher`` (the default:
  errors weighted by the gradient of the model's next-token loss) or ``proxy``
  (:data:`subspace_ref.hf.calibration_losses.LOSSES`). Without ``--sinks``/``--window`` the
  allocator also chooses them, among :data:`subspace_ref.hf.calibration_losses.EXACT`, by the
  same loss (spec/layer_state.md L6.2). Pre-RoPE keys are capped at a quarter of the head size
  by default (``--max-pre-rope-rank``: :data:`AUTO_PRE_ROPE_RANK`, ``none`` lifts the cap; L6.4:
  their per-token rebuild is then at most d²/4 multiply-adds). The artifact carries the
  allocation, and ``compress(model, bases)`` decodes exactly it;
* ``energy``: energy ranks (spec A5 step 2) at the largest energy whose per-head ranks keep the
  coefficients within the ratio, ``sum (r_k + r_v) <= R * sum (d + d_v)``, float coefficients of
  post-RoPE bases, no window. On RoPE models its keys lose badly (docs/baselines.md).
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from subspace_ref.calibration import energy_rank
from subspace_ref.hf.artifact import CalibratedBases
from subspace_ref.hf.capture import ModelCapture

RULES = ("allocator", "energy")

#: ``max_pre_rope_rank``'s default: a quarter of the model's head size (spec/layer_state.md L6.4;
#: on the shipped model it decodes faster at equal perplexity and agreement, docs/hf.md "Speed or accuracy")
AUTO_PRE_ROPE_RANK = "auto"


def pre_rope_rank_argument(text: str) -> int | str | None:
    """``--max-pre-rope-rank``'s value: "auto" (:data:`AUTO_PRE_ROPE_RANK`), "none" (no cap) or a rank."""
    if text in (AUTO_PRE_ROPE_RANK, "none"):
        return None if text == "none" else text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, none or a rank >= 1, got {text!r}") from None


def resolve_pre_rope_rank(max_pre_rope_rank, head_dim: int) -> int | None:
    """The cap ``max_pre_rope_rank`` stands for on a model of key size ``head_dim``: "auto" is
    ``max(1, head_dim // 4)``; None (no cap) and ranks as given."""
    return max(1, head_dim // 4) if max_pre_rope_rank == AUTO_PRE_ROPE_RANK else max_pre_rope_rank


def stdlib_text(limit_chars: int) -> str:
    """Up to ``limit_chars`` characters of the standard library's sources (sorted paths)."""
    parts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= limit_chars:
            break
    return "".join(parts)[:limit_chars]


def token_ids(path: str, text: str, vocab_size: int) -> np.ndarray:
    """``text`` tokenized by the checkpoint's tokenizer, or as UTF-8 bytes for a byte-level model."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    if tokenizer is not None:
        return np.asarray(tokenizer(text)["input_ids"], dtype=np.int64)
    if vocab_size < 256:
        raise ValueError(f"model {path!r} has no tokenizer and a vocabulary of {vocab_size} < 256: give token ids another way")
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def energy_for_ratio(cap: ModelCapture, ratio: float) -> tuple[float, float]:
    """The largest energy (to 1e-4) whose per-head energy ranks keep sum(r_k + r_v) within
    ``ratio`` of sum(d + d_v); returns (energy, achieved coefficient fraction)."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"compression_ratio must lie in (0, 1], got {ratio}")
    spectra = cap.spectra()
    full = sum(layer.keys.shape[0] * (layer.keys.shape[2] + layer.values.shape[2]) for layer in cap.layers)

    def fraction(e: float) -> float:
        used = sum(energy_rank(s[h], e) for sp in spectra for side in ("keys", "values") for s in (sp[side],) for h in range(s.shape[0]))
        return used / full

    lo, hi = 0.0, 1.0
    if fraction(1.0) <= ratio:
        return 1.0, fraction(1.0)
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fraction(mid) <= ratio else (lo, mid)
    if lo == 0.0:
        raise ValueError(f"compression_ratio {ratio} is below one rank per head ({fraction(1e-9):.3f} of the stock bytes)")
    return lo, fraction(lo)


def calibration_windows(path, config, text: str | None, tokens: int, context: int | None) -> np.ndarray:
    """(n, T) token-id windows of the calibration text, T = ``context`` (default: the model's
    limit, at most 1024), n T <= ``tokens``."""
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    limit = int(getattr(text_config, "max_position_embeddings", 1024) or 1024)
    context = min(context or 1024, limit)
    ids = token_ids(str(path), text if text is not None else stdlib_text(8 * tokens), text_config.vocab_size)
    usable = min(len(ids), tokens) // context * context
    if usable == 0:
        raise ValueError(f"the calibration text gives {len(ids)} tokens, fewer than one window of {context}")
    return ids[:usable].reshape(-1, context)


def calibrate_checkpoint(path, ratio: float, *, rule: str = "allocator", sinks: int | None = None, window: int | None = None, text: str | None = None,
                         tokens: int = 8192, context: int | None = None, group: int = 32, progress: bool = False, loss: str = "fisher",
                         key_bases: tuple[str, ...] | str | None = None, max_pre_rope_rank: int | str | None = AUTO_PRE_ROPE_RANK) -> CalibratedBases:
    """Calibrated bases for the checkpoint at ``path`` at ``ratio`` of the stock cache (module
    docstring: ``rule``; ``sinks``, ``window`` and ``loss`` for the allocator), from ``tokens``
    calibration tokens in windows of ``context``. ``sinks`` and ``window`` both None: the allocator
    chooses them by its loss (module docstring); one None: 0. ``key_bases``: the key kinds the
    allocator may choose (None: all of :data:`subspace_ref.allocation.KEY_BASES`; spec/layer_state.md
    L6.3). ``max_pre_rope_rank``: the highest pre-RoPE key rank the allocator may choose ("auto", the
    default: a quarter of the head size; None: any; L6.4: each such key costs rank x d multiply-adds
    per token to decode). Bad input raises ValueError naming the argument, before any model runs."""
    from subspace_ref.allocation import KEY_BASES, check_key_bases, check_max_pre_rope_rank
    from subspace_ref.hf.calibration_losses import LOSSES
    from subspace_ref.models.default_model import load_model

    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    defaults = sinks is None and window is None and rule == "allocator"
    sinks, window = 0 if sinks is None else sinks, 0 if window is None else window
    if not (isinstance(ratio, (int, float)) and 0.0 < ratio <= 1.0):
        raise ValueError(f"compression_ratio must lie in (0, 1], got {ratio!r}")
    for name, value in (("sinks", sinks), ("window", window)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if rule == "energy" and (sinks or window):
        raise ValueError("sinks, window: the energy rule keeps no exact tokens; use rule='allocator'")
    key_bases = KEY_BASES if key_bases is None else check_key_bases(key_bases)
    if rule == "energy" and key_bases != KEY_BASES:
        raise ValueError("key_bases: the energy rule keeps post-RoPE keys; use rule='allocator'")
    if max_pre_rope_rank != AUTO_PRE_ROPE_RANK:
        check_max_pre_rope_rank(max_pre_rope_rank)
        if rule == "energy" and max_pre_rope_rank is not None:
            raise ValueError("max_pre_rope_rank: the energy rule keeps post-RoPE keys; use rule='allocator'")
    model, config = load_model(path)
    windows = calibration_windows(path, config, text, tokens, context)
    facts = dict(source=str(path), tokens=int(windows.size), context=int(windows.shape[1]), compression_ratio_asked=ratio, rule=rule)
    if rule == "energy":
        from subspace_ref.hf.calibration_losses import capture_windows

        cap = capture_windows(model, windows, queries=True, batch=1)
        energy, achieved = energy_for_ratio(cap, ratio)
        facts |= dict(energy=energy, coefficient_fraction=achieved, gamma="mse")
        return CalibratedBases.for_model(config, cap.calibrate(energy=energy, gamma="mse"), calibration=facts)
    from subspace_ref.hf.calibration_losses import EXACT, calibration_losses

    cal = calibration_losses(model, windows, group=group, batch=1, progress=progress, loss=loss,
                             exact=EXACT if defaults or loss != "fisher" else ((sinks, window),))
    geom = cal.geometry(model)
    max_pre_rope_rank = resolve_pre_rope_rank(max_pre_rope_rank, geom.head_dim)
    if defaults:
        allocation = cal.allocate_best(model, compression_ratio=ratio, key_bases=key_bases, max_pre_rope_rank=max_pre_rope_rank)  # the window chosen by the loss (L6.2)
        sinks, window = allocation.sinks, allocation.window
    else:
        allocation = cal.allocate(model, compression_ratio=ratio, window=window, sinks=sinks, key_bases=key_bases, max_pre_rope_rank=max_pre_rope_rank)
    facts |= dict(sinks=sinks, window=window, loss=loss, loss_tokens=cal.loss_tokens, bytes_per_token=allocation.bytes(geom).per_token,
                  fraction_of_fp16=allocation.bytes(geom).fraction)
    return CalibratedBases.for_model(config, cal.bases(allocation), allocation=allocation, calibration=facts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a local checkpoint directory (or 'default', the shipped model)")
    parser.add_argument("--compression-ratio", type=float, required=True, help="bytes of the compressed cache as a fraction of the fp16 cache, in (0, 1]")
    parser.add_argument("--bases-out", type=Path, required=True, help="directory the bases and their allocation are saved to")
    parser.add_argument("--sinks", type=int, default=None, help="first tokens kept exact (allocator; default: chosen with --window by the loss; 0 if only --window is given)")
    parser.add_argument("--window", type=int, default=None, help="last tokens kept exact (allocator; default: chosen with --sinks by the loss; 0 if only --sinks is given)")
    parser.add_argument("--loss", choices=("fisher", "proxy"), default="fisher",
                        help="allocator loss: fisher (default), errors weighted by the gradient of the next-token loss; proxy, per-head output errors")
    parser.add_argument("--key-bases", default=None,
                        help="comma-separated key kinds the allocator may choose, of post_rope,pre_rope,plane,identity (default all); "
                             "without pre_rope no key is rebuilt and rotated per token: faster decoding, more loss at equal bytes")
    parser.add_argument("--max-pre-rope-rank", type=pre_rope_rank_argument, default=AUTO_PRE_ROPE_RANK,
                        help="highest rank of a pre-RoPE key: each costs rank x head size multiply-adds per token to decode "
                             "(default auto: a quarter of the head size; none: no cap)")
    parser.add_argument("--text", type=Path, default=None, help="calibration text (default: Python standard-library sources)")
    parser.add_argument("--calibration-tokens", type=int, default=8192, help="calibration tokens (default 8192)")
    parser.add_argument("--context", type=int, default=None, help="calibration window length (default: the model's limit, at most 1024)")
    parser.add_argument("--group", type=int, default=32, help="tokens per key group of int4/int2 keys (default 32)")
    parser.add_argument("--rule", choices=RULES, default="allocator", help="allocator (default): measured losses per head; energy: energy ranks, float, no window")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    """``subspace-kv calibrate``: calibrate, save, and print what was chosen."""
    start = time.perf_counter()
    text = args.text.read_text(encoding="utf-8", errors="replace") if args.text else None
    bases = calibrate_checkpoint(args.model, args.compression_ratio, rule=args.rule, sinks=args.sinks, window=args.window, text=text,
                                 tokens=args.calibration_tokens, context=args.context, group=args.group, progress=not args.no_progress, loss=args.loss,
                                 key_bases=args.key_bases, max_pre_rope_rank=args.max_pre_rope_rank)
    out = bases.save_pretrained(args.bases_out)
    c = bases.calibration
    if bases.allocation is None:
        print(f"calibrate: energy {c['energy']:.4f} -> coefficients {c['coefficient_fraction']:.3f} of the stock cache (asked {c['compression_ratio_asked']})")
        for i, b in enumerate(bases.layers):
            print(f"  layer {i}: key ranks {list(b.rank_k)}, value ranks {list(b.rank_v)}")
    else:
        cap = bases.allocation.meta.get("max_pre_rope_rank")  # recorded by allocate (L6.4)
        print(f"calibrate: allocator, {c['bytes_per_token']:.1f} bytes/token = {c['fraction_of_fp16']:.3f} of the fp16 cache "
              f"(asked {c['compression_ratio_asked']}, sinks {c['sinks']}, window {c['window']}, loss {c['loss']}, rule {bases.allocation.meta.get('rule')}, "
              f"pre-RoPE rank {'uncapped' if cap is None else f'<= {cap}'})")
        for i, layer in enumerate(bases.allocation.heads):
            shown = "; ".join(f"K {h.key_basis} r={h.rank_k} {h.bits_k}b, V {h.value_basis} r={h.rank_v} {h.bits_v}b" for h in layer)
            print(f"  layer {i}: {shown}")
    print(f"  {c['tokens']} tokens in windows of {c['context']}, {time.perf_counter() - start:.1f} s -> {out}", file=sys.stderr)
    return 0


__all__ = ["RULES", "add_arguments", "calibrate_checkpoint", "calibration_windows", "energy_for_ratio", "run", "stdlib_text", "token_ids"]
