"""The claimer's cursor against a real PostgreSQL: claims start past the rows already taken,
and a job that sorts before the cursor is still claimed (issue 21).

The claimer's clock is a list the test moves by hand: no sleeps."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from flowq.db import normalize_url
from flowq.db.rows import ClaimedJob
from flowq.worker.claimer import HEAD_SCAN_EVERY, Claimer
from flowq.worker.connection import DedicatedConnection


def insert(conn: sa.Connection, n: int, *, priority: int = 5, run_at: str = "now()") -> list[int]:
    return list(conn.execute(sa.text(
        f"INSERT INTO flowq.jobs (task, step, queue, priority, run_at) SELECT 't', 't', 'q', "
        f":p, {run_at} FROM generate_series(1, :n) RETURNING id"), {"p": priority, "n": n},
    ).scalars())


class Clocked:
    """A claimer of queue `q` whose clock the test moves, with what it claimed."""

    def __init__(self, db_url: str, name: str = "w") -> None:
        self.now = 1000.0
        self.got: list[ClaimedJob] = []
        self.conn = DedicatedConnection(normalize_url(db_url), "test cursor")
        self.claimer = Claimer(self.conn, "flowq", ["q"], name, self.got.append,
                               clock=lambda: self.now)

    def claim(self, n: int) -> list[int]:
        before = len(self.got)
        self.claimer.run_once(n)
        return [j.id for j in self.got[before:]]

    def claimed_at_the_next_head_scan(self, job_id: int) -> bool:
        """Missed by the cursor claim now, claimed HEAD_SCAN_EVERY later from the head."""
        missed = self.claim(5) == []  # from the cursor: the last head scan was just now
        self.now += HEAD_SCAN_EVERY
        return missed and self.claim(5) == [job_id]


@pytest.fixture
def clocked(db_url: str) -> Iterator[Clocked]:
    c = Clocked(db_url)
    yield c
    c.conn.close()


def test_a_more_urgent_job_enqueued_below_the_cursor_is_claimed_first(
        engine: sa.Engine, clocked: Clocked) -> None:
    """Priority order holds claim by claim: the cursor claim takes a more urgent job first,
    from its own range of the index."""
    with engine.begin() as conn:
        ids = insert(conn, 3)
    assert clocked.claim(2) == ids[:2]  # the first claim is from the head: the cursor is set
    with engine.begin() as conn:
        [urgent] = insert(conn, 1, priority=0)
    assert clocked.claim(1) == [urgent]  # from the cursor, the more urgent range first
    assert clocked.claim(5) == ids[2:]


def test_a_job_below_the_cursor_waits_at_most_for_the_next_head_scan(
        engine: sa.Engine, clocked: Clocked) -> None:
    """A job of the cursor's priority that sorts before it (a run_at in the past) is passed
    over, even for a less urgent priority after the cursor, until the next claim from the
    head or one after a cursor of a less urgent priority (docs/worker.md, "The claim's
    cursor")."""
    with engine.begin() as conn:
        [first] = insert(conn, 1)
    assert clocked.claim(1) == [first]
    with engine.begin() as conn:
        [behind] = insert(conn, 1, run_at="now() - interval '1 hour'")
        [lesser] = insert(conn, 1, priority=9)
    assert clocked.claim(1) == [lesser]  # the cursor claim
    assert clocked.claim(1) == [behind]  # more urgent than the cursor, now at priority 9


@pytest.mark.parametrize("priority", [-32768, 32767])
def test_the_cursor_at_the_priority_bounds(engine: sa.Engine, clocked: Clocked,
                                           priority: int) -> None:
    """A cursor at either end of smallint claims what follows it, more urgent first."""
    with engine.begin() as conn:
        ids = insert(conn, 3, priority=priority)
    assert clocked.claim(1) == ids[:1]
    with engine.begin() as conn:
        more = insert(conn, 1, priority=-32768)
    expected = ids[1:] if priority == -32768 else more
    assert clocked.claim(2)[: len(expected)] == expected


def test_a_job_due_in_the_past_is_claimed_at_the_next_refresh(engine: sa.Engine,
                                                              clocked: Clocked) -> None:
    with engine.begin() as conn:
        ids = insert(conn, 2)
    assert clocked.claim(2) == ids
    with engine.begin() as conn:
        [past] = insert(conn, 1, run_at="now() - interval '1 hour'")
        later = insert(conn, 1)
    assert clocked.claim(5) == later  # the cursor claim; the clock has not moved
    clocked.claimer.refresh()  # every poll interval: the next claim starts from the head
    assert clocked.claim(5) == [past]


def test_a_job_whose_enqueue_committed_after_later_ones_is_claimed(engine: sa.Engine,
                                                                   clocked: Clocked) -> None:
    """Its run_at (now(): its transaction's start) and id sort before jobs that committed
    first and were claimed first."""
    with engine.connect() as slow:
        slow.begin()
        [late] = insert(slow, 1)
        with engine.begin() as conn:
            early = insert(conn, 2)
        assert clocked.claim(5) == early
        slow.commit()
    assert clocked.claimed_at_the_next_head_scan(late)


def test_the_cursor_survives_a_queue_that_empties_and_refills(engine: sa.Engine,
                                                              clocked: Clocked) -> None:
    with engine.begin() as conn:
        first = insert(conn, 3)
    assert clocked.claim(10) == first
    assert clocked.claim(10) == []
    cursor = clocked.claimer.cursors["q"]
    with engine.begin() as conn:
        second = insert(conn, 4)
    # The clock has not moved, so no claim from the head runs: the cursor claim takes them.
    assert sorted(clocked.claim(10)) == second
    assert clocked.claimer.cursors["q"] > cursor


def test_a_full_claim_from_the_head_moves_the_cursor_back(engine: sa.Engine,
                                                          clocked: Clocked) -> None:
    """Urgent jobs piled up below the cursor are taken in order by the claims after the head
    scan, not one head scan's worth per poll interval."""
    with engine.begin() as conn:
        insert(conn, 1)
    clocked.claim(1)
    with engine.begin() as conn:
        urgent = insert(conn, 4, priority=0)
        insert(conn, 2)
    clocked.claimer.refresh()
    assert clocked.claim(2) == urgent[:2]  # from the head, full
    assert clocked.claim(2) == urgent[2:]  # from the cursor, moved back




def test_a_run_at_before_year_one_neither_loses_a_claim_nor_hides_behind_the_cursor(
        engine: sa.Engine, clocked: Clocked) -> None:
    """'-infinity' or a BC date does not load into a datetime: the claim (committed before
    its rows load) once lost every row it took. Its key is clamped, so the row sorts before
    the cursor and the next claim from the head takes it."""
    with engine.begin() as conn:
        ids = (insert(conn, 1, run_at="'-infinity'") + insert(conn, 1, run_at="'0044-03-15 BC'")
               + insert(conn, 2))
    assert clocked.claim(10) == ids
    with engine.begin() as conn:
        [hostile] = insert(conn, 1, run_at="'-infinity'")
    assert clocked.claimed_at_the_next_head_scan(hostile)


def test_two_workers_under_hostile_inserts_claim_every_due_job_once_and_soon(
        engine: sa.Engine, db_url: str) -> None:
    """A ledger: extreme priorities, run_at far in the past or future, jobs that become due
    behind the cursor, late commits (ids below it), the cursor's own row deleted, the queue
    paused and resumed; two workers claim in random sizes while the clock moves. Every job
    due is claimed exactly once, none that is not, and a backlog drains within a head scan
    of the last insert."""
    rng = random.Random(11)
    workers = [Clocked(db_url, "a"), Clocked(db_url, "b")]
    never: list[int] = []  # due in 500 years
    soon: list[int] = []  # not due yet, made due later (their run_at then sorts early)
    late = engine.connect()
    late_ids: list[int] = []
    try:
        for turn in range(60):
            with engine.begin() as conn:
                for _ in range(rng.randint(0, 3)):
                    insert(conn, 1, priority=rng.choice([-32768, -1, 0, 5, 32767]),
                           run_at=rng.choice(["now()", "now() - interval '300 years'",
                                              "now() - interval '1 hour'", "'-infinity'"]))
                never += insert(conn, rng.randint(0, 1), run_at="now() + interval '500 years'")
                soon += insert(conn, rng.randint(0, 1), priority=rng.choice([0, 5]),
                               run_at="now() + interval '1 hour'")
                if turn % 7 == 3 and soon:  # time passes for some
                    conn.execute(sa.text(
                        "UPDATE flowq.jobs SET run_at = now() - interval '1 minute' "
                        "WHERE id = ANY(:ids)"), {"ids": soon[:2]})
                    del soon[:2]
                if turn % 11 == 5:  # a worker's cursor row goes away
                    cursor = workers[turn % 2].claimer.cursors.get("q")
                    if cursor is not None:
                        conn.execute(sa.text("DELETE FROM flowq.jobs WHERE id = :id"),
                                     {"id": cursor[2]})
                paused = turn % 13 == 6
                conn.execute(sa.text(
                    "INSERT INTO flowq.queues (name, paused) VALUES ('q', :p) "
                    "ON CONFLICT (name) DO UPDATE SET paused = :p"), {"p": paused})
            if turn % 9 == 0:  # a transaction that commits after later ones
                if late.in_transaction():
                    late.commit()
                late.begin()
                late_ids += insert(late, 2)
            for w in workers:
                if turn % 5 == 0 or turn % 13 in (6, 7):  # every poll interval, and on resume
                    w.claimer.refresh()
                w.claim(rng.randint(1, 4))
                w.now += rng.uniform(0, 0.2)
        late.commit()
    finally:
        late.close()
    start = workers[0].now
    for _ in range(100):  # drain, the clock moving 0.1 s a round, past one head scan
        took = [w.claim(4) for w in workers]
        if not any(took) and workers[0].now - start > HEAD_SCAN_EVERY:
            break
        for w in workers:
            w.now += 0.1
    with engine.connect() as conn:
        due = set(conn.execute(sa.text(
            "SELECT id FROM flowq.steps WHERE run_at <= now()")).scalars())
    claimed = [j.id for w in workers for j in w.got]
    assert len(claimed) == len(set(claimed)), "a job claimed twice"
    assert due <= set(claimed), f"never claimed: {sorted(due - set(claimed))}"
    assert not set(claimed) & set(never + soon)
    assert set(late_ids) <= set(claimed)
    assert workers[0].now - start < HEAD_SCAN_EVERY + 1.0, "drained too slowly"
    for w in workers:
        w.conn.close()
