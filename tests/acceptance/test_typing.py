"""Typed pipelines, as a reader's type checker sees them: mypy --strict and pyright (strict)
each run once over every fixture in tests/typing/, and report an error on exactly the lines
marked `# expect error` (a misspelt, missing or mistyped argument of `pipeline.enqueue`,
`.options(...).enqueue`, `await .aenqueue`) and on no other line (the correct calls).

The docs' runnable blocks pass `mypy --strict` too: tests/acceptance/test_docs.py runs that
check, once over all of them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import flowq

pytestmark = pytest.mark.slow  # a type checker's process each, seconds of work

FIXTURES = Path(__file__).parents[1] / "typing"
FLOWQ_ROOT = Path(flowq.__file__).parent.parent  # the flowq under test, checked from source
MARKER = re.compile(r"#\s*expect error\s*$")


def _fixtures() -> list[Path]:
    found = sorted(FIXTURES.glob("*.py"))
    assert found, f"no typing fixtures in {FIXTURES}"
    return found


def _expected() -> set[tuple[str, int]]:
    marked = {(f.name, n) for f in _fixtures()
              for n, line in enumerate(f.read_text().splitlines(), start=1)
              if MARKER.search(line)}
    assert len(marked) >= 10, marked  # the fixtures are read, not silently empty
    return marked


def _copy_fixtures(tmp_path: Path) -> list[Path]:
    # Checked from a directory of their own without configuration, so only the command's
    # settings apply (not the repository's mypy or pyright settings).
    where = tmp_path / "fixtures"
    where.mkdir()
    copies = []
    for f in _fixtures():
        copies.append(where / f.name)
        copies[-1].write_text(f.read_text())
    return copies


def test_mypy_strict_reports_exactly_the_marked_lines(tmp_path: Path) -> None:
    files = _copy_fixtures(tmp_path)
    (tmp_path / "mypy.ini").write_text("[mypy]\n")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-color-output", "--no-error-summary",
         "--show-error-codes", "--cache-dir", str(tmp_path / "mypy-cache"),
         "--config-file", str(tmp_path / "mypy.ini"), *map(str, files)],
        cwd=tmp_path, env={**os.environ, "MYPYPATH": str(FLOWQ_ROOT)},
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    got = {(Path(name).name, int(line)) for name, line in
           re.findall(r"^(\S+\.py):(\d+): error: ", proc.stdout, re.MULTILINE)}
    assert got == _expected(), proc.stdout


def test_pyright_strict_reports_exactly_the_marked_lines(tmp_path: Path) -> None:
    files = _copy_fixtures(tmp_path)
    config = tmp_path / "pyrightconfig.json"
    config.write_text(json.dumps({
        "typeCheckingMode": "strict", "pythonVersion": "3.10", "extraPaths": [str(FLOWQ_ROOT)],
    }))
    # The wheel bundles pyright itself; the `nodejs` extra (pyproject.toml) the node it runs
    # on, so a machine without one needs nothing more. No version check.
    env = {**os.environ, "PYRIGHT_PYTHON_IGNORE_WARNINGS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pyright", "--outputjson", "--project", str(config),
         "--pythonpath", sys.executable, *map(str, files)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    errors = [d for d in report["generalDiagnostics"] if d["severity"] == "error"]
    # Lines in pyright's JSON count from 0.
    got = {(Path(d["file"]).name, d["range"]["start"]["line"] + 1) for d in errors}
    assert got == _expected(), json.dumps(errors, indent=1)
