"""SUBSPACE_FAILURE_LOG (tests/conftest.py, ``pytest_runtest_logreport``): each failed test's node id
and the end of its traceback appended to the named file as the test ends, so a run cut off by a
time limit (benchmarks/gpu_session.sh) still leaves its tracebacks; nothing without the variable.
A tiny test file run in process by ``pytester`` with the conftest's hook."""

from __future__ import annotations

import conftest

pytest_plugins = ["pytester"]

INNER = """
def test_passes():
    assert True

def test_fails():
    assert 1 + 1 == 3, "the inner assertion"

def test_long_message():
    assert False, "x" * 20000
"""


class _Hook:
    pytest_runtest_logreport = staticmethod(conftest.pytest_runtest_logreport)


def test_failures_are_appended_as_they_happen(pytester, monkeypatch, tmp_path):
    pytester.makepyfile(test_inner=INNER)
    log = tmp_path / "failures.log"
    log.write_text("kept\n")  # appended to, never truncated
    monkeypatch.setenv("SUBSPACE_FAILURE_LOG", str(log))
    pytester.runpytest("-p", "no:cacheprovider", plugins=[_Hook()]).assert_outcomes(passed=1, failed=2)
    text = log.read_text()
    assert text.startswith("kept\n")
    assert "=== FAILED test_inner.py::test_fails (call, " in text and "the inner assertion" in text and "assert (1 + 1) == 3" in text
    assert "test_passes" not in text
    long_entry = text[text.index("test_inner.py::test_long_message") :]
    assert "characters cut" in long_entry and len(long_entry) < conftest.FAILURE_LOG_CHARS + 200


def test_nothing_is_written_without_the_variable(pytester, monkeypatch):
    pytester.makepyfile(test_inner=INNER)
    monkeypatch.delenv("SUBSPACE_FAILURE_LOG", raising=False)
    before = set(pytester.path.rglob("*"))
    pytester.runpytest("-p", "no:cacheprovider", plugins=[_Hook()]).assert_outcomes(passed=1, failed=2)
    assert {p for p in pytester.path.rglob("*") if "__pycache__" not in p.parts} == before
