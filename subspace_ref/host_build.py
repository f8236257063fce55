"""Build a C or C++ source into a shared library with the host compiler, once per content.

Used for the torch backend's CPU kernels and for the host emulation of the CUDA sources: both
are compiled at first use (a wheel cannot ship one binary for every CPU), cached under a name
derived from everything that shapes the binary, and loaded with ctypes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import signal
import subprocess
import tempfile
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: builds are not serialised (the rename below still keeps them whole)
    fcntl = None


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


@contextlib.contextmanager
def _exclusive(path: Path):
    """An exclusive lock on ``path`` (created if missing) held inside the block, across processes."""
    if fcntl is None:
        yield
        return
    with open(path, "a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        except OSError:  # a file system without locks (some NFS homes): unserialised, as without fcntl
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _compile(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run the compiler in a process group of its own and kill the whole group when the wait is
    interrupted (a test's time limit, Ctrl-C): its children (cc1) must not outlive the call."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            if hasattr(os, "killpg"):
                os.killpg(proc.pid, signal.SIGKILL)
            else:  # no process groups (Windows): the compiler alone
                proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def build_shared_library(source: str, compiler: str, flags: list[str], stem: str, suffix: str = ".c", depends: list[Path] = ()) -> Path:
    """The shared library of ``source`` (text) built with ``compiler`` and ``flags``, built only if
    no library of the same source, headers it includes (``depends``), compiler, flags and machine
    is cached. Raises RuntimeError with the compiler's message when the build fails. Processes
    building the same library take turns (a lock per library): one builds, the others load its
    result. The file is written under a temporary name and renamed, so no process loads a
    half-written library; an interrupted build kills its compiler and leaves nothing."""
    key = "\0".join([source, *(Path(p).read_text() for p in depends), compiler, *flags, platform.machine(), _cpu()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    build = cache_dir() / "build"
    build.mkdir(exist_ok=True)
    lib = build / f"{stem}_{digest}.so"
    if lib.exists():
        return lib
    with _exclusive(build / f"{stem}_{digest}.lock"):
        if lib.exists():  # built by another process while this one waited
            return lib
        src = build / f"{stem}_{digest}.{os.getpid()}{suffix}"
        tmp = build / f"{stem}_{digest}.{os.getpid()}.so"
        src.write_text(source)
        cmd = [compiler, *flags, "-shared", "-fPIC", str(src), "-o", str(tmp)]
        try:
            proc = _compile(cmd)
            if proc.returncode != 0:
                raise RuntimeError(f"building {stem} failed:\n{' '.join(cmd)}\n{proc.stderr[-6000:]}")
            os.replace(tmp, lib)
        finally:
            src.unlink(missing_ok=True)
            tmp.unlink(missing_ok=True)
    return lib
