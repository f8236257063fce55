"""Static bases for any local transformers checkpoint at a requested compression ratio
(``subspace-kv calibrate --model PATH --compression-ratio R --bases-out DIR``; spec/models.md M10).

Calibration text: ``--text FILE``, else Python standard-library sources (present wherever
Python is). Tokens: the checkpoint's own tokenizer when it has one, else UTF-8 bytes for a
byte-level model (vocabulary of at least 256, as the shipped model). Ranks: energy ranks
(spec A5 step 2) at the largest energy whose per-head ranks keep the coefficients within the
ratio: ``sum (r_k + r_v) <= R * sum (d + d_v)`` over layers and heads, i.e. coefficient bytes
at most R times the stock cache's in the same dtype (bases are a fixed cost on top, stated in
the saved record). A per-head allocator can replace the energy rule: the artifact's
``allocation`` field stores its record.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import numpy as np
import torch

from subspace_ref.calibration import energy_rank
from subspace_ref.hf.artifact import CalibratedBases
from subspace_ref.hf.capture import ModelCapture, capture


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


def calibrate_checkpoint(path: str, ratio: float, *, text: str | None = None, tokens: int = 8192, context: int | None = None) -> CalibratedBases:
    """Calibrate static bases (γ fitted by MSE on the recorded queries) for the checkpoint at
    ``path`` on ``tokens`` calibration tokens in windows of ``context`` (default: the model's
    limit, at most 1024)."""
    from subspace_ref.models.default_model import load_model

    model, config = load_model(path)
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    limit = int(getattr(text_config, "max_position_embeddings", 1024) or 1024)
    context = min(context or 1024, limit)
    ids = token_ids(str(path), text if text is not None else stdlib_text(8 * tokens), text_config.vocab_size)
    usable = min(len(ids), tokens) // context * context
    if usable == 0:
        raise ValueError(f"the calibration text gives {len(ids)} tokens, fewer than one window of {context}")
    windows = [torch.as_tensor(w)[None] for w in ids[:usable].reshape(-1, context)]
    cap = capture(model, windows, queries=True)
    energy, achieved = energy_for_ratio(cap, ratio)
    bases = cap.calibrate(energy=energy, gamma="mse")
    facts = dict(
        source=str(path),
        tokens=usable,
        context=context,
        compression_ratio_asked=ratio,
        energy=energy,
        coefficient_fraction=achieved,
        rule="energy ranks",
        gamma="mse",
    )
    return CalibratedBases.for_model(config, bases, calibration=facts)


def run(args: argparse.Namespace) -> int:
    """``subspace-kv calibrate --model PATH --compression-ratio R`` (options defined in
    subspace_ref/experiments/calibrate.py, which hands the run here)."""
    text = args.text.read_text(encoding="utf-8", errors="replace") if args.text else None
    bases = calibrate_checkpoint(args.model, args.compression_ratio, text=text, tokens=args.calibration_tokens, context=args.context)
    out = bases.save_pretrained(args.bases_out or Path(args.out) / "bases")
    c = bases.calibration
    print(
        f"calibrate: {len(bases.layers)} layers, energy {c['energy']:.4f} -> coefficients {c['coefficient_fraction']:.3f} of the stock cache "
        f"(asked {c['compression_ratio_asked']}), {c['tokens']} tokens in windows of {c['context']} -> {out}"
    )
    for i, b in enumerate(bases.layers):
        print(f"  layer {i}: key ranks {list(b.rank_k)}, value ranks {list(b.rank_v)}")
    return 0


__all__ = ["calibrate_checkpoint", "energy_for_ratio", "run", "stdlib_text", "token_ids"]
