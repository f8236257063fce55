"""``subspace-kv backends``: which backends are registered, whether each runs here, and the
capability table each declares (subspace_ref.capabilities)."""

from __future__ import annotations

from subspace_ref.capabilities import table
from subspace_ref.registry import backends, declared_capabilities


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    for info in backends():
        print(info)
    print()
    print(table(declared_capabilities()))
    return 0
