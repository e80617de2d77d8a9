"""The workflow examples run to completion (against the test database, not an embedded one)
and print what docs/workflows.md says they show."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parents[2] / "examples"


def run_example(name: str, db_url: str) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), db_url],
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_etl_dag_example_fans_out_and_joins(db_url: str) -> None:
    out = run_example("etl_dag.py", db_url)
    assert ("summary: 3/3 runs succeeded, 3 batches published, 5 files loaded by 6 load_file "
            "calls (1 retry), open_batch called 3 times") in out
    assert ("handler calls: open_batch 3, list_files 3, load_file 6, summarize 3, "
            "check_totals 3, render_report 3, publish 3") in out
    assert "'report': '2024-05-01: 3 files, 6 rows, 226.40 EUR'" in out
    assert "'report': '2024-05-03: 0 files, 0 rows, 0.00 EUR'" in out  # an empty map
    assert "load_file      succeeded  attempts 3, 2 instances  <- list_files" in out
    assert out.count("summarize      succeeded  attempts 1  <- open_batch, load_file") == 3


def test_approval_flow_example_delivers_only_committed_signals(db_url: str) -> None:
    out = run_example("approval_flow.py", db_url)
    assert ("summary: 3 documents published, approvals recorded: ann, cy, eve, request_review "
            "called 3 times, publish called 3 times, timed out and retried: True") in out
    assert "responses: 200 200 409 503 200 409 200" in out
    assert "ann approves the price list: 200 approved (kept until review)" in out
    assert "ann double-clicks: 200 already approved" in out
    assert "cy approves, but the audit log is down: 503" in out
    assert "the run is still waiting" in out
    assert "the run is dead: SignalTimeout: signal 'approval' did not arrive within 4s" in out
    assert "after flowq runs retry: waiting" in out


def test_durable_example_charges_once_sleeps_and_snoozes(db_url: str) -> None:
    out = run_example("durable.py", db_url)
    assert ("summary: 3 orders, 3 charges, 3 shipments, charge called 3 times, ship called 3 "
            "times, every run on attempt 2 (one crash each): True") in out
    assert out.count("checkpoint flowq.sleep.0: {'until': ") == 3
    assert "checkpoint label: LBL-101" in out


def test_children_example_fans_out_waits_fails_and_cancels(db_url: str) -> None:
    out = run_example("children.py", db_url)
    assert ("summary: 7 children for 3 albums, resize called 7 times, 2 children cancelled "
            "with the archive") in out
    assert "'thumbnails': ['beach.jpg@320', 'dunes.jpg@320', 'sunset.jpg@320']" in out
    assert "ended dead in step 'resize': ValueError: cannot decode ice.broken" in out
