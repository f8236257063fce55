"""Static basis calibrated offline (spec A6; seed 001 §10 "Static Subspace", seed 003 SubSpace-G)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StaticPolicy:
    """One fixed basis per head; ranks per head (zero rows pad the rest). ``rope``: a
    :class:`~subspace_ref.rope.RopeParams` when the key basis is pre-RoPE and the state un-rotates
    appended keys (spec/rope.md P2); saved in the file header's ``rope``, not as a policy field
    (spec/rope.md §5).
    ``query_group``: g when the state holds one basis per QUERY head and takes keys/values of
    H/g KV heads, repeating each for its g query heads (spec/sharing.md A3); None for the plain
    one basis per KV head. Not persisted (saving such a state is refused)."""

    rank_k: tuple[int, ...]
    rank_v: tuple[int, ...]
    rope: Any = field(default=None, metadata={"persisted": False})
    query_group: Any = field(default=None, metadata={"persisted": False, "spec": "spec/sharing.md §6"})

    kind = "static"
