"""`flowq bench --quick` end to end against the test server, so the command never rots.

Real `flowq worker` processes and raw loops run every scenario but the soak and indexes (the
default ones and the opt-in limit, rate, memory, pressure, overload, checkpoint and sleep) at
tiny sizes, in ONE invocation that the tests
below share (`quick_run`): each scenario runs in a database of its own either way, and one
run instead of one per test is what makes this file take about a minute and a half rather
than seven. The tests check the shape of the JSON and the table (every scenario, every
figure beside a reference figure, the sizes the options asked for), never a timing: timings
belong to `make bench`, not to CI. Which scenarios run by default is the CLI's choice,
checked without running them.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from click.testing import CliRunner

import flowq_bench.cli
from flowq.cli import main
from flowq_bench import DEFAULT_SCENARIOS, SCENARIOS
from flowq_bench.baselines import MINIMAL_VARIANTS

# Every scenario but the soak (it runs for --duration) and indexes (no reference figures:
# tests/integration/test_index_plans.py runs its checks), opt-in ones included, in order.
NOT_RUN = {"soak", "indexes"}
RUN_SCENARIOS = [s for s in SCENARIOS if s not in NOT_RUN]
JOBS = 60  # --jobs: drains of 60 jobs, 15 diamond runs, a map of 60 items, memory of 60 jobs
# The phases' lengths, given on the command line (so the options reach the scenarios).
PRESSURE_PHASE, OVERLOAD_PHASE, SLEEP_SECONDS = 1.5, 0.75, 0.6
RUN_TIMEOUT = 500  # seconds; the run takes about 90 on 2 busy cores

pytestmark = pytest.mark.timeout(RUN_TIMEOUT + 100)  # the first test waits for the run


@dataclass(frozen=True)
class QuickRun:
    table: str  # stdout: the table people read
    doc: dict[str, Any]  # --json-file: the same run as JSON
    progress: str  # stderr: what it said as it went


@pytest.fixture(scope="module")
def quick_run(server_url: str, tmp_path_factory: pytest.TempPathFactory) -> QuickRun:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    scenarios = [arg for name in RUN_SCENARIOS for arg in ("--scenario", name)]
    done = subprocess.run(
        [sys.executable, "-m", "flowq", "bench", "--quick", "--jobs", str(JOBS), *scenarios,
         "--pressure-phase", str(PRESSURE_PHASE), "--overload-phase", str(OVERLOAD_PHASE),
         "--sleep-seconds", str(SLEEP_SECONDS),
         "--json-file", str(out), "--database-url", server_url],
        capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return QuickRun(done.stdout, json.loads(out.read_text()), done.stderr)


def test_quick_bench_says_each_scenario_and_repeat_as_it_goes(quick_run: QuickRun) -> None:
    lines = quick_run.progress.splitlines()
    for i, name in enumerate(RUN_SCENARIOS, 1):
        assert f"[{i}/{len(RUN_SCENARIOS)}] running {name} …" in lines, lines
    runs = [line for line in lines if line.endswith(": run 1/1")]
    assert any(line.startswith("  flowq ") for line in runs), lines
    assert any(line.startswith("  raw ") for line in runs), lines
    assert "\r" not in quick_run.progress  # not a terminal: a line each, no bar


def test_quick_bench_reports_every_scenario_beside_a_reference(quick_run: QuickRun) -> None:
    doc = quick_run.doc
    assert set(doc["scenarios"]) == set(SCENARIOS) - NOT_RUN
    assert set(DEFAULT_SCENARIOS) <= set(doc["scenarios"])
    assert doc["machine"]["cores"] >= 1 and doc["machine"]["postgresql"]
    for name, rows in doc["scenarios"].items():
        assert rows, name
        for row in rows:
            assert len(row["flowq"]["values"]) == 1, row  # --quick: one repeat
            assert row["references"], row
            for ref in row["references"]:
                assert ref["values"] and all(math.isfinite(v) for v in ref["values"]), row
                # CPU is counted in clock ticks: a tiny reference drain may take none.
                assert math.isfinite(ref["ratio"]) or ref["unit"] == "µs/job", row


def _selected(args: Sequence[str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The scenarios `flowq bench *args` would run (run_bench replaced: nothing runs)."""
    seen: list[str] = []

    def run_bench(url: str | None, names: Sequence[str], options: Any,
                  **_: Any) -> tuple[str, dict[str, Any]]:
        seen.extend(names)
        return "", {}

    monkeypatch.setattr(flowq_bench.cli, "run_bench", run_bench)
    result = CliRunner().invoke(main, ["bench", "--quick", *args])
    assert result.exit_code == 0, result.output
    return seen


