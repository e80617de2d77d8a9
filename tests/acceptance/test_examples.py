"""The scripts in examples/ run to completion (against the test database, not an embedded one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).parents[2] / "examples"


def test_signup_pipeline_example_runs(db_url: str) -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLES / "signup_pipeline.py"), db_url],
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "accounts: 3, welcome mails: 3, gateway requests: 9, cards charged: 3" in proc.stdout
    assert proc.stdout.count(": succeeded -> ") == 3


def test_the_example_never_reads_the_environment(db_url: str, engine: Any) -> None:
    """Run as `python examples/signup_pipeline.py` in a shell whose DATABASE_URL points at a
    real database, it uses its own embedded server and leaves that database alone."""
    import os

    import sqlalchemy as sa

    import flowq

    with engine.begin() as conn:
        flowq.enqueue(conn, "someone_elses_task", queue="default", n=1)
    env = {**os.environ, "DATABASE_URL": db_url, "FLOWQ_DATABASE_URL": db_url}
    proc = subprocess.run([sys.executable, str(EXAMPLES / "signup_pipeline.py")], env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "starting an embedded PostgreSQL" in proc.stdout
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT task, status, attempts FROM flowq.steps")).all()
        tables = conn.execute(sa.text("SELECT count(*) FROM pg_tables WHERE schemaname = "
                                      "'public'")).scalar()
    assert [tuple(r) for r in rows] == [("someone_elses_task", "pending", 0)]
    assert tables == 0
