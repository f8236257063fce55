"""How many threads the command line lets BLAS, OpenMP and torch use.

On a small shared machine threaded BLAS on small matrices only adds contention: ``subspace-kv
demo`` took 1:49 instead of 4.6 s while another job shared the two cores. The environment
variables are read only when a library loads, and ``subspace_ref`` has loaded NumPy before the
CLI parses its arguments, so the loaded libraries are told directly (threadpoolctl); without
threadpoolctl only libraries that load later follow the environment.
"""

from __future__ import annotations

import argparse
import os
import sys

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def requested_threads(args: argparse.Namespace) -> int:
    """The thread count of a parsed command: the global ``--threads``, else the subcommand's, else 1."""
    return getattr(args, "global_threads", None) or getattr(args, "threads", None) or 1


def limit_threads(n: int) -> str:
    """Use at most ``n`` threads from now on; returns how (for a log line)."""
    if n < 1:
        raise ValueError(f"threads must be at least 1, got {n}")
    for var in THREAD_VARIABLES:
        os.environ[var] = str(n)
    how = "environment only (libraries loaded later)"
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(n)
        how = "threadpoolctl"
    except ImportError:
        pass
    if "torch" in sys.modules:  # never import torch here: `import subspace_ref` must stay light
        sys.modules["torch"].set_num_threads(n)
    return how