def test_without_a_scenario_the_bench_runs_the_defaults(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    assert _selected([], monkeypatch) == list(DEFAULT_SCENARIOS)
    assert not {"limit", "rate", "soak", "memory"} & set(DEFAULT_SCENARIOS)  # opt-in
    assert _selected(["--scenario", "memory", "--scenario", "drain"], monkeypatch) == [
        "memory", "drain"]


def test_unknown_scenario_is_a_usage_error() -> None:
    result = CliRunner().invoke(main, ["bench", "--scenario", "nope"])
    assert result.exit_code == 2
    assert "unknown scenario 'nope'" in result.stderr
    assert set(SCENARIOS) >= set(DEFAULT_SCENARIOS)


def test_named_scenarios_run_in_order_including_opt_in_memory(quick_run: QuickRun) -> None:
    doc = quick_run.doc
    assert list(doc["scenarios"]) == RUN_SCENARIOS  # those named, in the order named
    assert "memory" not in DEFAULT_SCENARIOS
    end, peak = doc["scenarios"]["memory"]
    extra = end["extra"]
    assert extra["jobs"] == JOBS  # --jobs overrides the million
    assert len(extra["processes"]) == 2  # --quick: P=2, one RSS series per worker process
    for row in (end, peak):
        assert row["flowq"]["values"][0] > 0, row  # MB, never a timing
        assert math.isfinite(row["references"][0]["ratio"]), row


def _figure(table: str, scenario: str, unit: str) -> float:
    """The flowq figure in `unit` on the first line of `scenario` whose metric names it."""
    for line in table.splitlines():
        if line.startswith(scenario + " ") and unit in line:
            match = re.search(rf"  ([\d,.]+) (?:\[[^\]]*\] )?{re.escape(unit)}", line)
            if match:
                return float(match.group(1).replace(",", ""))
    raise AssertionError(f"no {unit} figure for {scenario} in:\n{table}")


def test_dag_and_map_scenarios_print_positive_figures(quick_run: QuickRun) -> None:
    assert {"dag", "map"} <= set(DEFAULT_SCENARIOS)  # they run in seconds at default size
    table = quick_run.table
    assert _figure(table, "dag", "steps/s") > 0
    assert _figure(table, "dag", "runs/s") > 0
    assert _figure(table, "map", "items/s") > 0
    doc = quick_run.doc
    steps, runs = doc["scenarios"]["dag"]
    assert f"{JOBS // 4} runs" in steps["flowq"]["name"]  # --jobs 60: 60 steps = 15 diamonds
    (mapped,) = doc["scenarios"]["map"]
    assert mapped["extra"]["items"] == JOBS  # --jobs overrides the 10,000 items
    for row in (steps, runs, mapped):
        for figure in (row["flowq"], *row["references"]):
            assert figure["values"] and all(v > 0 for v in figure["values"]), row
        assert all(r["ratio"] > 0 for r in row["references"]), row
    for side in ("flowq", "raw"):  # split, fan-out, items, join: seconds, never negative
        (phases,) = mapped["extra"]["phases_s"][side]
        assert len(phases) == 4 and all(p >= 0 for p in phases), phases


def test_limit_and_rate_scenarios_report_limits_kept(quick_run: QuickRun) -> None:
    """The opt-in queue-limit scenarios at --quick sizes (a concurrency limit of 4 under P=2 x
    C=8, Rate(50, per=1s) for 3 s): the figures are printed, the limited queue never had more
    than 4 running, and the starts never beat the bucket. Bounds only, never a speed."""
    assert {"limit", "rate"} <= set(SCENARIOS) - set(DEFAULT_SCENARIOS)  # opt-in
    table = quick_run.table
    assert _figure(table, "limit", "jobs/s") > 0
    assert "max running at once" in table and "starts/s" in table
    doc = quick_run.doc

    drain, peak = doc["scenarios"]["limit"]
    assert drain["extra"]["limit"] == 4
    for figure in (drain["flowq"], *drain["references"]):
        assert figure["values"] and all(v > 0 for v in figure["values"]), drain
    (most,) = peak["flowq"]["values"]
    assert 1 <= most <= 4, peak  # sampled running jobs: the limit was reached, never passed
    for histogram in (*drain["extra"]["histograms"], *drain["extra"]["histograms_fast_poll"]):
        assert max(int(k) for k in histogram) <= 4, histogram

    steady, overall, burst = doc["scenarios"]["rate"]
    r, seconds = 50, 3.0
    (configured, fast_steady) = steady["references"]
    assert configured["values"] == [r]
    assert all(v >= 0 for v in steady["flowq"]["values"]), steady
    # After the first second, a 2 s span: the bucket allows r x (1 + 2) / 2 starts/s at most;
    # with claims every 10 ms the workers keep up with 50/s (a generous floor: 20% of it).
    assert 0.2 * r <= fast_steady["values"][0] <= 1.5 * r, steady
    bound = r * (seconds + 1) / seconds
    for figure in (overall["flowq"], overall["references"][1]):
        assert 0 < figure["values"][0] <= bound + 1e-6, overall
    for figure in (burst["flowq"], burst["references"][1]):  # within 100 ms of the first start
        assert 1 <= figure["values"][0] <= r * 1.1 + 1e-6, burst
    extra = steady["extra"]
    assert max(extra["busiest_1s"] + extra["busiest_1s_fast_poll"]) <= 2 * r, extra


def test_drain_reports_two_concurrencies_a_minimal_table_and_wal(quick_run: QuickRun) -> None:
    """The drain at tiny size: flowq at each of --quick's two concurrencies beside the same
    three references (the third on a minimal table of its own), and a WAL bytes/job row for
    each, with updates per job and HOT share in the JSON. Figures > 0 only, never a speed."""
    assert _figure(quick_run.table, "drain", "jobs/s") > 0
    assert _figure(quick_run.table, "drain", "B/job") > 0
    doc = quick_run.doc
    assert doc["options"]["drain_cs"] == [4, 8]  # --quick's; the default is 16 and 128
    rates_4, rates_8, wal_4, wal_8, *cpu = doc["scenarios"]["drain"]
    # The minimal-table reference is the fastest of its variants, each measured twice.
    fastest = rates_4["references"][2]["name"].split("(")[1].split(")")[0]
    assert fastest in MINIMAL_VARIANTS, rates_4["references"][2]
    for variant in MINIMAL_VARIANTS:
        assert f"{variant} " in wal_4["note"], wal_4["note"]
    minimal = f"raw batched-100, minimal table ({fastest}) P=2"
    refs = ["raw 1/tx P=2", "raw batched-100 P=2", minimal]
    for row, unit, c in ((rates_4, "jobs/s", 4), (rates_8, "jobs/s", 8), (wal_4, "B/job", 4),
                         (wal_8, "B/job", 8)):
        assert f"C={c}" in row["flowq"]["name"] and row["flowq"]["unit"] == unit, row
        assert [r["name"] for r in row["references"]] == refs, row
        for figure in (row["flowq"], *row["references"]):
            assert figure["unit"] == unit
            assert figure["values"] and all(v > 0 for v in figure["values"]), row
        assert all(r["ratio"] > 0 for r in row["references"]), row
    # The same references, measured once, beside both concurrencies.
    assert ([r["values"] for r in rates_4["references"]]
            == [r["values"] for r in rates_8["references"]])
    costs = rates_4["extra"]["costs"]
    assert set(costs) == {"flowq", *refs}
    assert set(costs["flowq"]) == {"C=4", "C=8"}
    for runs in (*costs["flowq"].values(), *(costs[name] for name in refs)):
        (cost,) = runs  # --quick: one repeat
        assert cost["rate"] > 0 and cost["wal_bytes_per_row"] > 0, cost
        assert cost["updates_per_row"] >= 0 and 0 <= cost["hot_pct"] <= 100, cost
    # Updates of the drained table. A finished row leaves flowq.jobs for flowq.job_history,
    # deleted, not updated: flowq and raw batched-100 update a row once (the claim), raw 1/tx
    # never (it locks its row and moves it); the minimal table updates twice (claim, done).
    assert all(runs[0]["updates_per_row"] >= 1 for runs in costs["flowq"].values()), costs
    assert costs["raw batched-100 P=2"][0]["updates_per_row"] == 1
    assert costs["raw 1/tx P=2"][0]["updates_per_row"] == 0
    assert costs[minimal][0]["updates_per_row"] == 2
    _check_cpu_rows(cpu, ["C=4", "C=8"], refs)


def _check_cpu_rows(rows: list[dict[str, Any]], labels: list[str], refs: list[str]) -> None:
    """CPU per job, client then server (when the server is on this machine) for each of
    `labels`, each beside `refs`: µs per job, never negative, never a speed."""
    server = any(r["flowq"]["name"].startswith("server CPU") for r in rows)
    sides = ["client", "server"] if server else ["client"]
    assert [r["flowq"]["name"].split(" CPU")[0] for r in rows] == sides * len(labels), rows
    if not server:
        assert "server CPU n/a" in rows[0]["note"], rows[0]
    for row in rows:
        assert row["flowq"]["unit"] == "µs/job" and not row["flowq"]["higher_is_better"], row
        assert [r["name"] for r in row["references"]] == refs, row
        for figure in (row["flowq"], *row["references"]):
            assert figure["values"] and all(math.isfinite(v) and v >= 0
                                            for v in figure["values"]), row


def test_drain_session_reports_cpu_per_job(quick_run: QuickRun) -> None:
    """The exactly-once drain prints its CPU per job beside the raw 1/tx loop's."""
    rate, *cpu = quick_run.doc["scenarios"]["drain-session"]
    assert rate["flowq"]["unit"] == "jobs/s"
    _check_cpu_rows(cpu, ["P=2 C=8"], ["raw 1/tx + row P=2"])
    assert "client CPU per job" in quick_run.table and "µs/job" in quick_run.table


def test_pressure_reports_each_phase_beside_the_clean_one(quick_run: QuickRun) -> None:
    """The pressure scenario at tiny size: for the snapshot, recovery and reader phases, the
    same six figures beside the clean phase's; completions and offered jobs counted, never a
    speed asserted."""
    rows = quick_run.doc["scenarios"]["pressure"]
    names = [r["flowq"]["name"] for r in rows]
    for phase in ("snapshot", "recovery", "reader"):
        for label in ("completions / offered", "pickup p50", "pickup p99", "backlog at the end",
                      "WAL per completed job", "dead tuples of flowq.jobs at the end",
                      "dead tuples of flowq.job_history at the end",
                      "size of flowq.jobs at the end", "size of flowq.job_history at the end"):
            assert f"{label}, {phase}" in names, names
    for row in rows:
        (ref,) = row["references"]
        assert ref["name"].endswith(", clean") or ref["unit"] == "jobs", row
        assert all(math.isfinite(v) and v >= 0 for v in (*row["flowq"]["values"],
                                                          *ref["values"])), row
    assert all(r["flowq"]["values"][0] > 0 for r in rows
               if r["flowq"]["name"].startswith("completions / offered"))
    assert "jobs/s offered to P=1" in rows[0]["note"]
    assert f"{PRESSURE_PHASE:g} s per phase" in rows[0]["note"]  # --pressure-phase


def test_overload_offers_multiples_of_the_peak_in_both_placements(quick_run: QuickRun) -> None:
    """The overload scenario at tiny size: one worker's peak, then 0.5x to 4x of it offered
    to the worker in its own process and in the bench's, each phase read from the job rows.
    Shapes and counts only: what the worker kept up with is the bench's to report."""
    rows = quick_run.doc["scenarios"]["overload"]
    names = [r["flowq"]["name"] for r in rows]
    assert len(set(names)) == len(names), names
    assert names[0] == "peak drain, worker in the producer's process"
    for where in ("own", "in-process"):
        for m in ("0.5x", "1x", "2x", "4x"):
            for label in ("offered/s", "completed/s", "backlog at the end"):
                assert f"{label}, {m}, {where}" in names, names
        for m in ("1x", "2x", "4x"):
            assert f"pickup p50, {m}, {where}" in names and f"pickup p99, {m}, {where}" in names
        assert f"completed/s at 2x vs at 1x, {where}" in names
    # The reference: the same producer feeding a raw loop, 1x and 2x of its own peak.
    for label in ("completed/s, 1x, raw loop", "completed/s, 2x, raw loop",
                  "pickup p99, 2x, raw loop", "completed/s at 2x vs at 1x, raw loop",
                  "peak drain, worker in its own process"):
        assert label in names, names
    extra = rows[0]["extra"]
    assert "P=1 C=8" in rows[0]["note"]  # --quick's concurrency
    assert f"each offered load for {OVERLOAD_PHASE:g} s" in rows[0]["note"]  # --overload-phase
    assert [len(v) for v in extra["peaks"].values()] == [1, 1, 1]  # --quick: one drain each
    raw = extra["phases"].pop("raw loop")
    assert [p["name"] for p in raw] == ["1x", "2x"]
    assert raw[1]["rate"] == pytest.approx(2 * raw[0]["rate"])
    assert all(p["offered"] > 0 and math.isfinite(p["p99"]) for p in raw), raw
    asked = {}
    for place, phases in extra["phases"].items():
        assert [p["name"] for p in phases] == ["0.5x", "1x", "2x", "4x"], place
        asked[place] = [p["rate"] for p in phases]
        base = asked[place][0]
        assert asked[place] == pytest.approx([base, 2 * base, 4 * base, 8 * base]), place
        for p in phases:
            assert p["offered"] > 0 and p["seconds"] > 0, p
            assert p["completed"] >= 0 and 0 <= p["backlog"] <= p["offered"], p
            assert math.isfinite(p["p50"]) and p["p50"] <= p["p99"], p
        # Each phase starts from an empty queue, so no window completes more than was offered
        # in the windows so far (the drains between phases fall outside every window).
        assert sum(p["completed"] for p in phases) <= sum(p["offered"] for p in phases)
    assert asked["own process"] == asked["producer's process"]  # the same loads for both


def test_sleep_reports_wall_lag_and_sleepers_beside_delayed_jobs(quick_run: QuickRun) -> None:
    """The sleep scenario at tiny size: --jobs runs of one ctx.sleep(--sleep-seconds), each
    checked succeeded with attempts = 1 by the bench itself, beside as many delayed no-op
    jobs. Shapes and counts only."""
    wall, p50, p99, asleep = quick_run.doc["scenarios"]["sleep"]
    assert f"{JOBS} runs of ctx.sleep({SLEEP_SECONDS:g})" in wall["flowq"]["name"]
    assert "P=1 C=4" in wall["flowq"]["name"]  # --quick's sleep concurrency
    assert [r["unit"] for r in wall["references"]] == ["s", "s"]
    assert wall["references"][1]["values"] == [SLEEP_SECONDS]  # the ideal
    assert f"delay={SLEEP_SECONDS:g}" in wall["references"][0]["name"]
    for row in (p50, p99):
        assert row["flowq"]["unit"] == "ms" and row["references"][0]["unit"] == "ms", row
    assert p50["flowq"]["median"] <= p99["flowq"]["median"]
    (most,) = asleep["flowq"]["values"]
    assert 1 <= most <= JOBS, asleep  # sampled: some were asleep at once, never more than N
    (waiting,) = asleep["references"][0]["values"]
    assert 1 <= waiting <= JOBS, asleep  # the delayed jobs all wait from the enqueue on
