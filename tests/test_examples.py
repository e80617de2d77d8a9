"""The scripts in examples/ run to completion (against the test database, not an embedded one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_signup_pipeline_example_runs(db_url: str) -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLES / "signup_pipeline.py"), db_url],
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "accounts: 3, welcome mails: 3, gateway requests: 9, cards charged: 3" in proc.stdout
    assert proc.stdout.count(": succeeded -> ") == 3
