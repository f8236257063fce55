"""Greedy agreement with the stock cache: how many of the tokens the shipped model generates
greedily through ``compress(model, bases)`` equal those it generates with transformers' own
``DynamicCache`` (issue 37; docs/hf.md).

For each compression ratio (and exact window), bases are calibrated as ``subspace-kv calibrate``
does (:func:`subspace_ref.hf.calibrate_checkpoint.calibrate_checkpoint`: the allocator, the
default standard-library calibration text). Window ``auto`` (the default) is the command's
default: sinks and window chosen by the allocator's loss; an integer W: ``--sinks`` sinks and a
W-token window. ``--loss proxy`` runs the older per-head loss for comparison. Prompts: ``--prompts`` windows of ``--prompt-bytes``
bytes from held-out files of the corpus split (:mod:`subspace_ref.lab.corpus`; none of them is
in the calibration text), each starting at the first line at or after a third of its file. Each
prompt is continued by ``--new-tokens`` greedy tokens with the stock cache and with the
compressed one. Reported per configuration, as means over the prompts:

* prefix agreement: leading generated tokens equal to the stock ones (the issue's measure);
* position-wise agreement: fraction of the positions whose tokens are equal;
* teacher-forced top-1: along the stock continuation (same prefix for both), the fraction of
  positions where the compressed cache's most likely token is the stock one; this measures
  each step alone, without a first difference changing every later prefix;
* the stock model's top-2 logit margin at the first differing position (median over the prompts
  that differ) against its median over all positions: small margins mean near-ties;
* perplexity on ``--ppl-windows`` held-out windows of 1024 tokens (seed 0: the evaluation windows
  of docs/baselines.md, whose full-cache perplexity is 2.2968), teacher-forced through the cache.

Reference rows: the page's quantised-KV rows (docs/baselines.md: 4-bit at 25%, 2-bit at 12.5%,
groups of 64) and 8-bit KV (how often a near-lossless cache changes greedy decoding), each
greedy-decoded by a full forward per step through their attention function (equal to decoding:
tests/test_baselines.py). A window that alone costs more than a ratio allows is skipped.

Usage: ``python benchmarks/greedy_agreement.py [--ratios 0.25,0.125] [--windows auto,32] [--loss fisher] [--json PATH]``
(one thread; about 3 minutes for the defaults on a shared 2-core CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

from subspace_ref.hf.calibrate_checkpoint import AUTO_PRE_ROPE_RANK, pre_rope_rank_argument
from subspace_ref.lab import corpus

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "subspace_ref" / "data" / "stdlib_llama"


def calibration_files(tokens: int) -> set[str]:
    """The standard-library files :func:`~subspace_ref.hf.calibrate_checkpoint.stdlib_text` reads
    for ``tokens`` calibration tokens (bytes): sorted top-level ``*.py`` until 8 x tokens characters."""
    used, size = set(), 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        used.add(path.name)
        size += len(path.read_text(encoding="utf-8", errors="replace"))
        if size >= 8 * tokens:
            break
    return used


def held_out_prompts(n: int, length: int, exclude: set[str], start: float = 1 / 3) -> list[tuple[str, np.ndarray]]:
    """``n`` (file, bytes) prompts of ``length`` bytes from held-out files not in ``exclude``,
    files spread evenly over the sorted held-out list, each from the first line start at or after
    ``start`` (default a third) of its file."""
    files = []
    for rel in corpus.heldout_files():
        if rel in exclude:
            continue
        data = corpus.load_file(rel)
        at = int(len(data) * start)
        while at < len(data) and at > 0 and data[at - 1] != ord("\n"):
            at += 1
        if len(data) - at >= length:
            files.append((rel, data[at : at + length]))
    if len(files) < n:
        raise ValueError(f"only {len(files)} held-out files have {length} bytes after their first third")
    pick = np.linspace(0, len(files) - 1, n).round().astype(int)
    return [files[i] for i in pick]


def leading(a: np.ndarray, b: np.ndarray) -> int:
    """Number of leading positions where ``a`` and ``b`` agree."""
    diff = np.flatnonzero(a != b)
    return int(diff[0]) if diff.size else int(a.size)


@torch.no_grad()
def greedy_quantized(model, ids: torch.Tensor, method, new_tokens: int) -> torch.Tensor:
    """Greedy continuation under a baselines method by one full forward per step (teacher-forced
    under the method equals decoding with it)."""
    from subspace_ref.lab.baselines import applied

    seq = ids
    with applied(model, method):
        for _ in range(new_tokens):
            nxt = model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    return seq[:, ids.shape[1] :]


def perplexity(model, windows: np.ndarray, states=None, method=None, batch: int = 4) -> float | None:
    """Perplexity of ``windows`` (n, T) teacher-forced through a subspace cache of ``states``, or
    under a baselines ``method`` (both None: the stock cache); None without windows."""
    from subspace_ref.hf import teacher_forced
    from subspace_ref.lab.baselines import token_logprobs

    if windows is None or not len(windows):
        return None
    nll = []
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            x = torch.as_tensor(windows[i : i + batch], dtype=torch.long)
            lp = token_logprobs(model, x, method).numpy() if states is None else teacher_forced(model, x, states).token_logprobs
            nll.append(-np.asarray(lp, dtype=np.float64))
    return float(np.exp(np.concatenate(nll).mean()))


def summarize(name: str, gen: np.ndarray, stock: np.ndarray, tf_top1: np.ndarray | None, margins: np.ndarray, second: np.ndarray,
              extra: dict) -> dict:
    """Per-prompt and mean agreement of ``gen`` (P, N) with ``stock`` (P, N); ``margins`` and
    ``second``: the stock model's top-2 logit margin and second choice at each stock position."""
    prefix = np.array([leading(g, s) for g, s in zip(gen, stock)])
    differ = [(i, p) for i, p in enumerate(prefix) if p < gen.shape[1]]
    at_first = [float(margins[i, p]) for i, p in differ]
    return dict(
        name=name,
        **extra,
        prefix=prefix.tolist(),
        mean_prefix=float(prefix.mean()),
        median_prefix=float(np.median(prefix)),
        all_equal=int((prefix == gen.shape[1]).sum()),
        mean_positionwise=float((gen == stock).mean()),
        teacher_forced_top1=None if tf_top1 is None else float(tf_top1.mean()),
        margin_at_first_difference=float(np.median(at_first)) if at_first else None,
        margins_at_first_difference=at_first,
        second_choice_at_first_difference=sum(int(gen[i, p] == second[i, p]) for i, p in differ),
        differing=len(differ),
    )


