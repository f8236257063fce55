"""``subspace-kv``: the project's command line. Each subcommand lives in its own module, imported
exposing ``add_arguments(parser)`` and ``run(args) -> int``; a module whose optional
dependencies are missing leaves its subcommand in place with the reason."""

from __future__ import annotations

import argparse
import importlib
import sys

from subspace_ref.experiments import SUBCOMMANDS as EXPERIMENTS

SUBCOMMANDS = {
    **EXPERIMENTS,
    "baselines": ("subspace_ref.experiments.baselines", "quantization and eviction baselines at matched KV bytes"),
    "tasks": ("subspace_ref.experiments.tasks", "accuracy tasks: needle recall, next-token and last-identifier accuracy (work in progress)"),
    "demo": ("subspace_ref.demo", "compress a synthetic low-rank stream; print memory ratio and error"),
    "bounds": ("subspace_ref.bounds.sweep", "sweep the error bounds of spec/bounds.md; table, plot, theory page"),
    "roofline": ("subspace_ref.roofline_report", "measure decode time against the roofline model; plot"),
    "backends": ("subspace_ref.cli_backends", "list registered backends and why any is unavailable"),
    "gpu-report": ("subspace_ref_triton.gpu_report", "compile every GPU kernel for sm_80/sm_90: registers, spills, occupancy, waves, roofline"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="subspace-kv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        try:
            modules[name] = importlib.import_module(module)
        except ImportError as err:  # a subcommand whose optional dependencies are missing
            p.set_defaults(_missing=f"{name} needs {err.name}: {err}")
            continue
        modules[name].add_arguments(p)
    args = parser.parse_args(argv)
    if getattr(args, "_missing", None):
        print(args._missing, file=sys.stderr)
        return 2
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
