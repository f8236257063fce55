"""Parametrisation and reporting of the differential harness.

``target`` (backend x device x dtype), ``target64`` and ``target32`` (backend x device, float64
or float32 only) are parametrised from :func:`harness.targets`, i.e. from every registered backend. The terminal
summary says which backends ran, which were skipped and why, and the worst error/tolerance
ratio per target.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from pathlib import Path

import pytest

from .harness import RESULTS, targets

TARGET_FIXTURES = ("target", "target64", "target32")


def pytest_generate_tests(metafunc):
    if "target" in metafunc.fixturenames:
        ts = targets()
        metafunc.parametrize("target", ts, ids=[t.id for t in ts])
    for name, dtype in (("target64", "float64"), ("target32", "float32")):
        if name in metafunc.fixturenames:
            ts = targets((dtype,))
            metafunc.parametrize(name, ts, ids=[t.id for t in ts])


@pytest.fixture(autouse=True)
def _skip_unrunnable(request):
    for name in TARGET_FIXTURES:
        if name in request.fixturenames:
            t = request.getfixturevalue(name)
            if t.skip:
                pytest.skip(t.skip)


_backend_of: dict[str, str] = {}
_outcomes: dict[str, Counter] = defaultdict(Counter)
_skips: dict[str, set] = defaultdict(set)


def pytest_collection_modifyitems(items):
    # this hook sees the whole session's items; only the harness's own carry targets
    here = Path(__file__).parent
    for item in items:
        if here not in Path(item.path).parents:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        for name in TARGET_FIXTURES:
            if name in params:
                _backend_of[item.nodeid] = params[name].backend


def pytest_runtest_logreport(report):
    backend = _backend_of.get(report.nodeid)
    if backend is None:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _outcomes[backend][report.outcome] += 1
        if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            _skips[backend].add(report.longrepr[2].removeprefix("Skipped: "))


def pytest_terminal_summary(terminalreporter):
    if not _outcomes:
        return
    tr = terminalreporter
    tr.write_sep("=", "differential harness: backends")
    for backend in sorted(_outcomes):
        counts = ", ".join(f"{n} {k}" for k, n in sorted(_outcomes[backend].items()))
        tr.write_line(f"{backend}: {counts}")
        for reason in sorted(_skips[backend]):
            tr.write_line(f"    skipped: {reason}")
    if RESULTS:
        worst: dict[str, tuple] = {}
        for r in RESULTS:
            ratio = r.err / r.tol if r.tol > 0 else float("inf") if r.err > 0 else 0.0
            if r.target not in worst or ratio > worst[r.target][0]:
                worst[r.target] = (ratio, r)
        tr.write_line("worst error / tolerance per target (tolerance = FACTOR * oracle-in-dtype error + floor):")
        for target in sorted(worst):
            ratio, r = worst[target]
            tr.write_line(f"    {target:28s} {ratio:6.3f}  (case {r.case}: err {r.err:.3g}, tol {r.tol:.3g}, oracle-in-dtype err {r.ref:.3g})")