def run(args: argparse.Namespace) -> dict:
    from subspace_ref.lab.baselines import QuantizedKV, applied
    from subspace_ref.byte_convention import Geometry
    from subspace_ref.hf import compress, teacher_forced
    from subspace_ref.hf.calibrate_checkpoint import calibrate_checkpoint
    from subspace_ref.models.default_model import load_model

    torch.set_num_threads(1)
    started = time.perf_counter()
    model, config = load_model(str(args.model))
    prompts = held_out_prompts(args.prompts, args.prompt_bytes, calibration_files(args.calibration_tokens), args.prompt_start)
    ids = torch.as_tensor(np.stack([p for _, p in prompts]).astype(np.int64))
    N, L = args.new_tokens, ids.shape[1]
    stock = model.generate(ids, max_new_tokens=N, do_sample=False)[:, L:]
    seq = torch.cat([ids, stock], dim=1)
    stock_logits = teacher_forced(model, seq, keep_logits=True).logits[:, L - 1 : L - 1 + N]
    top2 = stock_logits.topk(2, dim=-1)
    margins = (top2.values[..., 0] - top2.values[..., 1]).numpy()
    second = top2.indices[..., 1].numpy()
    stock_np = stock.numpy()
    geom = Geometry.of_model(model, config.max_position_embeddings)
    ppl_ids = corpus.eval_windows(n=args.ppl_windows, length=1024, seed=0, stream=corpus.load_stream("heldout")) if args.ppl_windows else None
    stock_ppl = perplexity(model, ppl_ids)
    rows, skipped = [], []

    def reference(bits: int, ratio: float | None) -> None:
        t0 = time.perf_counter()
        m = QuantizedKV(bits=bits, group=64)
        gen = greedy_quantized(model, ids, m, N).numpy()
        with torch.no_grad(), applied(model, m):
            logits = model(input_ids=seq).logits[:, L - 1 : L - 1 + N]
        tf_top1 = (logits.argmax(-1) == stock_logits.argmax(-1)).numpy()
        b = m.bytes(geom)
        rows.append(summarize(m.name, gen, stock_np, tf_top1, margins, second, dict(ratio=ratio, window=None, bytes_per_token=b.per_token,
                                                                            fraction=b.fraction, ppl=perplexity(model, ppl_ids, method=m),
                                                                            seconds=round(time.perf_counter() - t0, 1))))
        print(f"  {m.name}: prefix {rows[-1]['mean_prefix']:.1f}/{N}", file=sys.stderr)

    for ratio in args.ratios:
        for window in args.windows:
            t0 = time.perf_counter()
            auto = window == "auto"
            try:
                bases = calibrate_checkpoint(args.model, ratio, sinks=None if auto else args.sinks, window=None if auto else window,
                                             tokens=args.calibration_tokens, loss=args.loss, key_bases=args.key_bases,
                                             max_pre_rope_rank=args.max_pre_rope_rank)
            except ValueError as exc:  # the window alone costs more than the ratio allows
                skipped.append(dict(ratio=ratio, window=window, reason=str(exc)))
                print(f"  ratio {ratio}, window {window}: skipped ({exc})", file=sys.stderr)
                continue
            with compress(model, bases) as kv:
                gen = kv.generate(ids, max_new_tokens=N, do_sample=False)[:, L:].numpy()
            logits = teacher_forced(model, seq, bases.states(model.config), keep_logits=True).logits[:, L - 1 : L - 1 + N]
            tf_top1 = (logits.argmax(-1) == stock_logits.argmax(-1)).numpy()
            b = bases.allocation.bytes(geom)
            a = bases.allocation
            cap = bases.allocation.meta.get("max_pre_rope_rank")
            options_given = args.key_bases is not None or args.max_pre_rope_rank != AUTO_PRE_ROPE_RANK
            kinds = ("" if args.key_bases is None else f", keys {args.key_bases}") + (", pre-RoPE rank uncapped" if cap is None else f", pre-RoPE rank <= {cap}")
            chosen = (" (chosen)" if options_given else " (chosen; the command's default)") if auto else ""
            name = f"allocator {100 * ratio:g}% ({args.loss} loss{kinds}) + sinks {a.sinks} + window {a.window}{chosen}"
            rows.append(summarize(name, gen, stock_np, tf_top1, margins, second, dict(ratio=ratio, window=a.window, sinks=a.sinks, auto=auto, loss=args.loss,
                                                                               bytes_per_token=b.per_token, fraction=b.fraction,
                                                                               ppl=perplexity(model, ppl_ids, bases.states(model.config)),
                                                                               seconds=round(time.perf_counter() - t0, 1))))
            rows[-1]["allocation"] = bases.allocation.to_dict()
            print(f"  {name}: prefix {rows[-1]['mean_prefix']:.1f}/{N}", file=sys.stderr)
        bits = int(round(16 * ratio))
        if args.reference and bits in (2, 4, 8):
            reference(bits, ratio)
    if args.reference and 0.5 not in args.ratios:  # how fragile greedy decoding is under a near-lossless cache
        reference(8, None)
    stock_tf = (stock_logits.argmax(-1) == stock).numpy()
    return dict(
        model=str(args.model),
        prompts=[dict(file=f, bytes=int(len(p))) for f, p in prompts],
        prompt_bytes=L,
        prompt_start=args.prompt_start,
        new_tokens=N,
        sinks=args.sinks,
        loss=args.loss,
        calibration_tokens=args.calibration_tokens,
        ppl_windows=args.ppl_windows,
        stock_ppl=stock_ppl,
        stock_margin_median=float(np.median(margins)),
        stock_margin_below={str(t): float((margins < t).mean()) for t in (0.1, 0.25, 0.5, 1.0)},
        stock_teacher_forced_equals_generate=float(stock_tf.mean()),
        rows=rows,
        skipped=skipped,
        seconds=round(time.perf_counter() - started, 1),
        date=time.strftime("%Y-%m-%d"),
    )


