"""``python -m subspace_ref.lab.experiments SUBCOMMAND [options]``: the CLI's experiment subcommands."""

from __future__ import annotations

import sys

from subspace_ref.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
