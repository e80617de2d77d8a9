"""Snippets in the docs that are marked `<!-- snippet: NAME ... -->` run, as a reader would run
them, against a migrated database of the test server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).parents[2] / "docs"
_SNIPPET = re.compile(r"<!-- snippet: ([\w-]+)[^>]*-->\s*```python\n(.*?)```", re.DOTALL)


def snippets() -> dict[str, str]:
    found: dict[str, str] = {}
    for page in sorted(DOCS.glob("*.md")):
        for name, code in _SNIPPET.findall(page.read_text()):
            found[f"{page.name}:{name}"] = code
    return found


def test_the_marked_snippets_are_found() -> None:
    assert "worker.md:embedded-worker" in snippets()


@pytest.mark.parametrize("name", sorted(snippets()))
def test_snippet_runs(name: str, db_url: str, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(snippets()[name])
    env = {**os.environ, "DATABASE_URL": db_url}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=120, check=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    if name == "worker.md:embedded-worker":
        assert proc.stdout.strip() == "hello Ada"
        assert "signal only works in main thread" not in proc.stderr
