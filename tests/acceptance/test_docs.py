"""Snippets in the docs (and the README) that are marked `<!-- snippet: NAME ... -->` run, as a reader would run
them, against a migrated database of the test server; they and the project files of
docs/testing.md (`<!-- project-file: NAME ... -->`, run as a project by test_wheel.py) pass
`mypy --strict`, as a reader's type checker would see them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).parents[2] / "docs"
README = DOCS.parent / "README.md"
_SNIPPET = re.compile(r"<!-- snippet: ([\w-]+)[^>]*-->\s*```python\n(.*?)```", re.DOTALL)
_PROJECT_FILE = re.compile(r"<!-- project-file: ([\w.]+)[^>]*-->\s*```python\n(.*?)```",
                           re.DOTALL)


def snippets() -> dict[str, str]:
    found: dict[str, str] = {}
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        for name, code in _SNIPPET.findall(page.read_text()):
            found[f"{page.name}:{name}"] = code
    return found


def project_files() -> dict[str, str]:
    """The files of the user's project docs/testing.md shows (conftest.py, test_*.py), by
    file name, as the page gives them."""
    found: dict[str, str] = {}
    for name, code in _PROJECT_FILE.findall((DOCS / "testing.md").read_text()):
        assert name not in found, f"docs/testing.md gives {name} twice"
        found[name] = code
    return found


def test_the_marked_snippets_are_found() -> None:
    assert "worker.md:embedded-worker" in snippets()
    assert "README.md:quickstart" in snippets()
    assert "conftest.py" in project_files() and len(project_files()) >= 4


def test_the_snippets_pass_mypy_strict(tmp_path: Path) -> None:
    """One mypy run over every marked block, each written as a file of its own (distinct
    module names); a reader's `-> dict` or an unannotated test fails it."""
    files = []
    for name, code in snippets().items():
        files.append(tmp_path / ("doc_" + re.sub(r"\W", "_", name) + ".py"))
        files[-1].write_text(code)
    (tmp_path / "mypy.ini").write_text("[mypy]\n")  # not the repository's settings
    (tmp_path / "project").mkdir()
    for name, code in project_files().items():
        files.append(tmp_path / "project" / name)
        files[-1].write_text(code)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-warn-unused-ignores",
         "--cache-dir", str(tmp_path / "mypy-cache"), "--config-file", "mypy.ini",
         *map(str, files)],
        capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", sorted(snippets()))
def test_snippet_runs(name: str, db_url: str, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(snippets()[name])
    env = {**os.environ, "DATABASE_URL": db_url}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=120, check=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    if name == "README.md:quickstart":  # the job ran, by the worker the README starts
        assert proc.stdout.strip() == "welcome, user 1"
    if name == "worker.md:embedded-worker":
        assert proc.stdout.strip() == "hello Ada"
        assert "signal only works in main thread" not in proc.stderr
