"""The command line a new user meets: complete help texts, one thread unless asked, a clear
message (no traceback) when an optional package is missing, clear errors for bad arguments."""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pytest

from subspace_ref import cli


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_top_level_help_is_a_whole_sentence_with_first_steps(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert cli.DESCRIPTION in " ".join(out.split()) or cli.DESCRIPTION.split(":")[0] in out
    assert cli.DESCRIPTION.rstrip().endswith(".") and "subspace-kv demo" in out
    assert "work in progress" not in out


def test_every_subcommand_option_has_a_help_text():
    parser, modules = cli.build_parser()
    missing = []
    for name, sub in subparsers(parser).items():
        if name not in modules:  # optional dependencies missing: nothing to check
            continue
        for action in sub._actions:
            if action.option_strings and action.help in (None, "") and action.dest != "help":
                missing.append(f"{name} {action.option_strings[0]}")
    assert not missing, f"options without help: {missing}"


def test_the_cli_limits_threads(monkeypatch):
    seen = []
    monkeypatch.setattr("subspace_ref.threads.limit_threads", lambda n: seen.append(n))
    assert cli.main(["demo", "--tokens", "64", "--heads", "1", "--d", "8", "--rank", "2"]) == 0
    assert cli.main(["--threads", "2", "demo", "--tokens", "64", "--heads", "1", "--d", "8", "--rank", "2"]) == 0
    assert seen == [1, 2]


def test_limit_threads_tells_the_loaded_blas():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from subspace_ref.threads import limit_threads

    with threadpoolctl.threadpool_limits():  # restore afterwards
        assert limit_threads(1) == "threadpoolctl"
        assert all(info["num_threads"] == 1 for info in threadpoolctl.threadpool_info() if info["user_api"] == "blas")
    with pytest.raises(ValueError, match="threads"):
        limit_threads(0)


def test_a_missing_matplotlib_gives_a_message_not_a_traceback(monkeypatch, capsys):
    pytest.importorskip("torch")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    rc = cli.main(["ppl", "--model", "tiny-random", "--profile", "tiny", "--no-progress", "--out", "/nonexistent/never-written"])
    err = capsys.readouterr().err
    assert rc == 2 and "matplotlib" in err and "Traceback" not in err


def test_demo_prints_progress_for_each_state(capsys):
    assert cli.main(["demo", "--tokens", "64", "--heads", "1", "--d", "8", "--rank", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") >= 5 and "rotating" in out


def test_calibrate_rejects_a_fractional_rank_by_name():
    import subspace_ref as sr

    K = np.random.default_rng(0).standard_normal((2, 32, 16))
    with pytest.raises(ValueError, match="rank_k must be a whole number"):
        sr.calibrate(K, K, rank_k=8.7, rank_v=4)
    with pytest.raises(ValueError, match="rank_v must be a whole number"):
        sr.calibrate(K, K, rank_k=4, rank_v=True)
