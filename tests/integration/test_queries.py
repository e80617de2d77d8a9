"""The worker's SQL (flowq.db.sql) against a real PostgreSQL: the claim and every fenced write."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from flowq.db.sql import Queries
from flowq.testing import job_rows
from flowq_bench.indexes import plan_nodes

Q = Queries("flowq")


def insert_jobs(conn: sa.Connection, n: int, *, queue: str = "default", status: str = "pending",
                priority: int = 0, run_at: str = "now()", attempts: int = 0,
                max_attempts: int = 10) -> list[int]:
    """Insert `n` bare rows with SQL (fast, and independent of enqueue); returns their ids."""
    finished = "now()" if status in ("succeeded", "dead", "cancelled") else "NULL"
    rows = conn.execute(sa.text(f"""
        INSERT INTO flowq.jobs (task, step, queue, status, priority, run_at, attempts,
                                max_attempts, finished_at)
        SELECT 't', 't', :queue, :status, :priority, {run_at}, :attempts, :max_attempts,
               {finished}
        FROM generate_series(1, :n) RETURNING id"""),
        {"n": n, "queue": queue, "status": status, "priority": priority,
         "attempts": attempts, "max_attempts": max_attempts})
    return sorted(r.id for r in rows)


def claim(conn: sa.Connection, queue: str = "default", limit: int = 10,
          worker: str = "w1") -> list[Any]:
    return list(conn.execute(Q.claim_jobs, {"queue": queue, "limit": limit, "worker": worker}))


def row(engine: sa.Engine, job_id: int) -> Any:
    return job_rows(engine, where="id = :id", id=job_id)[0]


# -- the claim ------------------------------------------------------------------------------


def _explain(engine: sa.Engine, statement: sa.TextClause, **binds: Any) -> Any:
    """The JSON plan of `statement` with `binds` written in as literals (never run)."""
    compiled = statement.bindparams(**binds).compile(
        engine, compile_kwargs={"literal_binds": True})
    with engine.connect() as conn:
        raw = conn.execute(sa.text("EXPLAIN (FORMAT JSON) " + str(compiled))).scalar()
        conn.rollback()
    return raw if isinstance(raw, list) else json.loads(str(raw))


def test_claim_uses_the_partial_pending_index(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        insert_jobs(conn, 20_000, status="succeeded")
        insert_jobs(conn, 1_000, queue="default")
        insert_jobs(conn, 1_000, queue="emails")
        conn.execute(sa.text("ANALYZE flowq.jobs"))
    plan = _explain(engine, Q.claim_jobs, queue="emails", limit=10, worker="w1")
    indexes = {n.get("Index Name") for n in plan_nodes(plan)}
    assert "jobs_pending_idx" in indexes, json.dumps(plan, indent=1)


def test_the_reap_reads_the_running_index_and_each_entry_by_name(engine: sa.Engine) -> None:
    """The reaper's scan: running rows by heartbeat age, each worker's entry by primary key
    (the jobs of live workers that beat their entry only are read at every pass)."""
    with engine.begin() as conn:
        insert_jobs(conn, 20_000, status="succeeded")
        ids = insert_jobs(conn, 500)
        conn.execute(sa.text("UPDATE flowq.jobs SET status = 'running', locked_by = 'w', "
                             "heartbeat_at = now() WHERE id = ANY(:ids)"), {"ids": ids})
        conn.execute(sa.text("ANALYZE flowq.jobs"))
    plan = _explain(engine, Q.reap_jobs, stale=30.0, limit=1000, channel="flowq")
    indexes = {n.get("Index Name") for n in plan_nodes(plan)}
    assert {"jobs_running_idx", "workers_pkey"} <= indexes, json.dumps(plan, indent=1)


def test_the_cursor_claim_starts_its_index_scan_at_the_cursor(engine: sa.Engine) -> None:
    """The row comparison of `claim_jobs_after` is a condition of the pending index's scan,
    not a filter after it: that is what skips the dead entries an open snapshot keeps at the
    head (issue 21)."""
    with engine.begin() as conn:
        insert_jobs(conn, 2_000)
        conn.execute(sa.text("ANALYZE flowq.jobs"))
    with engine.connect() as conn:
        raw = conn.execute(sa.text("EXPLAIN (FORMAT JSON) " + str(Q.claim_jobs_after)), {
            "queue": "default", "limit": 10, "worker": "w", "priority": 0,
            "run_at": "2000-01-01T00:00:00Z", "id": 1000}).scalar()
        conn.rollback()
    plan = raw if isinstance(raw, list) else json.loads(str(raw))
    scans = [n for n in plan_nodes(plan) if n.get("Index Name") == "jobs_pending_idx"]
    assert scans and "priority" in str(scans[0].get("Index Cond")), json.dumps(plan, indent=1)

def test_claim_marks_rows_running_and_never_exceeds_the_limit(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        ids = insert_jobs(conn, 7)
    with engine.begin() as conn:
        got = claim(conn, limit=5, worker="w-a")
    assert len(got) == 5
    assert all(r.attempts == 1 for r in got)
    assert {r.id for r in got} == set(ids[:5])
    rows = {r.id: r for r in job_rows(engine)}
    for i in ids[:5]:
        assert rows[i].status == "running"
        assert rows[i].locked_by == "w-a"
        assert rows[i].heartbeat_at is not None and rows[i].locked_at is not None
    assert [rows[i].status for i in ids[5:]] == ["pending", "pending"]
    with engine.begin() as conn:
        assert len(claim(conn, limit=100)) == 2
        assert claim(conn, limit=100) == []


def test_concurrent_claims_get_disjoint_rows(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        ids = insert_jobs(conn, 10)
    with engine.connect() as c1, engine.connect() as c2:
        first = claim(c1, limit=6, worker="a")  # transaction still open: rows locked
        second = claim(c2, limit=6, worker="b")  # SKIP LOCKED: does not wait, takes the rest
        assert len(first) == 6 and len(second) == 4
        assert not {r.id for r in first} & {r.id for r in second}
        c1.commit()
        c2.commit()
    assert {r.id for r in job_rows(engine, where="status = 'running'")} == set(ids)


def test_claim_orders_by_priority_then_run_at_and_skips_future_jobs(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        [late] = insert_jobs(conn, 1, priority=0, run_at="now() - interval '1 minute'")
        [early] = insert_jobs(conn, 1, priority=0, run_at="now() - interval '1 hour'")
        [urgent] = insert_jobs(conn, 1, priority=-5, run_at="now() - interval '1 second'")
        [low] = insert_jobs(conn, 1, priority=5, run_at="now() - interval '1 day'")
        insert_jobs(conn, 1, priority=-10, run_at="now() + interval '1 hour'")
        insert_jobs(conn, 1, queue="other", priority=-10)
    with engine.begin() as conn:
        got = [r.id for r in claim(conn, limit=1)] + [r.id for r in claim(conn, limit=10)]
    assert got == [urgent, early, late, low]


def test_claim_only_takes_pending_rows_of_its_queue(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        for status in ("running", "succeeded", "dead", "cancelled"):
            insert_jobs(conn, 1, status=status)
        [mine] = insert_jobs(conn, 1, queue="mine")
    with engine.begin() as conn:
        assert claim(conn, queue="default") == []
        assert [r.id for r in claim(conn, queue="mine")] == [mine]


# -- fenced writes ------------------------------------------------------------------------


@pytest.fixture
def claimed(engine: sa.Engine) -> Any:
    """One job claimed by worker w1 (attempts = 1)."""
    with engine.begin() as conn:
        insert_jobs(conn, 1)
        [job] = claim(conn)
    return job


def _fenced_writes(job_id: int, lease: int) -> list[tuple[str, sa.TextClause, dict[str, Any]]]:
    arrays = {"ids": [job_id], "leases": [lease]}
    return [
        ("heartbeat_jobs", Q.heartbeat_jobs, {**arrays, "worker": "w1", "progress": [None]}),
        ("complete_jobs", Q.complete_jobs, {**arrays, "results": ['{"ok": 1}'],
                                            "channel": "flowq"}),
        ("complete_job", Q.complete_job, {"id": job_id, "lease": lease,
                                          "result": '{"ok": 1}', "channel": "flowq"}),
        ("complete_steps", Q.complete_steps, {
            **arrays, "results": ["{}"], "next_ids": [job_id], "next_leases": [lease],
            "next_tasks": ["t"],
            "next_steps": ["next"], "next_step_indexes": [1], "next_queues": ["default"],
            "next_max_attempts": [3], "next_args": ["{}"], "next_map_indexes": [None],
            "next_delays": [0.0], "channel": "flowq"}),
        ("complete_step", Q.complete_step, {
            "id": job_id, "lease": lease, "result": "{}", "next_ids": [job_id],
            "next_leases": [lease], "next_tasks": ["t"],
            "next_steps": ["next"], "next_step_indexes": [1], "next_queues": ["default"],
            "next_max_attempts": [3], "next_args": ["{}"], "next_map_indexes": [None],
            "next_delays": [0.0], "channel": "flowq"}),
        ("retry_job", Q.retry_job, {"id": job_id, "lease": lease, "delay": 5.0,
                                    "error": "boom"}),
        ("end_job", Q.end_job, {"id": job_id, "lease": lease, "status": "dead",
                                "error": "boom", "channel": "flowq"}),
        ("release_jobs", Q.release_jobs, {**arrays, "channel": "flowq"}),
        ("suspend_job", Q.suspend_job, {"id": job_id, "lease": lease, "step": "s",
                                        "until": None, "delay": 5.0, "snoozes": 1,
                                        "note": None}),
        ("record_checkpoint", Q.record_checkpoint, {
            "id": job_id, "lease": lease, "run_id": 1, "step": "s", "map_index": None,
            "name": "n", "position": 0, "result": "1", "sleep": None, "until": None}),
    ]


FENCED = ["heartbeat_jobs", "complete_jobs", "complete_job", "complete_steps",
          "complete_step", "retry_job", "suspend_job", "end_job", "release_jobs"]


def _snapshot(engine: sa.Engine, job_id: int) -> tuple[Any, ...]:
    return tuple(row(engine, job_id))


@pytest.mark.parametrize("name", FENCED)
def test_fenced_write_with_a_stale_lease_changes_nothing(engine: sa.Engine, claimed: Any,
                                                         name: str) -> None:
    with engine.begin() as conn:  # make heartbeat_at distinguishable from now()
        conn.execute(sa.text("UPDATE flowq.jobs SET heartbeat_at = now() - interval '1 minute'"))
    before = _snapshot(engine, claimed.id)
    stmt, params = next((s, p) for n, s, p in _fenced_writes(claimed.id, claimed.lease - 1)
                        if n == name)
    with engine.begin() as conn:
        assert conn.execute(stmt, params).all() == []
    assert _snapshot(engine, claimed.id) == before


@pytest.mark.parametrize("status", ["pending", "succeeded", "dead", "cancelled"])
@pytest.mark.parametrize("name", FENCED)
def test_fenced_write_on_a_row_no_longer_running_changes_nothing(
        engine: sa.Engine, claimed: Any, name: str, status: str) -> None:
    with engine.begin() as conn:  # e.g. reaped, or ended by another worker
        conn.execute(sa.text("UPDATE flowq.jobs SET status = :s"), {"s": status})
    before = _snapshot(engine, claimed.id)
    stmt, params = next((s, p) for n, s, p in _fenced_writes(claimed.id, claimed.lease)
                        if n == name)
    with engine.begin() as conn:
        assert conn.execute(stmt, params).all() == []
    assert _snapshot(engine, claimed.id) == before


def test_fenced_writes_apply_when_the_claim_matches(engine: sa.Engine, claimed: Any) -> None:
    writes = {n: (s, p) for n, s, p in _fenced_writes(claimed.id, claimed.lease)}

    def apply(name: str) -> list[Any]:
        stmt, params = writes[name]
        with engine.begin() as conn:
            return list(conn.execute(stmt, params).all())

    assert len(apply("heartbeat_jobs")) == 1
    [retried] = apply("retry_job")
    assert retried.status == "pending"
    r = row(engine, claimed.id)
    assert r.last_error == "boom" and r.locked_by is None and r.heartbeat_at is None
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT run_at > now() + interval '4 seconds' FROM "
                                    "flowq.jobs WHERE id = :id"), {"id": claimed.id}).scalar()


def test_complete_and_end_and_release_with_a_matching_claim(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        insert_jobs(conn, 3)
        a, b, c = claim(conn)
    with engine.begin() as conn:
        [done] = conn.execute(Q.complete_jobs, {"ids": [a.id], "leases": [a.lease],
                                                "results": ['{"x": 1}'],
                                                "channel": "flowq"}).all()
        assert done.id == a.id and done.cancel_requested is False
        [ended] = conn.execute(Q.end_job, {"id": b.id, "lease": b.lease, "status": "dead",
                                           "error": "E", "channel": "flowq"}).all()
        assert ended.status == "dead"
        [_released] = conn.execute(Q.release_jobs, {"ids": [c.id], "leases": [c.lease],
                                                    "channel": "flowq"}).all()
    ra, rb, rc = (row(engine, i) for i in (a.id, b.id, c.id))
    assert (ra.status, ra.result, ra.finished_at is not None) == ("succeeded", {"x": 1}, True)
    assert (rb.status, rb.last_error, rb.finished_at is not None) == ("dead", "E", True)
    assert (rc.status, rc.attempts, rc.locked_by) == ("pending", 0, None)


def test_retry_job_cancels_when_the_run_was_cancelled(engine: sa.Engine, claimed: Any) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE flowq.jobs SET cancel_requested = true"))
        [r] = conn.execute(Q.retry_job, {"id": claimed.id, "lease": claimed.lease,
                                         "delay": 1.0, "error": "x"}).all()
    assert r.status == "cancelled"
    assert row(engine, claimed.id).finished_at is not None


def test_release_ends_a_cancelled_runs_step_instead_of_requeueing_it(
        engine: sa.Engine, claimed: Any) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE flowq.jobs SET cancel_requested = true"))
        [released] = conn.execute(Q.release_jobs, {"ids": [claimed.id],
                                                   "leases": [claimed.lease],
                                                   "channel": "flowq"}).all()
    r = row(engine, claimed.id)
    assert released.id == claimed.id
    assert (r.status, r.attempts) == ("cancelled", 0)
    assert r.finished_at is not None


def test_single_step_completion_inserts_the_successor(engine: sa.Engine, claimed: Any) -> None:
    writes = {n: (s, p) for n, s, p in _fenced_writes(claimed.id, claimed.lease)}
    stmt, params = writes["complete_step"]
    with engine.begin() as conn:
        [done] = conn.execute(stmt, params).all()
    assert (done.id, done.cancel_requested, done.woken) == (claimed.id, False, 1)
    successor = job_rows(engine, where="id <> :id", id=claimed.id)
    assert [(r.step, r.step_index, r.status, r.max_attempts) for r in successor] == [
        ("next", 1, "pending", 3)]


# -- plans when the statistics lie ----------------------------------------------------------


@pytest.mark.parametrize("dead", [False, True], ids=["vacuumed", "dead-rows"])
@pytest.mark.parametrize("name", ["claim_jobs", "heartbeat_jobs", "complete_jobs",
                                  "complete_steps", "release_jobs", "complete_job",
                                  "complete_step", "retry_job", "end_job"])
def test_hot_statements_stay_index_lookups_on_a_table_analyzed_empty(engine: sa.Engine,
                                                                     name: str,
                                                                     dead: bool) -> None:
    """A queue that drained is analyzed empty; the next burst must not get whole-table plans
    (a completion batch hash-joined over the whole running index took seconds in the bench).
    `dead`: analyzed while the drained rows are dead but not vacuumed (an open snapshot keeps
    them), as in the bench's pressure scenario, where the completion's parent lookup walked
    the pending index instead of the primary key."""
    from flowq.worker.connection import HOT_PATH_OPTIONS

    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        if dead:
            insert_jobs(conn, 20_000)
            conn.execute(sa.text("DELETE FROM flowq.jobs"))
            conn.execute(sa.text("ANALYZE flowq.jobs"))  # no live row, 20,000 dead
        else:
            conn.execute(sa.text("VACUUM ANALYZE flowq.jobs"))  # empty: reltuples = 0
    with engine.begin() as conn:  # a burst: 20,000 jobs, 1,000 running, a batch of 200
        ids = insert_jobs(conn, 20_000)
        conn.execute(sa.text("UPDATE flowq.jobs SET status = 'running', attempts = 1, "
                             "lease = id WHERE id <= :last"), {"last": ids[999]})
    batch = ids[:200]
    leases = batch
    params: dict[str, Any] = {
        "claim_jobs": {"queue": "default", "limit": 100, "worker": "w"},
        "heartbeat_jobs": {"ids": batch, "leases": leases, "worker": "w",
                           "progress": [None] * 200},
        "release_jobs": {"ids": batch, "leases": leases, "channel": "flowq"},
        "complete_jobs": {"ids": batch, "leases": leases, "results": ["{}"] * 200,
                          "channel": "flowq"},
        "complete_steps": {"ids": batch, "leases": leases, "results": ["{}"] * 200,
                           "next_ids": batch, "next_leases": leases,
                           "next_tasks": ["t"] * 200,
                           "next_steps": ["s"] * 200, "next_step_indexes": [1] * 200,
                           "next_queues": ["q"] * 200, "next_max_attempts": [3] * 200,
                           "next_args": ["{}"] * 200, "next_map_indexes": [None] * 200,
                           "next_delays": [0.0] * 200, "channel": "flowq"},
        "complete_job": {"id": ids[0], "lease": ids[0], "result": "{}", "channel": "flowq"},
        "complete_step": {"id": ids[0], "lease": ids[0], "result": "{}", "next_ids": [ids[0]],
                          "next_leases": [ids[0]],
                          "next_tasks": ["t"], "next_steps": ["s"], "next_step_indexes": [1],
                          "next_queues": ["q"], "next_max_attempts": [3], "next_args": ["{}"],
                          "next_map_indexes": [None], "next_delays": [0.0],
                          "channel": "flowq"},
        "retry_job": {"id": ids[0], "lease": ids[0], "delay": 1.0, "error": "e"},
        "end_job": {"id": ids[0], "lease": ids[0], "status": "dead", "error": "e",
                    "channel": "flowq"},
    }[name]
    # The single-row writes run on the handler's own session too: no planner options there.
    single = name in ("complete_job", "complete_step", "retry_job", "end_job")
    options = {} if single else {"options": HOT_PATH_OPTIONS}
    url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, **options) as conn:
        from flowq.db.runner import raw_sql

        stmt = getattr(Q, name)
        plan = conn.execute("EXPLAIN (FORMAT JSON) " + raw_sql(stmt), params).fetchone()
        conn.rollback()
    assert plan is not None
    nodes = list(plan_nodes(plan[0]))
    scans = [n for n in nodes if n.get("Relation Name") == "jobs" and "Scan" in n["Node Type"]]
    shown = json.dumps(plan[0], indent=1)
    assert scans, shown
    # Only the claim walks the pending index. A completion that reached its parents' rows
    # through it (`wake_parents`, `run_at > now()`) walked every pending job at every batch:
    # minutes each behind an open snapshot, in `flowq bench --scenario pressure`.
    allowed = ("jobs_pkey", "jobs_pending_idx") if name == "claim_jobs" else ("jobs_pkey",)
    for scan in scans:  # a lookup, never a walk over a whole index or the heap
        if scan["Node Type"] == "Bitmap Heap Scan":  # the ids of a batch, as one bitmap
            [scan] = scan["Plans"]
            assert scan["Node Type"] == "Bitmap Index Scan", shown
        else:
            assert scan["Node Type"] == "Index Scan", shown
        assert scan["Index Name"] in allowed, shown
        assert "Index Cond" in scan, shown


def test_a_lease_never_repeats_so_an_old_claim_writes_nothing(engine: sa.Engine,
                                                              claimed: Any) -> None:
    """`attempts` goes down on release and back to 0 on `runs retry`, so an old claim's attempt
    number comes round again; its lease never does (issue 9, defect 13)."""
    from flowq.ops.runs import retry_run

    old = claimed
    with engine.begin() as conn:
        conn.execute(Q.release_jobs, {"ids": [old.id], "leases": [old.lease],
                                      "channel": "flowq"})
        [again] = claim(conn)
    assert again.attempts == old.attempts and again.lease > old.lease
    for _name, stmt, params in _fenced_writes(old.id, old.lease):
        with engine.begin() as conn:
            assert conn.execute(stmt, params).all() == []
    with engine.begin() as conn:
        conn.execute(Q.end_job, {"id": again.id, "lease": again.lease, "status": "dead",
                                 "error": "E", "channel": "flowq"})
    retry_run(engine, again.run_id)
    with engine.begin() as conn:
        [third] = claim(conn)
    assert third.attempts == old.attempts == 1
    assert len({old.lease, again.lease, third.lease}) == 3
    before = _snapshot(engine, old.id)
    for stale in (old, again):
        for _name, stmt, params in _fenced_writes(stale.id, stale.lease):
            with engine.begin() as conn:
                assert conn.execute(stmt, params).all() == []
    assert _snapshot(engine, old.id) == before
    assert row(engine, old.id).status == "running"


# -- the statements as a list ---------------------------------------------------------------

VERBS = {"advance", "beat", "cancel", "check", "claim", "compare", "complete", "copy", "declare",
         "end", "expire", "exists", "find", "heartbeat", "insert", "lease", "list",
         "lock", "mark", "move", "prune", "reap", "record", "register", "release", "retry", "select",
         "send", "set", "stamp", "start", "suspend", "try", "unregister", "wake"}


def test_every_statement_is_a_verb_noun_with_a_one_line_description() -> None:
    """procrastinate's rule for queries.sql: each statement is named verb_noun and opens with
    one line saying what it does (the rest of its docstring says why and what it risks)."""
    from functools import cached_property

    statements = {name: attr for cls in type(Q).__mro__ for name, attr in vars(cls).items()
                  if isinstance(attr, cached_property)}
    assert len(statements) == 124
    for name, prop in statements.items():
        verb, _, noun = name.partition("_")
        assert verb in VERBS and noun, name
        doc = prop.__doc__ or ""
        first, _, rest = doc.partition("\n")
        assert first.endswith(".") and len(first) <= 92, name
        assert rest == "" or rest.startswith("\n"), f"{name}: one line, then a blank line"
        assert isinstance(getattr(Q, name), sa.TextClause), name
