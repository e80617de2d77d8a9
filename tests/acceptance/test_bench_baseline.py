"""`flowq bench --baseline`: two flowqs A B B A on one server, every figure beside both.

The baseline here is this same interpreter and this same checkout (`--baseline-path`), so the
ratios mean nothing and none is asserted: only that both sides ran their invocations, that
each figure has both sides' values and the ratio B/A, beside this side's raw references.
Then a baseline whose bench lacks the scenario (a stand-in package on its PYTHONPATH): the
table says n/a and why, and this side's figures are still printed.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import flowq

ROOT = Path(flowq.__file__).resolve().parent.parent
RUN_TIMEOUT = 600

pytestmark = pytest.mark.timeout(RUN_TIMEOUT + 60)


def bench(server_url: str, tmp_path: Path, *args: str) -> tuple[str, dict[str, Any]]:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "flowq", "bench", "--quick", "--jobs", "40",
         "--scenario", "drain-session", "--database-url", server_url, "--json-file", str(out),
         *args], capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "A B B A" in done.stderr
    return done.stdout, json.loads(out.read_text())


def test_baseline_runs_both_sides_and_prints_the_ratio(server_url: str, tmp_path: Path
                                                       ) -> None:
    table, doc = bench(server_url, tmp_path, "--baseline", sys.executable,
                       "--baseline-path", str(ROOT))
    baseline = doc["baseline"]
    assert baseline["order"] == "ABBA" and baseline["runs_per_side"] == 2  # --quick: 1 each
    assert baseline["not_measured"] == {} and baseline["not_given"] == []
    label = baseline["label"]
    assert label.startswith("baseline ")
    rows = doc["scenarios"]["drain-session"]
    names = [r["flowq"]["name"] for r in rows]
    assert names[0].startswith("ctx.session jobs/s") and "client CPU per job (P=2 C=8)" in names
    for row in rows:
        first, *refs = row["references"]
        assert first["name"] == label and row["extra"]["baseline"]["measured"], row
        assert len(row["flowq"]["values"]) == 2 and len(first["values"]) == 2, row  # B B, A A
        assert refs and all(len(r["values"]) == 2 for r in refs), row  # B's raw references
        if row["flowq"]["unit"] == "jobs/s":
            assert math.isfinite(first["ratio"]) and first["ratio"] > 0, row
            assert math.isfinite(refs[0]["ratio"]), row
    assert f"baseline (A): {label} = {sys.executable}" in table
    rate_line = next(line for line in table.splitlines() if line.startswith("drain-session"))
    assert label in rate_line and re.search(r"\d\.\d\dx$", rate_line), rate_line


def test_a_scenario_the_baseline_lacks_is_na(server_url: str, tmp_path: Path) -> None:
    old = tmp_path / "old"
    (old / "flowq").mkdir(parents=True)
    (old / "flowq" / "__init__.py").write_text('__version__ = "0.0.1"\n')
    # An old bench: it knows a few options, and no scenario called drain-session.
    (old / "flowq" / "__main__.py").write_text(
        "import sys\n"
        "if '--help' in sys.argv:\n"
        "    print('--scenario NAME  --repeat N  --quick  --jobs N  --database-url URL')\n"
        "else:\n"
        "    print(\"Error: unknown scenario 'drain-session'\", file=sys.stderr)\n"
        "    sys.exit(2)\n")
    table, doc = bench(server_url, tmp_path, "--baseline-path", str(old))
    baseline = doc["baseline"]
    assert baseline["label"] == "baseline flowq 0.0.1"
    assert "its bench has no scenario 'drain-session'" in baseline["not_measured"][
        "drain-session"]
    for row in doc["scenarios"]["drain-session"]:
        first, *refs = row["references"]
        assert first["values"] == [] and not row["extra"]["baseline"]["measured"], row
        assert first["name"].startswith("baseline flowq 0.0.1: n/a, the baseline could not "
                                        "run it"), first
        assert len(row["flowq"]["values"]) == 2 and refs, row  # this side still ran B B
    assert "n/a, the baseline could not run it" in table
