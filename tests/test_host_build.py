"""subspace_ref.host_build: processes building the same library take turns, and an interrupted
build leaves no compiler running (pytest-xdist workers under a per-test limit did both on a GPU
machine: docs/gpu.md, "Caps timed, and a softmax per warp by default")."""

from __future__ import annotations

import multiprocessing
import os
import signal
import stat
import sys
import time

import pytest

from subspace_ref.host_build import build_shared_library

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX process groups and file locks")

# a stand-in compiler: records its process id, waits, then writes the file named after -o
FAKE_COMPILER = """#!/bin/sh
echo $$ >> "$COMPILER_LOG"
sleep "$COMPILER_DELAY" &
echo $! >> "$COMPILER_LOG"
wait
for last; do :; done
printf x > "$last"
"""


@pytest.fixture
def fake_compiler(tmp_path, monkeypatch):
    path = tmp_path / "cc"
    path.write_text(FAKE_COMPILER)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "compiler.log"
    monkeypatch.setenv("SUBSPACE_REF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COMPILER_LOG", str(log))
    return str(path), log


def _build(compiler: str, out):
    out.put(str(build_shared_library("int f(void) { return 1; }", compiler, ["-O0"], "turns")))


def test_concurrent_builds_run_the_compiler_once(fake_compiler, monkeypatch):
    compiler, log = fake_compiler
    monkeypatch.setenv("COMPILER_DELAY", "1")
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    workers = [ctx.Process(target=_build, args=(compiler, out)) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    paths = {out.get(timeout=5) for _ in workers}
    assert all(w.exitcode == 0 for w in workers)
    assert len(paths) == 1 and os.path.getsize(paths.pop()) == 1
    assert len(log.read_text().split()) == 2  # one compiler (and its one child) for three processes


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_an_interrupted_build_kills_its_compiler_and_leaves_nothing(fake_compiler, monkeypatch, tmp_path):
    compiler, log = fake_compiler
    monkeypatch.setenv("COMPILER_DELAY", "60")

    class Interrupted(Exception):
        pass

    def interrupt(signum, frame):
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(Interrupted):
            build_shared_library("int f(void) { return 2; }", compiler, ["-O0"], "interrupted")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    pids = [int(p) for p in log.read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), pids  # the compiler and its child (cc1's place) are gone
    assert not [p.name for p in (tmp_path / "cache" / "build").iterdir() if not p.name.endswith(".lock")]
