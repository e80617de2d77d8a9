"""The claimer against a real PostgreSQL: every claimed row is handed on, whatever fails next."""

from __future__ import annotations

import psycopg
import pytest
import sqlalchemy as sa

from flowq.db import normalize_url
from flowq.db.rows import ClaimedJob
from flowq.testing import job_rows
from flowq.worker.claimer import Claimer
from flowq.worker.connection import DedicatedConnection


def test_rows_claimed_before_a_failing_queue_are_handed_on(engine: sa.Engine,
                                                           db_url: str) -> None:
    """The claim of queue `b` fails after queue `a`'s rows were claimed: those rows were
    already submitted, so none sits `running` until the reaper burns an attempt (issue 9, #6)."""
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO flowq.jobs (task, step, queue) SELECT 't', 't', q "
                             "FROM unnest(ARRAY['a', 'a', 'a', 'b', 'b']) AS q"))
    conn = DedicatedConnection(normalize_url(db_url), "test claim")
    got: list[ClaimedJob] = []

    def submit(job: ClaimedJob) -> None:
        got.append(job)
        if len(got) == 1:  # the connection dies between the two queues' statements
            with engine.connect() as admin:
                admin.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                      "WHERE application_name = 'test claim'"))

    claimer = Claimer(conn, "flowq", ["a", "b"], "w", submit)
    with pytest.raises(psycopg.OperationalError):
        claimer.run_once(10)
    assert sorted(j.queue for j in got) == ["a", "a", "a"]
    running = {r.id for r in job_rows(engine, where="status = 'running'")}
    assert running == {j.id for j in got}
    # The connection is reopened on the next round, which takes queue b.
    assert claimer.run_once(10) == 2
    conn.close()


def test_claims_rotate_over_queues_and_stop_at_the_free_slots(engine: sa.Engine,
                                                              db_url: str) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO flowq.jobs (task, step, queue) SELECT 't', 't', q "
                             "FROM unnest(ARRAY['a', 'a', 'b', 'b']) AS q"))
    conn = DedicatedConnection(normalize_url(db_url), "test claim")
    got: list[ClaimedJob] = []
    claimer = Claimer(conn, "flowq", ["a", "b"], "w", got.append)
    assert claimer.run_once(1) == 1 and got[-1].queue == "a"
    assert claimer.run_once(1) == 1 and got[-1].queue == "b"
    assert claimer.run_once(5) == 2
    assert len({j.lease for j in got}) == 4
    conn.close()


def test_a_limited_queue_is_never_claimed_ahead(engine: sa.Engine, db_url: str) -> None:
    """From a limited queue the claimer takes only what free handlers start at once: a job
    claimed ahead would start later than the claim that counted it against the rate, and a
    window could see more starts than it allows (issue 20, seen as 21 starts in a window of
    20). Unlimited queues still fill the claim-ahead."""
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO flowq.jobs (task, step, queue) SELECT 't', 't', q "
                             "FROM unnest(array_fill('lim'::text, ARRAY[6]) || "
                             "array_fill('free'::text, ARRAY[6])) AS q"))
        conn.execute(sa.text("INSERT INTO flowq.queues (name, rate_limit, rate_period) "
                             "VALUES ('lim', 100, 1)"))
    conn = DedicatedConnection(normalize_url(db_url), "test claim")
    got: list[ClaimedJob] = []
    claimer = Claimer(conn, "flowq", ["lim", "free"], "w", got.append)
    claimer.refresh()
    assert claimer.run_once(8, free_handlers=2) == 8
    assert sorted(j.queue for j in got) == ["free"] * 6 + ["lim"] * 2
    got.clear()
    assert claimer.run_once(8, free_handlers=0) == 0  # the next pass starts at "free": empty
    conn.close()
