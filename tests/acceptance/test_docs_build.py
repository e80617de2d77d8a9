"""The documentation site builds with `mkdocs build --strict`: every page is in the nav, every
link and anchor resolves, and the API reference is generated from the docstrings.

Skipped when mkdocs and mkdocstrings are not installed (they are dev extras)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None
    or importlib.util.find_spec("mkdocstrings_handlers") is None,
    reason="mkdocs and mkdocstrings[python] are not installed")


def test_the_docs_build_strictly(tmp_path: Path) -> None:
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(REPO / "mkdocs.yml"), "--site-dir", str(site)],
        capture_output=True, text=True, timeout=300, check=False, cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr
    # The reference is rendered from the docstrings, not left as a bare `::: flowq` line.
    reference = (site / "reference" / "flowq" / "index.html").read_text()
    for name in ("flowq.FlowQ", "flowq.enqueue", "flowq.Worker", "flowq.SchemaMissingError"):
        assert f'id="{name}"' in reference, name
    assert ":::" not in reference
