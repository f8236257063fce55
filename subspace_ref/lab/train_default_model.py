r"""Train the project's default byte-level Llama on the Python standard library.

Usage::

    python -m subspace_ref.lab.train_default_model --out subspace_ref/data/stdlib_llama

Trains from scratch with a fixed seed (AdamW, linear warm-up then cosine decay), first on
random 256-byte windows of the training stream, then on random 1024-byte windows, so the
model is trained at its full context length. It writes ``model.safetensors`` (float32),
``config.json`` and ``training_report.json`` (corpus statistics and hash, the schedule, wall
time, the final training loss, the held-out loss in nats/byte and bits/byte, and the held-out
loss of an interpolated Witten-Bell byte n-gram baseline fit on the training bytes).

The defaults take about 35 minutes on one CPU thread (``--threads 1``) and stay well under an
hour on 2 CPU cores. See :mod:`subspace_ref.lab.corpus` for the corpus and its split.

The shipped model then continued from those weights (``--init``) in four stages, because a
model trained on code alone never learned to copy and so could not do needle recall
(:mod:`subspace_ref.lab.tasks.needle`): rows with copied spans (:func:`insert_copies`) and rows
whose second half repeats the first (:func:`insert_repeats`, some of random printable bytes)::

    train_default_model --init BASE --out S1 --short-steps 0 --long-steps 500 --copy-frac 0.5 --copies 3 --warmup 20 --lr 1e-3 --final-lr-frac 0.1
    train_default_model --init S1 --out S2 --threads 2 --short-steps 0 --long-steps 600 \
        --copy-frac 0.4 --copies 3 --repeat-frac 0.3 --warmup 30 --lr 2e-3 --final-lr-frac 0.1
    train_default_model --init S2 --out S3 --threads 2 --short-steps 900 --short-len 512 --short-batch 16 --long-steps 0 \
        --copy-frac 0.3 --copies 2 --repeat-frac 0.5 --random-repeat-share 0.4 --warmup 30 --lr 3e-3 --final-lr-frac 0.1
    train_default_model --init S3 --out S4 --threads 2 --short-steps 0 --long-steps 400 \
        --copy-frac 0.3 --copies 2 --repeat-frac 0.5 --random-repeat-share 0.4 --warmup 20 --lr 1.5e-3 --final-lr-frac 0.1

Each stage's ``training_report.json`` nests the report of the weights it started from
(``training.init``), so the shipped report records the whole lineage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from subspace_ref.lab import corpus

LN2 = math.log(2.0)

#: The architecture of the default model.
DEFAULT_ARCH = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    initializer_range=0.02,
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
    hidden_act="silu",
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


# --------------------------------------------------------------------------- n-gram baseline


class ByteNGram:
    """Interpolated Witten-Bell byte n-gram model (contexts of 0 .. order-1 bytes).

    ``P_k(x | c) = (N(c, x) + T(c) * P_{k-1}(x | c')) / (N(c) + T(c))`` where ``c'`` drops the
    oldest byte of ``c``, ``T(c)`` is the number of distinct bytes seen after ``c``, and a context
    never seen backs off entirely to ``P_{k-1}``. The order-0 model is add-one smoothed unigram.
    Fit on the training stream (file boundaries ignored, as in training).
    """

    def __init__(self, train: np.ndarray, order: int = 4):
        if not 1 <= order <= 7:
            raise ValueError("order must be in 1..7")
        self.order = order
        x = np.asarray(train, dtype=np.int64)
        counts = np.bincount(x, minlength=256).astype(np.float64)
        self.unigram = (counts + 1.0) / (counts.sum() + 256.0)
        self.tables = []  # per context length k >= 1: (pair codes, pair counts, ctx codes, ctx counts, ctx types)
        for k in range(1, order):
            code = np.zeros(len(x) - k, dtype=np.int64)
            for j in range(k + 1):  # bytes x[t-k .. t] -> code, target byte lowest
                code = (code << 8) | x[j : len(x) - k + j]
            pairs, pair_n = np.unique(code, return_counts=True)
            ctx_of_pair = pairs >> 8
            ctxs, first, ctx_types = np.unique(ctx_of_pair, return_index=True, return_counts=True)
            ctx_n = np.add.reduceat(pair_n, first)
            self.tables.append((pairs, pair_n, ctxs, ctx_n, ctx_types))

    @staticmethod
    def _lookup(keys: np.ndarray, values: np.ndarray, query: np.ndarray) -> np.ndarray:
        i = np.searchsorted(keys, query)
        i = np.minimum(i, len(keys) - 1)
        hit = keys[i] == query
        return np.where(hit, values[i], 0)

    def target_probs(self, windows: np.ndarray) -> np.ndarray:
        """P(w[:, t] | w[:, :t]) for t = 1 .. L-1, an ``(n, L-1)`` array; context within the window."""
        w = np.asarray(windows, dtype=np.int64)
        if w.ndim == 1:
            w = w[None]
        n, L = w.shape
        tgt = w[:, 1:]
        p = self.unigram[tgt]
        t_idx = np.arange(1, L)[None, :]
        for k, (pairs, pair_n, ctxs, ctx_n, ctx_types) in enumerate(self.tables, start=1):
            ctx = np.zeros((n, L - 1), dtype=np.int64)
            for j in range(k, 0, -1):  # byte at t-j, oldest first
                prev = np.zeros((n, L - 1), dtype=np.int64)
                prev[:, j - 1 :] = w[:, : L - j]
                ctx = (ctx << 8) | prev
            pair = (ctx << 8) | tgt
            c_ctx = self._lookup(ctxs, ctx_n, ctx).astype(np.float64)
            t_ctx = self._lookup(ctxs, ctx_types, ctx).astype(np.float64)
            c_pair = self._lookup(pairs, pair_n, pair).astype(np.float64)
            seen = (c_ctx > 0) & (t_idx >= k)  # full context available inside the window
            p_new = (c_pair + t_ctx * p) / np.maximum(c_ctx + t_ctx, 1.0)
            p = np.where(seen, p_new, p)
        return p

    def loss(self, windows: np.ndarray) -> float:
        """Mean negative log-likelihood in nats/byte over targets 1..L-1 of the windows."""
        return float(-np.log(self.target_probs(windows)).mean())


# --------------------------------------------------------------------------- model helpers


def make_config(**overrides):
    from transformers import LlamaConfig

    arch = dict(DEFAULT_ARCH)
    arch.update(overrides)
    return LlamaConfig(**arch)


def model_loss(model, windows, batch_size: int = 16, per_position: bool = False):
    """Mean NLL (nats/byte) of ``model`` over targets 1..L-1 of ``windows`` (float32 forward).

    With ``per_position`` also returns the mean loss at each target position (array of L-1).
    """
    import torch
    import torch.nn.functional as F

    w = torch.as_tensor(np.asarray(windows), dtype=torch.long)
    if w.ndim == 1:
        w = w[None]
    total = torch.zeros(w.shape[1] - 1, dtype=torch.float64)
    with torch.no_grad():
        for i in range(0, w.shape[0], batch_size):
            x = w[i : i + batch_size]
            logits = model(input_ids=x).logits[:, :-1].float()
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none")
            total += nll.view(x.shape[0], -1).double().sum(0)
    pos = (total / w.shape[0]).numpy()
    return (float(pos.mean()), pos) if per_position else float(pos.mean())


def save_model(model, out: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu").float().contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.to_json_file(str(out / "config.json"))


# --------------------------------------------------------------------------- training


def insert_copies(x, rng: np.random.Generator, frac: float, copies: int, span=(40, 96)):
    """Copy spans within rows, in place: in a ``frac`` share of the rows, ``copies`` times, a span
    of ``span`` bytes from the first half of the row is written again at a random later place.

    A model only predicts the copied bytes well if it can find the earlier occurrence of the
    span's first bytes and read on from there (an induction circuit). Byte-level code barely
    needs that, and the model trained on code alone never learned it, so needle recall
    (:mod:`subspace_ref.lab.tasks.needle`) was out of its reach whatever the cache.
    """
    n, L = x.shape
    for row in np.flatnonzero(rng.random(n) < frac):
        for _ in range(copies):
            s = int(rng.integers(span[0], span[1] + 1))
            src = int(rng.integers(0, L // 2 - s))
            dst = int(rng.integers(src + s, L - s + 1))
            x[row, dst : dst + s] = x[row, src : src + s].clone()
    return x


def insert_repeats(x, rng: np.random.Generator, frac: float, random_share: float = 0.0):
    """In a ``frac`` share of the rows, in place, the second half repeats the first half exactly:
    the strongest signal for an induction circuit (every byte of the second half follows from
    finding its predecessor in the first half), the one induction-head studies train on. In a
    ``random_share`` of those rows the first half is first replaced by random printable bytes,
    which only copying can predict."""
    n, L = x.shape
    half = L // 2
    for row in np.flatnonzero(rng.random(n) < frac):
        if rng.random() < random_share:
            x[row, :half] = x.new_tensor(rng.integers(32, 127, size=half))
        x[row, half : 2 * half] = x[row, :half].clone()
    return x


def lr_at(step: int, total: int, peak: float, warmup: int, final_frac: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    prog = (step - warmup) / max(1, total - warmup)
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--short-steps", type=int, default=450, help="steps on short windows")
    ap.add_argument("--short-len", type=int, default=256)
    ap.add_argument("--short-batch", type=int, default=32)
    ap.add_argument("--long-steps", type=int, default=300, help="steps on full-context windows")
    ap.add_argument("--long-len", type=int, default=1024)
    ap.add_argument("--long-batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=75)
    ap.add_argument("--final-lr-frac", type=float, default=0.05)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument(
        "--bf16", action=argparse.BooleanOptionalAction, default=True, help="bfloat16 autocast for the training forward/backward (weights stay float32)"
    )
    ap.add_argument("--eval-windows", type=int, default=256, help="held-out windows of --long-len for the report")
    ap.add_argument("--eval-seed", type=int, default=0)
    ap.add_argument("--ngram-order", type=int, default=4)
    ap.add_argument("--layers", type=int, default=DEFAULT_ARCH["num_hidden_layers"])
    ap.add_argument("--init", type=Path, default=None, help="start from this saved model instead of from scratch")
    ap.add_argument("--copy-frac", type=float, default=0.0, help="share of training rows given copied spans (insert_copies)")
    ap.add_argument("--copies", type=int, default=2, help="copied spans per chosen row")
    ap.add_argument("--repeat-frac", type=float, default=0.0, help="share of training rows whose second half repeats the first (insert_repeats)")
    ap.add_argument("--random-repeat-share", type=float, default=0.0, help="share of the repeated rows made of random printable bytes")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from tqdm import tqdm
    from transformers import LlamaForCausalLM

    import transformers

    torch.set_num_threads(args.threads)
    t_start = time.time()

    stats = corpus.corpus_stats()
    train = corpus.load_stream("train")
    heldout = corpus.load_stream("heldout")
    train_t = torch.from_numpy(train.astype(np.int64))

    cfg = make_config(num_hidden_layers=args.layers, max_position_embeddings=max(1024, args.long_len))
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg) if args.init is None else LlamaForCausalLM.from_pretrained(str(args.init), torch_dtype=torch.float32)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    phases = [(args.short_steps, args.short_len, args.short_batch), (args.long_steps, args.long_len, args.long_batch)]
    total = sum(p[0] for p in phases)
    rng = np.random.default_rng(args.seed)
    history = []
    step = 0
    t_train = time.time()
    bar = tqdm(total=total, desc="train", unit="step", dynamic_ncols=True, mininterval=5.0)
    last_losses: list[float] = []
    for n_steps, length, batch in phases:
        last_losses = []
        for _ in range(n_steps):
            lr = lr_at(step, total, args.lr, args.warmup, args.final_lr_frac)
            for g in opt.param_groups:
                g["lr"] = lr
            starts = torch.from_numpy(rng.integers(0, len(train) - length + 1, size=batch))
            x = train_t[starts[:, None] + torch.arange(length)[None, :]]
            if args.copy_frac > 0:
                x = insert_copies(x, rng, args.copy_frac, args.copies)
            if args.repeat_frac > 0:
                x = insert_repeats(x, rng, args.repeat_frac, args.random_repeat_share)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            opt.step()
            lv = float(loss.detach())
            if not math.isfinite(lv):
                raise FloatingPointError(f"non-finite loss at step {step}")
            last_losses.append(lv)
            if step % 10 == 0 or step == total - 1:
                history.append(
                    {"step": step, "len": length, "loss": round(lv, 4), "lr": lr, "grad_norm": round(float(gnorm), 4), "t": round(time.time() - t_train, 1)}
                )
            bar.set_postfix(loss=f"{lv:.3f}", bpb=f"{lv / LN2:.3f}", len=length, refresh=False)
            bar.update(1)
            step += 1
    bar.close()
    train_seconds = time.time() - t_train
    final_train = float(np.mean(last_losses[-20:])) if last_losses else float("nan")

    # ---- evaluation (float32, eval mode)
    model.eval()
    t_eval = time.time()
    windows = corpus.eval_windows(args.eval_windows, args.long_len, args.eval_seed, stream=heldout)
    ho_loss, per_pos = model_loss(model, windows, per_position=True)
    eval_seconds = time.time() - t_eval
    buckets = {}
    for lo, hi in [(1, 64), (64, 256), (256, 512), (512, args.long_len)]:
        if lo < args.long_len:
            buckets[f"{lo}-{hi - 1}"] = round(float(per_pos[lo - 1 : hi - 1].mean()) / LN2, 4)

    t_ng = time.time()
    ngram_report = {}
    for order in sorted({2, 3, args.ngram_order, 5}):
        ng = ByteNGram(train, order=order)
        l_win = ng.loss(windows)
        l_full = ng.loss(corpus.contiguous_windows(heldout, args.long_len))
        ngram_report[str(order)] = {
            "eval_windows_nats_per_byte": round(l_win, 5),
            "eval_windows_bits_per_byte": round(l_win / LN2, 5),
            "heldout_contiguous_nats_per_byte": round(l_full, 5),
            "heldout_contiguous_bits_per_byte": round(l_full / LN2, 5),
        }
        del ng
    ngram_seconds = time.time() - t_ng
    base = ngram_report[str(args.ngram_order)]

    out: Path = args.out
    save_model(model, out)
    report = {
        "model": {
            "architecture": "LlamaForCausalLM",
            "parameters": int(n_params),
            "config": {k: v for k, v in cfg.to_dict().items() if k in DEFAULT_ARCH or k in ("rope_theta", "rope_parameters")},
            "tokenizer": "bytes: token id = byte value (0..255), no special tokens",
            "weights_dtype": "float32",
        },
        "corpus": stats.as_dict(),
        "training": {
            "seed": args.seed,
            "threads": args.threads,
            "init": None
            if args.init is None
            else {
                "from": str(args.init),
                "its_training": json.loads((args.init / "training_report.json").read_text()).get("training"),
            },
            "copy_spans": {"row_share": args.copy_frac, "per_row": args.copies, "function": "insert_copies"},
            "repeated_halves": {"row_share": args.repeat_frac, "random_share": args.random_repeat_share, "function": "insert_repeats"},
            "phases": [{"steps": s, "window": l, "batch": b, "tokens": s * l * b} for s, l, b in phases],
            "total_steps": total,
            "tokens_seen": int(sum(s * l * b for s, l, b in phases)),
            "optimizer": {
                "name": "AdamW",
                "lr": args.lr,
                "betas": [0.9, 0.95],
                "weight_decay": args.weight_decay,
                "warmup_steps": args.warmup,
                "schedule": "linear warm-up then cosine",
                "final_lr_frac": args.final_lr_frac,
                "grad_clip": args.grad_clip,
            },
            "bf16_autocast": bool(args.bf16),
            "train_seconds": round(train_seconds, 1),
            "final_train_loss_nats_per_byte": round(final_train, 5),
            "final_train_loss_bits_per_byte": round(final_train / LN2, 5),
            "final_train_loss_note": f"mean of the last {min(20, len(last_losses))} steps at window {phases[-1][1]}",
            "history": history,
        },
        "evaluation": {
            "heldout_windows": {
                "n": args.eval_windows,
                "length": args.long_len,
                "seed": args.eval_seed,
                "function": "subspace_ref.lab.corpus.eval_windows",
                "targets": "positions 1..length-1 of each window, context within the window",
            },
            "heldout_loss_nats_per_byte": round(ho_loss, 5),
            "heldout_loss_bits_per_byte": round(ho_loss / LN2, 5),
            "heldout_bits_per_byte_by_position": buckets,
            "ngram_baseline": {
                "kind": f"interpolated Witten-Bell byte {args.ngram_order}-gram fit on the training bytes",
                "order": args.ngram_order,
                "heldout_loss_nats_per_byte": base["eval_windows_nats_per_byte"],
                "heldout_loss_bits_per_byte": base["eval_windows_bits_per_byte"],
            },
            "ngram_by_order": ngram_report,
            "eval_seconds": round(eval_seconds, 1),
            "ngram_seconds": round(ngram_seconds, 1),
        },
        "environment": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "numpy": np.__version__,
            "platform": platform.platform(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
        },
        "total_seconds": round(time.time() - t_start, 1),
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"held-out {ho_loss:.4f} nats/byte ({ho_loss / LN2:.3f} bits/byte); "
        f"{args.ngram_order}-gram {base['eval_windows_nats_per_byte']:.4f} nats/byte "
        f"({base['eval_windows_bits_per_byte']:.3f} bits/byte); wrote {out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