def table(record: dict) -> str:
    N = record["new_tokens"]
    out = [
        f"| configuration | bytes/token (of fp16) | prefix agreement (mean of {N}) | median | all {N} equal | position-wise | teacher-forced top-1 | "
        "stock top-2 margin at first difference (median) | first difference = stock's 2nd choice | ppl |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    if record.get("stock_ppl") is not None:
        out.append(f"| stock DynamicCache | 2048 (100%) | {N} | {N} | all | 100% | 100% | — | — | {record['stock_ppl']:.4f} |")
    for r in record["rows"]:
        tf = "—" if r["teacher_forced_top1"] is None else f"{100 * r['teacher_forced_top1']:.1f}%"
        mg = "—" if r["margin_at_first_difference"] is None else f"{r['margin_at_first_difference']:.2f}"
        out.append(
            f"| {r['name']} | {r['bytes_per_token']:.0f} ({100 * r['fraction']:.1f}%) | {r['mean_prefix']:.1f} | {r['median_prefix']:g} | "
            f"{r['all_equal']}/{len(r['prefix'])} | {100 * r['mean_positionwise']:.1f}% | {tf} | {mg} | "
            + (f"{r['second_choice_at_first_difference']}/{r['differing']} |" if r["differing"] else "— |")
            + (f" {r['ppl']:.4f} |" if r.get("ppl") is not None else " — |")
        )
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="checkpoint directory (default: the shipped model)")
    p.add_argument("--ratios", type=lambda s: [float(x) for x in s.split(",")], default=[0.25, 0.125])
    p.add_argument("--windows", type=lambda s: [x if x == "auto" else int(x) for x in s.split(",")], default=["auto"],
                   help="'auto' (the calibrate command's default: sinks and window chosen by the loss) or exact windows with --sinks sinks (default auto)")
    p.add_argument("--loss", choices=("fisher", "proxy"), default="fisher", help="the allocator's loss (default fisher, the command's default)")
    p.add_argument("--key-bases", default=None, help="key kinds the allocator may choose (subspace-kv calibrate --key-bases; default all)")
    p.add_argument("--max-pre-rope-rank", type=pre_rope_rank_argument, default=AUTO_PRE_ROPE_RANK,
                   help="highest pre-RoPE key rank (subspace-kv calibrate --max-pre-rope-rank: auto, the default, none or a rank)")
    p.add_argument("--ppl-windows", type=int, default=16, help="held-out 1024-token windows for the perplexity column (default 16; 0: none)")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-bytes", type=int, default=512)
    p.add_argument("--prompt-start", type=float, default=1 / 3, help="where in each held-out file a prompt starts (default 1/3; 2/3: a second prompt set)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--calibration-tokens", type=int, default=8192)
    p.add_argument("--no-reference", dest="reference", action="store_false", help="skip the quantised-KV reference rows")
    p.add_argument("--json", type=Path, default=None, help="write the record here")
    args = p.parse_args()
    record = run(args)
    print(table(record))
    below = ", ".join(f"< {t}: {100 * f:.1f}%" for t, f in record["stock_margin_below"].items())
    print(f"stock top-2 margin over all {record['new_tokens']} x {len(record['prompts'])} positions: median {record['stock_margin_median']:.2f}; {below}; {record['seconds']:.0f} s")
    for r in record["rows"]:
        print(f"  {r['name']}: prefix per prompt {r['prefix']}")
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
