"""``subspace-kv``: the project's command line. Each subcommand lives in its own module, imported
exposing ``add_arguments(parser)`` and ``run(args) -> int``; a module whose optional
dependencies are missing leaves its subcommand in place with the reason. The command line sits
above both the library and the lab (:mod:`subspace_ref.lab`): outside the lab itself, it is the one
place that imports the lab (tests/test_import_graph.py)."""

from __future__ import annotations

import argparse
import importlib
import sys

from subspace_ref.lab.experiments import SUBCOMMANDS as EXPERIMENTS

DESCRIPTION = (
    "Compress a transformer's KV cache onto per-head low-rank subspaces and measure what it costs: "
    "the papers' experiments, accuracy tasks, baselines, error bounds and benchmarks on the shipped model."
)
EPILOG = """\
first steps (times on 2 idle CPU cores, one thread; many times longer when other jobs share the cores):
  subspace-kv calibrate --model PATH --compression-ratio 0.25 --bases-out DIR
                                      bases and a per-head allocation for a checkpoint (docs/hf.md)
  subspace-kv demo                    synthetic streams through every kind of state (about 5 s)
  subspace-kv experiments             the short experiment table on the shipped model (about 1 min)
  subspace-kv experiments --full      every experiment and docs/experiments.md (about 25 min)
  subspace-kv tasks                   accuracy tasks and docs/tasks.md (about 6 min)
  subspace-kv SUBCOMMAND --help       the options of one subcommand
"""

SUBCOMMANDS = {
    "calibrate": ("subspace_ref.hf.calibrate_checkpoint", "bases for a local checkpoint at a compression ratio (the allocator; --rule energy for energy ranks)"),
    **EXPERIMENTS,
    "baselines": ("subspace_ref.lab.experiments.baselines", "quantization and eviction baselines at matched KV bytes"),
    "tasks": ("subspace_ref.lab.experiments.tasks", "accuracy tasks (needle recall, next-token, last identifier) under every cache; docs/tasks.md"),
    "demo": ("subspace_ref.lab.demo", "compress a synthetic low-rank stream; print memory ratio and error (seconds)"),
    "bounds": ("subspace_ref.lab.bounds.sweep", "sweep the error bounds of spec/bounds.md; table, plot, theory page"),
    "roofline": ("subspace_ref.lab.roofline_report", "measure decode time against the roofline model; plot"),
    "backends": ("subspace_ref.cli_backends", "list registered backends and why any is unavailable"),
    "gpu-report": ("subspace_ref_triton.gpu_report", "compile every GPU kernel for sm_80/sm_90: registers, spills, occupancy, waves, roofline"),
}


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    """The parser with every subcommand, and the modules that could be imported."""
    parser = argparse.ArgumentParser(prog="subspace-kv", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", dest="global_threads", type=int, default=None, metavar="N",
                        help="BLAS/OpenMP/torch threads for the whole command (default: 1, or the subcommand's own --threads)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    modules = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            modules[name] = importlib.import_module(module)
        except ImportError as err:  # a subcommand whose optional dependencies are missing
            p.set_defaults(_missing=f"{name} needs {err.name}: {err}")
            continue
        modules[name].add_arguments(p)
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    from subspace_ref.lab.experiments._common import MissingDependency
    from subspace_ref.threads import limit_threads, requested_threads

    parser, modules = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_missing", None):
        print(args._missing, file=sys.stderr)
        return 2
    # one thread unless asked: threaded BLAS on small matrices only adds contention on a shared machine
    limit_threads(requested_threads(args))
    try:
        return int(modules[args.command].run(args) or 0)
    except MissingDependency as err:
        print(f"subspace-kv {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
