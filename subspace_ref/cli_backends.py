"""``subspace-kv backends``: which backends are registered and whether each runs here."""

from __future__ import annotations

from subspace_ref.registry import backends


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    for info in backends():
        print(info)
    return 0
