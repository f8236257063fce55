"""``python -m subspace_ref.lab.bounds``: the bounds sweep (spec B9), the same as ``subspace-kv bounds``."""

import argparse
import sys

from subspace_ref.lab.bounds import sweep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m subspace_ref.lab.bounds", description=sweep.__doc__.splitlines()[0])
    sweep.add_arguments(parser)
    return int(sweep.run(parser.parse_args(argv)) or 0)


if __name__ == "__main__":
    sys.exit(main())
