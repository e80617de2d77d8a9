"""Every feature statement is index-served (issue 21): the bench's `indexes` checks, small.

`flowq bench --scenario indexes` EXPLAINs the same list over 10,000,000 retained rows
(docs/benchmarks.md); here 20,000, so it runs in seconds. With the real planner after ANALYZE,
none reads a partition of flowq.job_history (where the finished rows are) by a Seq Scan, nor
flowq.jobs but where it holds a few pages (its live part, at this size) or the statement
counts every live row (the smaller tables may be read so too: a seq scan of a few pages is
what the planner should pick there); with seq scans disabled, an index serves every statement on every
table, which is what the planner picks once they are large.
"""

from __future__ import annotations

import json

import psycopg
import pytest
import sqlalchemy as sa

from flowq.worker.connection import PLANNER_OPTIONS
from flowq_bench.indexes import BY_DESIGN, LIVE_COUNTS, Check, checks, explain, fill

ROWS = 20_000
# Since revision 0018 flowq.jobs holds the live part only (`indexes.live_size`: 400 rows here,
# 4,000 from 200,000 retained rows on, so at 10,000,000 too), the finished rows are in
# flowq.job_history. Seq Scans on flowq.jobs that the real planner rightly picks at this size
# (a few pages), where an index serves the same statement over a bigger live part.
SMALL_TABLE: dict[str, str] = {
    "runs list --task": "a task matching 5% of the rows: reading the few pages is cheaper",
    "runs list --queue": "400 live rows: reading them is cheaper than the index",
    "dashboard: activity": "400 live rows: reading them is cheaper than the index",
    "dashboard: running": "400 live rows: reading them is cheaper than the index",
    # PostgreSQL 15 reads the 15 pages; 18 walks jobs_run_id_idx.
    "dashboard: due times": "400 live rows: reading them is cheaper than the index",
    "runs of a page": "400 live rows: reading them is cheaper than the index (PostgreSQL 15)",
}
# The day partitions hold a few thousand rows each here, today's a few hundred (the fill
# spreads 20,000 over four days): a partition of fewer pages than this may be read whole, as
# flowq.jobs above; at 10,000,000 rows a day holds millions (the bench checks those).
SMALL_PAGES = 64
@pytest.fixture
def filled(db_url: str) -> str:
    url = sa.make_url(db_url).set(drivername="postgresql").render_as_string(
        hide_password=False)
    fill(url, ROWS)
    return url


def test_no_statement_reads_a_job_table_by_a_seq_scan(filled: str) -> None:
    found = checks(filled)
    assert len(found) >= 60
    with psycopg.connect(filled) as conn:
        small = {r[0] for r in conn.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'flowq' AND c.relkind = 'r' AND c.relpages < %s",
            [SMALL_PAGES])}
    for check in found:
        if check.label in BY_DESIGN:
            continue
        plan = explain(filled, check)
        shown = f"{plan.line()}\n{json.dumps(plan.plan, indent=1)}"
        if check.label not in MERGED_WHEN_LARGE:  # the finished rows: never read whole
            assert not set(plan.history_seq_scans) - small, shown
        if (check.label not in SMALL_TABLE and check.label not in LIVE_COUNTS
                and check.label not in MERGED_WHEN_LARGE):
            assert "jobs" not in plan.seq_scans, shown


def test_the_finished_rows_are_in_job_history(filled: str) -> None:
    """`fill` writes the layout revision 0018 leaves: finished rows retired to job_history
    (into the day partitions of the days they ended), only live ones in jobs; a Seq Scan
    there is named, one of an empty partition (DEFAULT, the days ahead) told apart."""
    with psycopg.connect(filled) as conn:
        live, finished = conn.execute(
            "SELECT (SELECT count(*) FROM flowq.jobs WHERE status IN "
            "('succeeded', 'dead', 'cancelled')), (SELECT count(*) FROM flowq.job_history)"
        ).fetchone() or (None, None)
    assert live == 0
    assert finished is not None and finished >= ROWS
    scan = explain(filled, Check("whole history", sa.text(
        "SELECT count(*) FROM flowq.job_history WHERE args->>'user_id' = '7'"), {}, False))
    assert scan.history_seq_scans, scan.line()
    assert all(t.startswith("job_history_2") for t in scan.history_seq_scans), scan.line()
    assert "job_history_default" in scan.empty_scans, scan.line()
    assert not scan.served and "(flowq.job_history)" in scan.line()


# The runs pages read both job tables through `flowq.steps` (a UNION ALL): at this size the
# planner may hash the candidate run ids of both (20,000 entries, cheaper than a merge), or
# read the few pages of a filter's matches, where with 2,000,000 retained rows it walks both
# run id indexes in order, merged (a Merge Append: 311 buffers for the first page, about 2,500
# with --task, --queue or --since; measured with `flowq bench --scenario indexes`).
MERGED_WHEN_LARGE: frozenset[str] = frozenset({
    "runs list", "runs list --task", "runs list --queue", "runs list --since",
    "runs list, page 2", "runs list --status dead", "dead runs (redrive)"})


def test_an_index_can_serve_every_statement(filled: str) -> None:
    for check in checks(filled):
        if check.label in BY_DESIGN or check.label in MERGED_WHEN_LARGE:
            continue
        plan = explain(filled, check, options=PLANNER_OPTIONS)
        assert plan.served, f"{plan.line()}\n{json.dumps(plan.plan, indent=1)}"
