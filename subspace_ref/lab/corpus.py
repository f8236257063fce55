"""The default model's corpus: the Python standard library of the running interpreter.

Which files
    Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` whose relative path (POSIX
    separators) has no directory component in :data:`EXCLUDED_DIRS` -- that is, no
    ``site-packages`` and no test directories (``test/``, ``tests/``, ``idlelib/idle_test/``,
    ``lib2to3/tests/``, ``ctypes/test/``, ``unittest/test/``, ``tkinter/test/``, ...).
    Symbolic links are followed for files, not for directories; hidden and ``__pycache__``
    directories are skipped.

Which split
    The relative paths are sorted (plain string order). A file is *held out* for evaluation
    when ``int(sha1(relpath.encode("utf-8")).hexdigest(), 16) % 10 == 0`` (about one file in
    ten); every other file is *training*. The rule depends on the path only, so the split is
    fixed for a given interpreter and stable across machines.

Streams
    :func:`load_stream` concatenates the bytes of a split's files in sorted order (no
    separator: every stdlib file ends with a newline). Training draws random windows from the
    training stream; :func:`eval_windows` draws seeded windows from the held-out stream.
    Token ids are byte values (0..255).

Corpus hash
    :func:`corpus_hash` is the SHA-256 over, for each file in sorted order, the relative path
    encoded as UTF-8, a NUL byte, the file length as 8 little-endian bytes, and the file bytes.

Only NumPy and the standard library are needed here.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Directory names (any path component) that exclude a file from the corpus.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})

#: A file is held out when its path's SHA-1 digest, read as an integer, is 0 modulo this.
HELD_OUT_MODULUS = 10

SPLITS = ("train", "heldout")


def stdlib_root() -> Path:
    """The standard-library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_included(rel: str) -> bool:
    parts = rel.split("/")
    if not parts[-1].endswith(".py"):
        return False
    return not any(p in EXCLUDED_DIRS or p.startswith(".") for p in parts[:-1])


def is_held_out(rel: str) -> bool:
    """Whether the relative path ``rel`` (POSIX separators) belongs to the held-out split."""
    return int(hashlib.sha1(rel.encode("utf-8")).hexdigest(), 16) % HELD_OUT_MODULUS == 0


def list_all_files(root: str | os.PathLike | None = None) -> list[str]:
    """All corpus files as sorted relative POSIX paths under ``root`` (default: the stdlib)."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith(".")]
        for name in filenames:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if _is_included(rel) and os.path.isfile(os.path.join(dirpath, name)):
                out.append(rel)
    return sorted(out)


def list_files(split: str = "train", root: str | os.PathLike | None = None) -> list[str]:
    """Sorted relative paths of the ``"train"`` or ``"heldout"`` split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    want = split == "heldout"
    return [f for f in list_all_files(root) if is_held_out(f) == want]


def train_files(root: str | os.PathLike | None = None) -> list[str]:
    return list_files("train", root)


def heldout_files(root: str | os.PathLike | None = None) -> list[str]:
    return list_files("heldout", root)


def load_file(rel: str, root: str | os.PathLike | None = None) -> np.ndarray:
    """One corpus file as a ``uint8`` array of its bytes."""
    root = Path(root) if root is not None else stdlib_root()
    return np.frombuffer((root / rel).read_bytes(), dtype=np.uint8)


def load_files(split: str = "train", root: str | os.PathLike | None = None) -> dict[str, np.ndarray]:
    """``{relative path: uint8 bytes}`` for a split, in sorted order."""
    return {rel: load_file(rel, root) for rel in list_files(split, root)}


def load_stream(split: str = "train", root: str | os.PathLike | None = None) -> np.ndarray:
    """A split's files concatenated in sorted order, as one ``uint8`` array."""
    arrays = list(load_files(split, root).values())
    if not arrays:
        return np.zeros(0, dtype=np.uint8)
    return np.concatenate(arrays)


def corpus_hash(split: str = "train", root: str | os.PathLike | None = None) -> str:
    """SHA-256 (hex) over (path, length, bytes) of a split's files in sorted order."""
    h = hashlib.sha256()
    for rel, data in load_files(split, root).items():
        h.update(rel.encode("utf-8") + b"\0")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data.tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class CorpusStats:
    python_version: str
    stdlib: str
    train_files: int
    train_bytes: int
    heldout_files: int
    heldout_bytes: int
    train_sha256: str
    heldout_sha256: str
    split_rule: str

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def corpus_stats(root: str | os.PathLike | None = None) -> CorpusStats:
    """File and byte counts, hashes and the split rule, for the shipped metadata."""
    root_p = Path(root) if root is not None else stdlib_root()
    tr = load_files("train", root_p)
    ho = load_files("heldout", root_p)
    return CorpusStats(
        python_version=sys.version.split()[0],
        stdlib=str(root_p),
        train_files=len(tr),
        train_bytes=int(sum(len(a) for a in tr.values())),
        heldout_files=len(ho),
        heldout_bytes=int(sum(len(a) for a in ho.values())),
        train_sha256=corpus_hash("train", root_p),
        heldout_sha256=corpus_hash("heldout", root_p),
        split_rule=(
            "*.py under sysconfig stdlib, excluding any directory component in "
            f"{sorted(EXCLUDED_DIRS)} or starting with '.'; sorted relative POSIX paths; held out iff "
            f"int(sha1(relpath.encode('utf-8')).hexdigest(), 16) % {HELD_OUT_MODULUS} == 0"
        ),
    )


def window_starts(stream_len: int, n: int, length: int, seed: int) -> np.ndarray:
    """``n`` seeded start offsets of windows of ``length`` bytes in a stream of ``stream_len``."""
    if stream_len < length:
        raise ValueError(f"stream of {stream_len} bytes is shorter than a window of {length}")
    rng = np.random.default_rng(seed)
    return rng.integers(0, stream_len - length + 1, size=n, dtype=np.int64)


def eval_windows(
    n: int = 8,
    length: int = 1024,
    seed: int = 0,
    split: str = "heldout",
    root: str | os.PathLike | None = None,
    stream: np.ndarray | None = None,
) -> np.ndarray:
    """``n`` deterministic windows of ``length`` bytes, an ``(n, length)`` int64 array of ids.

    Windows start at offsets drawn by ``numpy.random.default_rng(seed)`` uniformly over the
    split's stream (:func:`load_stream`); the same (n, length, seed, split) always gives the
    same windows for a given interpreter, and a larger ``n`` extends a smaller one. Pass
    ``stream`` to reuse an already loaded stream.
    """
    if stream is None:
        stream = load_stream(split, root)
    starts = window_starts(len(stream), n, length, seed)
    idx = starts[:, None] + np.arange(length, dtype=np.int64)[None, :]
    return stream[idx].astype(np.int64)


def contiguous_windows(stream: np.ndarray, length: int) -> np.ndarray:
    """The stream cut into consecutive non-overlapping windows of ``length`` (tail dropped)."""
    n = len(stream) // length
    return stream[: n * length].reshape(n, length).astype(np.int64)
