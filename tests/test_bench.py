"""`flowq bench --quick` end to end against the test server, so the command never rots.

Real `flowq worker` processes and raw loops run every default scenario at tiny sizes. The
test checks the shape of the JSON (every scenario, every figure beside a reference figure),
never a timing: timings belong to `make bench`, not to CI.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

from flowq.bench import DEFAULT_SCENARIOS, SCENARIOS


def test_quick_bench_reports_every_default_scenario_beside_a_reference(server_url: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "flowq", "bench", "--quick", "--json", "--jobs", "120",
         "--database-url", server_url],
        capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    doc = json.loads(done.stdout)
    assert set(doc["scenarios"]) == set(DEFAULT_SCENARIOS)
    assert "soak" not in doc["scenarios"]
    assert doc["machine"]["cores"] >= 1 and doc["machine"]["postgresql"]
    for name, rows in doc["scenarios"].items():
        assert rows, name
        for row in rows:
            assert len(row["flowq"]["values"]) == 1, row  # --quick: one repeat
            assert row["references"], row
            for ref in row["references"]:
                assert ref["values"] and all(math.isfinite(v) for v in ref["values"]), row
                assert math.isfinite(ref["ratio"]), row


def test_unknown_scenario_is_a_usage_error() -> None:
    done = subprocess.run([sys.executable, "-m", "flowq", "bench", "--scenario", "nope"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "unknown scenario 'nope'" in done.stderr
    assert set(SCENARIOS) >= set(DEFAULT_SCENARIOS)


def test_named_scenarios_run_alone_including_opt_in_memory(server_url: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "flowq", "bench", "--quick", "--json", "--jobs", "60",
         "--scenario", "drain", "--scenario", "memory", "--database-url", server_url],
        capture_output=True, text=True, timeout=200, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    doc = json.loads(done.stdout)
    assert list(doc["scenarios"]) == ["drain", "memory"]
    assert "memory" not in DEFAULT_SCENARIOS
    end, peak = doc["scenarios"]["memory"]
    extra = end["extra"]
    assert extra["jobs"] == 60  # --jobs overrides the million
    assert len(extra["processes"]) == 2  # --quick: P=2, one RSS series per worker process
    for row in (end, peak):
        assert row["flowq"]["values"][0] > 0, row  # MB, never a timing
        assert math.isfinite(row["references"][0]["ratio"]), row
