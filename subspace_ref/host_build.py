"""Build a C or C++ source into a shared library with the host compiler, once per content.

Used for the torch backend's CPU kernels and for the host emulation of the CUDA sources: both
are compiled at first use (a wheel cannot ship one binary for every CPU), cached under a name
derived from everything that shapes the binary, and loaded with ctypes.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """$SUBSPACE_REF_CACHE, else ~/.cache/subspace_ref when writable, else the temp dir's."""
    configured = os.environ.get("SUBSPACE_REF_CACHE")
    candidates = [Path(configured)] if configured else [Path.home() / ".cache" / "subspace_ref", Path(tempfile.gettempdir()) / "subspace_ref"]
    for path in candidates:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(path, os.W_OK):
            return path
    raise OSError(f"no writable build cache among {[str(p) for p in candidates]}; set SUBSPACE_REF_CACHE")


def _cpu() -> str:
    """The CPU's model and instruction-set flags where the system says them (/proc/cpuinfo): a
    library built with -march=native must not be loaded on another CPU sharing the cache."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def build_shared_library(source: str, compiler: str, flags: list[str], stem: str, suffix: str = ".c", depends: list[Path] = ()) -> Path:
    """The shared library of ``source`` (text) built with ``compiler`` and ``flags``, built only if
    no library of the same source, headers it includes (``depends``), compiler, flags and machine
    is cached. Raises RuntimeError with the compiler's message when the build fails. The file is
    written under a temporary name and renamed, so concurrent processes never load a half-written
    library."""
    key = "\0".join([source, *(Path(p).read_text() for p in depends), compiler, *flags, platform.machine(), _cpu()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    build = cache_dir() / "build"
    build.mkdir(exist_ok=True)
    lib = build / f"{stem}_{digest}.so"
    if lib.exists():
        return lib
    src = build / f"{stem}_{digest}.{os.getpid()}{suffix}"
    tmp = build / f"{stem}_{digest}.{os.getpid()}.so"
    src.write_text(source)
    cmd = [compiler, *flags, "-shared", "-fPIC", str(src), "-o", str(tmp)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building {stem} failed:\n{' '.join(cmd)}\n{proc.stderr[-6000:]}")
        os.replace(tmp, lib)
    finally:
        src.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return lib
