"""The arithmetic of flowq bench's fixed-rate load and the overload scenario's rows, without a server.

The producer's schedule (`Producer.owed`), the phases the overload scenario offers, the figures
a phase window gives, and the rows built from them are checked on made-up numbers: what the
table shows beside what, and the ratios that come out. The scenario itself runs in
tests/acceptance/test_bench.py.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from flowq_bench.load import MAX_BATCH, PhaseFigures, Producer
from flowq_bench.overload import MAX_RATE, PLACEMENTS, clearing_ms, overload_rows, plan
from flowq_bench.report import render_table

MACHINE: dict[str, Any] = {"cores": 2, "postgresql": "18", "embedded": True}


def test_the_schedule_owes_what_the_rate_asks_for_since_the_last_offer() -> None:
    producer = Producer(engine=None)  # type: ignore[arg-type]  # run() is never called
    assert producer.owed(1e9) == 0  # rate 0: nothing, ever
    producer.offer(1000.0, now=100.0)
    assert producer.owed(100.0205) == 20
    producer.sent(20)
    assert producer.owed(100.0205) == 0
    assert producer.owed(101.0) == 980
    assert producer.owed(3700.0) == MAX_BATCH  # far behind: bounded catch-up steps
    producer.offer(10.0, now=200.0)  # a new phase: its own schedule, the old debt dropped
    assert producer.owed(200.5) == 5
    assert producer.owed(199.0) == 0  # never negative


def test_the_plan_offers_multiples_of_the_peak_capped() -> None:
    phases = plan(3000.0, (0.5, 1.0, 2.0, 4.0))
    assert [(p.name, p.rate) for p in phases] == [("0.5x", 1500.0), ("1x", 3000.0),
                                                  ("2x", 6000.0), ("4x", 12000.0)]
    assert [p.rate for p in plan(1e9, (0.5, 4.0))] == [MAX_RATE, MAX_RATE]


def test_a_phase_gives_rates_over_its_window() -> None:
    p = PhaseFigures("2x", 6000.0, seconds=20.0, offered=119_000, completed=60_000)
    assert (p.offered_per_s, p.completed_per_s) == (5950.0, 3000.0)
    empty = PhaseFigures("0.5x", 1.0, seconds=0.0, offered=0, completed=0)
    assert math.isnan(empty.offered_per_s) and math.isnan(empty.completed_per_s)
    assert p.as_dict()["completed_per_s"] == 3000.0 and p.as_dict()["name"] == "2x"


def test_clearing_time_is_the_backlog_at_the_peak() -> None:
    assert clearing_ms(6000, 3000.0) == 2000.0
    assert clearing_ms(0, 3000.0) == pytest.approx(1 / 3)  # one job's worth, never 0
    assert math.isnan(clearing_ms(10, 0.0)) and math.isnan(clearing_ms(10, math.nan))


def _phases(completed_per_s: dict[str, float]) -> list[PhaseFigures]:
    peak, seconds = 3000.0, 10.0
    out = []
    for m, done in completed_per_s.items():
        rate = float(m.removesuffix("x")) * peak
        out.append(PhaseFigures(m, rate, seconds=seconds, offered=int(rate * seconds),
                                completed=int(done * seconds), p50=5.0 * rate / peak,
                                p99=20.0 * rate / peak,
                                backlog=int(max(0.0, rate - done) * seconds)))
    return out


def test_overload_rows_put_each_figure_beside_its_reference() -> None:
    results = {PLACEMENTS[0]: _phases({"0.5x": 1500, "1x": 2950, "2x": 2900, "4x": 2800}),
               PLACEMENTS[1]: _phases({"0.5x": 1500, "1x": 2400, "2x": 1200, "4x": 600})}
    rows = overload_rows([3000.0, 2900.0, 3100.0], [2500.0], results)
    by_name = {r.flowq.name: r for r in rows}
    assert rows[0].flowq.name == "peak drain, worker in the producer's process"
    assert rows[0].ratios() == [pytest.approx(2500 / 3100)]  # the best drain of each

    done = by_name["completed/s, 2x, own"]
    assert [f.name for f in done.references] == ["offered/s, 2x, own",
                                                 "peak drain, worker in its own process"]
    assert done.ratios() == [pytest.approx(2900 / 6000), pytest.approx(2900 / 3100)]
    inproc = by_name["completed/s, 4x, in-process"]
    assert inproc.ratios() == [pytest.approx(600 / 12000), pytest.approx(600 / 3100),
                               pytest.approx(600 / 2500)]  # beside both peaks
    assert by_name["offered/s, 1x, own"].ratios() == [pytest.approx(1.0)]

    # Pickups beside the 0.5x phase's (which has none of its own), p99 above the peak also
    # beside the time the placement's peak needs to clear the backlog.
    assert "pickup p50, 0.5x, own" not in by_name
    assert by_name["pickup p50, 4x, own"].ratios() == [pytest.approx(8.0)]
    assert by_name["pickup p99, 4x, own"].ratios()[0] == pytest.approx(8.0)
    clear = by_name["pickup p99, 4x, in-process"].references[1]
    assert clear.name == "backlog at the end / peak, in-process"
    assert clear.values == [pytest.approx((12000 - 600) * 10 / 2500 * 1000)]
    assert len(by_name["pickup p99, 1x, own"].references) == 1  # 1x is not above the peak
    assert len({r.flowq.name for r in rows}) == len(rows)  # one row per figure
    assert by_name["backlog at the end, 2x, own"].ratios() == [pytest.approx(31_000 / 60_000)]
    collapse = by_name["completed/s at 2x vs at 1x, in-process"]
    assert collapse.ratios() == [pytest.approx(0.5)] and "0.95" in collapse.note
    assert by_name["completed/s at 2x vs at 1x, own"].ratios() == [pytest.approx(2900 / 2950)]
    for row in rows:  # every figure has a finite reference: the bench's table contract
        assert row.references and all(math.isfinite(r) for r in row.ratios()), row


def test_the_raw_loop_is_the_reference_of_the_fall_past_the_peak() -> None:
    results = {p: _phases({"0.5x": 1500, "1x": 2950, "2x": 2900}) for p in PLACEMENTS}
    raw = _phases({"1x": 2900, "2x": 2100})  # offered 1x and 2x of its own peak (3,000)
    rows = overload_rows([3000.0], [2500.0], results, ([3000.0, 2800.0], raw))
    by_name = {r.flowq.name: r for r in rows}
    assert len(by_name) == len(rows)  # one row per figure
    ceiling = by_name["peak drain, worker in its own process"]
    assert [f.name for f in ceiling.references] == ["peak drain, raw loop"]
    done = by_name["completed/s, 2x, raw loop"]
    assert done.ratios() == [pytest.approx(2100 / 6000), pytest.approx(2100 / 3000)]
    wait = by_name["pickup p99, 2x, raw loop"]
    assert [f.name for f in wait.references] == ["pickup p99, 1x, raw loop",
                                                 "backlog at the end / peak, raw loop"]
    assert wait.references[1].values == [pytest.approx((6000 - 2100) * 10 / 3000 * 1000)]
    assert "pickup p99, 1x, raw loop" not in by_name  # 1x is the calm phase here
    fall = by_name["completed/s at 2x vs at 1x, raw loop"]
    assert fall.ratios() == [pytest.approx(2100 / 2900)] and "raw loop" in fall.note
    for row in rows:
        assert row.references and all(math.isfinite(r) for r in row.ratios()), row


def test_the_table_prints_the_overload_rows() -> None:
    results = {p: _phases({"0.5x": 1500, "1x": 2950, "2x": 2900, "4x": 2800})
               for p in PLACEMENTS}
    table = render_table(MACHINE, overload_rows([3000.0], [2500.0], results), 1)
    lines = table.splitlines()
    line = next(x for x in lines if "completed/s, 2x, own" in x)
    assert "2,900 jobs/s" in line and "offered/s, 2x, own: 6,000 jobs/s" in line
    assert line.rstrip().endswith("0.48x")
    after = lines[lines.index(line) + 1]  # the second reference, on a line of its own
    assert "peak drain, worker in its own process: 3,000 jobs/s" in after
    assert after.rstrip().endswith("0.97x")
