"""`flowq bench --baseline`: what it forwards, and a baseline that cannot run refused in a sentence.

`run_versus` is replaced where only the options matter, so nothing runs and no server is
needed; the baselines that cannot run are tiny scripts standing in for an interpreter.
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

import flowq_bench.versus
from flowq.cli import main


def invoke(args: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[Result, list[Any]]:
    """`flowq bench *args` with run_versus replaced; what it would have been called with."""
    seen: list[Any] = []

    def run_versus(url: str | None, names: Any, argv: list[str], repeat: int,
                   baseline: tuple[str | None, str | None], say: Any = None
                   ) -> tuple[str, dict[str, Any]]:
        seen.append((url, list(names), argv, repeat, baseline))
        return "", {}

    monkeypatch.setattr(flowq_bench.versus, "run_versus", run_versus)
    return CliRunner().invoke(main, ["bench", *args]), seen


def test_the_options_given_are_forwarded_and_the_run_ones_are_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    result, seen = invoke(["--baseline", sys.executable, "--quick", "--jobs", "60", "-p", "2",
                           "--pressure-phase", "3", "--scenario", "drain", "--repeat", "3",
                           "--database-url", "postgresql://u@h/db", "--json"], monkeypatch)
    assert result.exit_code == 0, result.output
    ((url, names, argv, repeat, baseline),) = seen
    assert (url, names, repeat) == ("postgresql://u@h/db", ["drain"], 3)
    assert baseline == (sys.executable, None)
    # Long option names, with their values; --scenario, --repeat, --json, --database-url and
    # the baseline's own are set per invocation by run_versus.
    assert argv == ["--jobs", "60", "--processes", "2", "--pressure-phase", "3.0", "--quick"]


def test_baseline_path_alone_means_this_interpreter(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    result, seen = invoke(["--baseline-path", str(tmp_path)], monkeypatch)
    assert result.exit_code == 0, result.output
    assert seen[0][4] == (None, str(tmp_path))
    assert seen[0][2] == []


def _one_error(result: Result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("Error:")]
    return line


@pytest.mark.parametrize("option", ["--baseline", "--baseline-path"])
def test_a_missing_baseline_is_a_usage_error(option: str, tmp_path: Path) -> None:
    line = _one_error(CliRunner().invoke(main, ["bench", option, str(tmp_path / "nope")]))
    assert f"'{option}'" in line and "does not exist" in line, line


def _script(path: Path, body: str, executable: bool = True) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    if executable:
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def test_a_baseline_that_is_not_executable_is_refused(tmp_path: Path) -> None:
    python = _script(tmp_path / "python", "exit 0\n", executable=False)
    line = _one_error(CliRunner().invoke(main, ["bench", "--baseline", str(python)]))
    assert "is not executable: give the path of a Python interpreter" in line, line


def test_a_baseline_without_flowq_is_refused_in_one_sentence(tmp_path: Path) -> None:
    python = _script(tmp_path / "python",
                     "echo \"ModuleNotFoundError: No module named 'flowq'\" >&2; exit 1\n")
    line = _one_error(CliRunner().invoke(main, ["bench", "--baseline", str(python),
                                                "--database-url", "postgresql://u@h/db"]))
    assert line.startswith(f"Error: the baseline {python} cannot import flowq "
                           "(ModuleNotFoundError: No module named 'flowq'): "), line


def test_a_baseline_without_the_bench_is_refused_in_one_sentence(tmp_path: Path) -> None:
    # Imports flowq (prints a version), but its `flowq bench --help` fails.
    python = _script(tmp_path / "python", 'case "$1" in -c) echo 0.0.1;; '
                     '*) echo "Error: flowq bench needs the flowq-bench package" >&2; '
                     "exit 2;; esac\n")
    line = _one_error(CliRunner().invoke(main, ["bench", "--baseline", str(python),
                                                "--database-url", "postgresql://u@h/db"]))
    assert "cannot run `flowq bench` (Error: flowq bench needs the flowq-bench package)" in line
