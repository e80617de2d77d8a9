"""A run's status is one rule (`flowq.db.runstatus`): its Python form, its SQL form, and every
public reader that reports a run's status agree, on every shape of run.

The shapes are enumerated, not sampled: every multiset of one to three row statuses (the
closed set of six), laid out as a chain of steps or as one step and the instances of a map
after it, with a running row asked to stop or not, with a pending row due now or later.
Each shape is one run written straight into `flowq.jobs`, all in one database; then the
Python rule, the SQL rule (and the SQL the rule replaced, kept here as a literal), `get_run`,
`list_runs` (with and without its status filter), the dashboard's run page and runs list,
`get_result` and `flowq.ops.status` are read for every run and compared.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from itertools import combinations_with_replacement
from typing import Any

import pytest
import sqlalchemy as sa

from flowq.db import runstatus
from flowq.db.schema import STATUSES, Status
from flowq.db.sql.fragments import RUN_STATUS
from flowq.errors import RunStateError
from flowq.ops.results import get_result
from flowq.ops.runinfo import run_status
from flowq.ops.runs import get_run, list_runs
from flowq.ops.status import status as read_status

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TASK = "shape"
# The SQL rule as it was written by hand before `flowq.db.runstatus` rendered it.
HAND_WRITTEN = """CASE WHEN bool_or(status = 'cancelled' OR cancel_requested)
                           THEN 'cancelled'
                      WHEN bool_or(status = 'running') THEN 'running'
                      WHEN bool_or(status = 'pending') THEN 'pending'
                      WHEN bool_or(status = 'waiting') THEN 'waiting'
                      WHEN bool_or(status = 'dead') THEN 'dead'
                      ELSE 'succeeded' END"""


@dataclass(frozen=True)
class Row:
    status: Status
    cancel_requested: bool = False
    later: bool = False  # a pending row due in an hour


@dataclass(frozen=True)
class Shape:
    rows: tuple[Row, ...]
    mapped: bool  # rows after the first are the instances of one mapped step


def shapes() -> list[Shape]:
    out: list[Shape] = []
    for n in (1, 2, 3):
        for statuses in combinations_with_replacement(STATUSES, n):
            variants = [tuple(Row(s) for s in statuses)]
            if "running" in statuses:  # the first running row asked to stop
                i = statuses.index("running")
                variants.append(tuple(Row(s, cancel_requested=k == i)
                                      for k, s in enumerate(statuses)))
            if "pending" in statuses:  # the first pending row due later
                i = statuses.index("pending")
                variants.append(tuple(Row(s, later=k == i) for k, s in enumerate(statuses)))
            for rows in variants:
                out.append(Shape(rows, mapped=False))
                if n > 1:
                    out.append(Shape(rows, mapped=True))
    return out


def the_rule_by_hand(rows: tuple[Row, ...]) -> Status:
    """The rule as `flowq.ops.runinfo.run_status` wrote it before it had one home."""
    seen = {r.status for r in rows}
    if "cancelled" in seen or any(r.cancel_requested for r in rows):
        return "cancelled"
    for status in ("running", "pending", "waiting", "dead"):
        if status in seen:
            return status  # type: ignore[return-value]
    return "succeeded"


def insert(conn: sa.Connection, shape: Shape) -> int:
    run_id = int(conn.execute(sa.text("SELECT nextval('flowq.run_id_seq')")).scalar_one())
    for k, row in enumerate(shape.rows):
        mapped = shape.mapped and k > 0
        ended = row.status in ("succeeded", "dead", "cancelled")
        conn.execute(sa.text("""
            INSERT INTO flowq.jobs (run_id, task, step, step_index, queue, status, attempts,
                                    cancel_requested, run_at, locked_at, heartbeat_at,
                                    locked_by, finished_at, result, last_error, map_index)
            VALUES (:run_id, :task, :step, :step_index, 'default', :status, :attempts,
                    :cancel_requested,
                    now() + make_interval(secs => :delay),
                    CASE WHEN :status = 'running' THEN now() END,
                    CASE WHEN :status = 'running' THEN now() END,
                    CASE WHEN :status = 'running' THEN 'w' END,
                    CASE WHEN :ended THEN now() END,
                    CASE WHEN :status = 'succeeded' THEN CAST(:result AS jsonb) END,
                    CASE WHEN :status IN ('dead', 'cancelled') THEN 'Boom: ' || :status END,
                    :map_index)"""), {
            "run_id": run_id, "task": TASK, "step": "m" if mapped else f"s{k}",
            "step_index": 1 if mapped else k, "status": row.status,
            "attempts": 0 if row.status in ("pending", "waiting") else 1,
            "cancel_requested": row.cancel_requested, "delay": 3600 if row.later else 0,
            "ended": ended, "result": f'{{"k": {k}}}',
            "map_index": k - 1 if mapped else None})
    return run_id


def test_every_shape_of_run_has_one_status_everywhere(engine: sa.Engine) -> None:
    from starlette.testclient import TestClient

    from flowq.dashboard import create_app

    every = shapes()
    assert len(every) == 270  # 83 multisets, their variants, chained and mapped
    with engine.begin() as conn:
        runs = {insert(conn, shape): shape for shape in every}
    with engine.connect() as conn:
        in_sql = dict(conn.execute(sa.text(
            f"SELECT run_id, {RUN_STATUS} FROM flowq.steps GROUP BY run_id")).all())
        by_hand = dict(conn.execute(sa.text(
            f"SELECT run_id, {HAND_WRITTEN} FROM flowq.steps GROUP BY run_id")).all())
    listed = {r.run_id: r.status for r in list_runs(engine, limit=10_000)}
    filtered = {s: {r.run_id for r in list_runs(engine, status=s, limit=10_000)}
                for s in STATUSES}
    page = TestClient(create_app(engine), base_url="http://127.0.0.1:8080")
    listed_pages = {s: page_run_ids(page, f"/runs?status={s}") for s in STATUSES}

    expected: dict[int, Status] = {}
    for run_id, shape in runs.items():
        rule = the_rule_by_hand(shape.rows)
        expected[run_id] = rule
        where = f"run {run_id} of {shape}"
        assert runstatus.run_status((r.status, r.cancel_requested) for r in shape.rows) == rule
        info = get_run(engine, run_id)
        assert run_status(info.steps) == rule, where
        assert info.status == rule, where
        assert in_sql[run_id] == by_hand[run_id] == rule, where
        assert listed[run_id] == rule, where
        assert {s for s, ids in filtered.items() if run_id in ids} == {rule}, where
        assert {s for s, ids in listed_pages.items() if run_id in ids} == {rule}, where
        shown = page.get(f"/runs/{run_id}")
        assert shown.status_code == 200, shown.text
        badge = re.search(r'<span id="run-status"><span class="status (\w+)">', shown.text)
        assert badge is not None and badge.group(1) == rule, where
        check_result(engine, run_id, shape, rule)

    # `flowq status` counts rows, not runs: what it reports agrees with the rows written.
    st = read_status(engine, limit=1000)
    rows = Counter(r.status for shape in runs.values() for r in shape.rows)
    queue = next(q for q in st.queues if q.name == "default")
    assert queue.dead == rows["dead"]
    assert queue.running == rows["running"]
    assert queue.waiting == rows["waiting"]
    assert {d.task: d.jobs for d in st.dead_by_task} == {TASK: rows["dead"]}
    assert Counter(expected.values())  # every status reached by some shape
    assert set(expected.values()) == set(STATUSES)


def check_result(engine: sa.Engine, run_id: int, shape: Shape, rule: Status) -> None:
    """`get_result` gives a result exactly when the run succeeded, and otherwise names the
    status the rule derives."""
    if rule == "succeeded":
        get_result(engine, run_id)
        return
    with pytest.raises(RunStateError) as caught:
        get_result(engine, run_id)
    assert rule in str(caught.value), (shape, str(caught.value))


def page_run_ids(page: Any, path: str) -> set[int]:
    """The run ids a dashboard runs list links to (every page of it)."""
    found: set[int] = set()
    while path:
        shown = page.get(path)
        assert shown.status_code == 200, shown.text
        found |= {int(i) for i in re.findall(r'href="[^"]*/runs/(\d+)"', shown.text)}
        older = re.search(r'href="([^"]*/runs\?[^"]*before=\d+[^"]*)"', shown.text)
        path = older.group(1).replace("&amp;", "&") if older else ""
    return found
