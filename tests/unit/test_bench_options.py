"""flowq bench's numeric options: hostile values refused in one sentence, good ones reach `Options`.

`run_bench` is replaced, so nothing runs and no server is needed; `--help` is checked the way
the issue states it (`python -X importtime -m flowq bench --help` names no SQLAlchemy module).
"""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import pytest
from click.testing import CliRunner, Result

import flowq_bench.cli
from flowq.cli import main
from flowq_bench.options import BOUNDS, Options, bounded

HOSTILE = ["nan", "NaN", "inf", "-inf", "0", "-1", "1e-320", "1e400", "1e12", "", "abc",
           "0x10", "1,5"]


def invoke(args: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[Result, list[Options]]:
    """`flowq bench *args` with run_bench replaced; the Options it would have run with."""
    seen: list[Options] = []

    def run_bench(url: str | None, names: Any, options: Options,
                  **_: Any) -> tuple[str, dict[str, Any]]:
        seen.append(options)
        return "", {}

    monkeypatch.setattr(flowq_bench.cli, "run_bench", run_bench)
    return CliRunner().invoke(main, ["bench", *args]), seen


@pytest.mark.parametrize("option", sorted(BOUNDS))
@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_numbers_are_refused_in_one_sentence(option: str, text: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    result, seen = invoke(["--scenario", "pressure", option, text], monkeypatch)
    assert result.exit_code == 2, result.output
    assert not seen  # nothing ran
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("Error:")]
    expected = f"expected {'a whole number of ' if BOUNDS[option].integer else ''}"
    assert line == (f"Error: Invalid value for '{option}': {expected}"
                    f"{BOUNDS[option].describe()}, got {text!r}."), line
    assert "Traceback" not in result.output


@pytest.mark.parametrize("text", ["1.5", "2.0000001", "1e-320"])
def test_rows_are_whole_numbers(text: str) -> None:
    with pytest.raises(ValueError, match="a whole number of rows from 1 to 10,000,000"):
        bounded("--pressure-rows", text)


def test_the_bounds_themselves_are_accepted() -> None:
    for option, bound in BOUNDS.items():
        for edge in (bound.low, bound.high):
            value = bounded(option, repr(edge))
            assert value == edge and isinstance(value, int if bound.integer else float)
            assert math.isfinite(value)
    assert bounded("--pressure-rows", " 300_000 ") == 300_000
    assert bounded("--pressure-rows", "1e3") == 1000


def test_the_issues_snapshot_phases_and_the_overload_phase_reach_the_options(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for phase in ("120", "600"):
        result, (options,) = invoke(["--scenario", "pressure", "--pressure-phase", phase,
                                     "--pressure-rate", "2000", "--pressure-rows", "300000",
                                     "--overload-phase", "7.5"], monkeypatch)
        assert result.exit_code == 0, result.output
        assert options.pressure_phase == float(phase)
        assert (options.pressure_rate, options.pressure_rows) == (2000.0, 300_000)
        assert options.overload_phase == 7.5
    result, (quick,) = invoke(["--quick", "--pressure-phase", "3"], monkeypatch)
    assert (quick.pressure_phase, quick.pressure_rate) == (3.0, Options.quick().pressure_rate)


def test_the_defaults_are_inside_their_own_bounds() -> None:
    for options in (Options(), Options.quick()):
        for option in BOUNDS:
            value = getattr(options, option.removeprefix("--").replace("-", "_"))
            assert bounded(option, repr(value)) == value, option


def test_overload_runs_at_c16_unless_c_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    _, (default,) = invoke(["--scenario", "overload"], monkeypatch)
    assert default.overload_c == 16
    _, (given,) = invoke(["--scenario", "overload", "-c", "32"], monkeypatch)
    assert given.overload_c == 32
    assert Options.quick().overload_c == 8


def test_bench_help_imports_no_sqlalchemy() -> None:
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "flowq", "bench",
                           "--help"], capture_output=True, text=True, timeout=60, check=True)
    assert "--pressure-phase" in done.stdout and "--overload-phase" in done.stdout
    imported = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert any(line.endswith("flowq_bench.cli") for line in imported)  # the real command
    assert [line for line in imported if "sqlalchemy" in line or "psycopg" in line] == []
