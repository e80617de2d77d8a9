"""Permits (flowq.permits): a queue limited by its concurrency alone is claimed under permits a
worker leases in batches, not under the queue row's lock per claim (flowq.db.sql.queues).

The `Claimer` of several named workers on one database (each registered in flowq.workers, as a
worker is), checked against the database after every step: the queue's running jobs never
exceed its limit. Then real `flowq worker` processes (tests/apps/queues_app.py, whose handlers
write their start and end to a ledger): exact across workers, a SIGKILLed worker's permits
reclaimed, a clean stop's permits given back.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import queues_app as qa
import sqlalchemy as sa
from support import max_overlap, scalar

import flowq
from flowq.db import normalize_url
from flowq.db.rows import ClaimedJob
from flowq.db.schema import CAPABILITIES
from flowq.testing import wait_until
from flowq.worker.claimer import Claimer
from flowq.worker.connection import DedicatedConnection

FAST = ("--poll-interval", "0.2", "--heartbeat-interval", "0.5", "--stale-after", "3",
        "--reap-interval", "0.5")


def running(engine: sa.Engine, queue: str = "lim") -> int:
    return int(scalar(engine, "SELECT count(*) FROM flowq.steps WHERE queue = :q "
                      "AND status = 'running'", q=queue))


def held(engine: sa.Engine, queue: str = "lim") -> dict[str, int]:
    with engine.connect() as c:
        return dict(c.execute(sa.text("SELECT worker, held FROM flowq.permits "
                                      "WHERE queue = :q"), {"q": queue}).all())


def finish(engine: sa.Engine, jobs: list[ClaimedJob]) -> None:
    """Complete `jobs` as a handler's own transaction would (a `ctx.session` completion)."""
    with engine.begin() as c:
        c.execute(sa.text("UPDATE flowq.jobs SET status = 'succeeded', finished_at = now() "
                          "WHERE id = ANY(:ids)"), {"ids": [j.id for j in jobs]})
    jobs.clear()


@pytest.fixture
def claimers(engine: sa.Engine, db_url: str) -> Iterator[dict[str, tuple[Claimer,
                                                                           list[ClaimedJob]]]]:
    """Workers w1, w2, w3 (registered), each a `Claimer` of queue `lim` (concurrency 4, 40 due
    jobs) and the jobs it claimed."""
    with engine.begin() as c:
        c.execute(sa.text("INSERT INTO flowq.queues (name, concurrency) VALUES ('lim', 4)"))
        c.execute(sa.text("INSERT INTO flowq.jobs (task, step, queue) "
                          "SELECT 't', 't', 'lim' FROM generate_series(1, 40)"))
        c.execute(sa.text("INSERT INTO flowq.workers (name, host, pid, queues, tasks, "
                          "concurrency, version, capabilities) SELECT w, 'h', 1, ARRAY['lim'], "
                          "ARRAY['t'], 8, 'test', :capabilities "
                          "FROM unnest(ARRAY['w1', 'w2', 'w3']) AS w"),
                  {"capabilities": list(CAPABILITIES)})
    out: dict[str, tuple[Claimer, list[ClaimedJob]]] = {}
    conns = []
    for name in ("w1", "w2", "w3"):
        conn = DedicatedConnection(normalize_url(db_url), f"test claim {name}")
        conns.append(conn)
        got: list[ClaimedJob] = []
        claimer = Claimer(conn, "flowq", ["lim"], name, got.append)
        claimer.refresh()
        out[name] = (claimer, got)
    yield out
    for conn in conns:
        conn.close()


def test_a_concurrency_only_queue_is_claimed_under_permits(engine: sa.Engine,
                                                           claimers: Any) -> None:
    """One lease, then claims under the permits without another: what finishes is claimed
    again without leasing, even while another transaction holds the queue's row lock."""
    w1, got = claimers["w1"]
    assert w1.controls == {"lim": "permits"}
    assert w1.run_once(8) == 4
    assert (w1.leases, held(engine), running(engine)) == (1, {"w1": 4}, 4)
    assert w1.run_once(8) == 0 and w1.held_back  # at the limit, due jobs wait
    finish(engine, got)  # all four end (their own transactions)
    with engine.connect() as blocker:
        blocker.execute(sa.text("SELECT 1 FROM flowq.queues WHERE name = 'lim' FOR UPDATE"))
        result: list[int] = []
        t = threading.Thread(target=lambda: result.append(w1.run_once(8)))
        t.start()
        t.join(30)
        assert not t.is_alive(), "a claim under permits waited on the queue's row lock"
        blocker.rollback()
    assert result == [4] and w1.leases == 1
    assert running(engine) == 4


def test_a_second_worker_gets_its_share_as_the_first_sheds(engine: sa.Engine,
                                                           claimers: Any) -> None:
    (w1, got1), (w2, got2) = claimers["w1"], claimers["w2"]
    assert w1.run_once(8) == 4  # alone: its share is the whole limit
    assert w2.run_once(8) == 0 and w2.held_back  # asks: its row counts in the share
    assert held(engine) == {"w1": 4, "w2": 0}
    finish(engine, got1)
    assert w1.run_once(8) == 2  # its share is 2 now; it gives back the other 2
    assert held(engine)["w1"] == 2
    assert w2.run_once(8) == 2
    assert held(engine) == {"w1": 2, "w2": 2} and running(engine) == 4
    for _ in range(3):  # turns: never above the limit, whoever finishes first
        finish(engine, got2)
        assert w2.run_once(8) == 2 and w1.run_once(8) == 0
        assert running(engine) == 4


def test_a_request_for_permits_goes_when_the_queue_has_no_due_job(engine: sa.Engine,
                                                                    claimers: Any) -> None:
    """A worker that asked and got none leaves a request row (it halves the others' share);
    once nothing is due it takes the request back, and the share is whole again."""
    (w1, got1), (w2, _) = claimers["w1"], claimers["w2"]
    assert w1.run_once(8) == 4 and w2.run_once(8) == 0
    assert held(engine) == {"w1": 4, "w2": 0}
    with engine.begin() as c:
        c.execute(sa.text("DELETE FROM flowq.jobs WHERE status = 'pending'"))
    assert w2.run_once(8) == 0 and not w2.held_back
    assert held(engine) == {"w1": 4}
    finish(engine, got1)
    assert w1.run_once(8) == 0 and held(engine) == {}


def test_a_dead_workers_permits_are_reclaimed_its_running_jobs_still_count(
        engine: sa.Engine, claimers: Any) -> None:
    """A worker out of the registry (expired: SIGKILLed, or a zombie) loses its permits at the
    next lease; until the reaper requeues its jobs they count, and a claim by the zombie,
    come back, takes nothing."""
    (w1, got1), (w2, _) = claimers["w1"], claimers["w2"]
    assert w1.run_once(8) == 4
    finish(engine, got1[:1])  # w1 runs 3 of its 4 permits
    with engine.begin() as c:
        c.execute(sa.text("DELETE FROM flowq.workers WHERE name = 'w1'"))
    assert w2.run_once(8) == 1  # w1's permits are gone, its 3 running jobs count
    assert held(engine) == {"w2": 1} and running(engine) == 4
    assert w1.run_once(8) == 0  # the zombie: no permits, nothing claimed
    assert running(engine) == 4
    with engine.begin() as c:  # the reaper requeues w1's jobs
        c.execute(sa.text("UPDATE flowq.jobs SET status = 'pending', locked_by = NULL "
                          "WHERE status = 'running' AND locked_by = 'w1'"))
    assert w2.run_once(8) == 3 and running(engine) == 4


def test_a_changed_limit_voids_the_permits(engine: sa.Engine, claimers: Any) -> None:
    w1, got = claimers["w1"]
    assert w1.run_once(8) == 4
    with engine.begin() as c:
        c.execute(sa.text("UPDATE flowq.queues SET concurrency = 2 WHERE name = 'lim'"))
    finish(engine, got)
    assert w1.run_once(8) == 2 and running(engine) == 2
    assert held(engine) == {"w1": 2}


OLDER = ("INSERT INTO flowq.workers (name, host, pid, queues, tasks, concurrency, version) "
         "VALUES ('old', 'h', 2, ARRAY['other'], ARRAY['t'], 8, '0.7')")


@pytest.mark.parametrize("change", [
    "UPDATE flowq.queues SET rate_limit = 1000, rate_period = 1 WHERE name = 'lim'",
    "UPDATE flowq.queues SET keyed = true WHERE name = 'lim'",
    OLDER], ids=["rate-limit", "keyed", "older-release-registered"])
def test_permits_voided_at_a_claim_are_given_back(engine: sa.Engine, claimers: Any,
                                                  change: str) -> None:
    """A queue given a rate limit, marked keyed (by any keyed enqueue), or with a worker of
    an earlier release registered goes back to the locked claim, which counts permit rows
    as running. Learnt from a claim under permits rather than from `refresh`, the permits
    were dropped from the claimer but their row stayed, so the queue ran nothing, for every
    worker, for as long as that worker lived."""
    (w1, got1), (w2, _) = claimers["w1"], claimers["w2"]
    assert w1.run_once(8) == 4 and held(engine) == {"w1": 4}
    finish(engine, got1)
    with engine.begin() as c:
        c.execute(sa.text(change))
    assert w1.run_once(8) == 0  # the claim says the permits are void; controls re-read
    assert w1.controls == {"lim": "limited"} and held(engine) == {}
    assert w1.run_once(8) + w2.run_once(8) == 4 and running(engine) == 4


def test_jobs_claimed_plainly_while_the_limit_was_off_count_when_it_is_back(
        engine: sa.Engine, claimers: Any) -> None:
    """A limit removed and declared again (a rollback, then a deploy): the jobs claimed
    plainly in between run, and count under the new permits (the claimer's list of what it
    runs was kept from before, without them: 7 ran under a limit of 4)."""
    w1, got1 = claimers["w1"]
    assert w1.run_once(8) == 4
    finish(engine, got1)
    with engine.begin() as c:
        c.execute(sa.text("UPDATE flowq.queues SET concurrency = NULL WHERE name = 'lim'"))
    w1.refresh()
    assert w1.run_once(3) == 3  # a plain claim
    with engine.begin() as c:
        c.execute(sa.text("UPDATE flowq.queues SET concurrency = 4 WHERE name = 'lim'"))
    w1.refresh()
    assert w1.controls == {"lim": "permits"}
    w1.run_once(8)
    assert running(engine) == 4


def test_a_claim_whose_result_was_lost_counts_at_the_next(engine: sa.Engine, claimers: Any,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """A claim that committed and whose result never arrived (the connection dropped after
    COMMIT): its rows run as far as the database knows, so the next claim counts them; the
    claimer's list of what it runs had missed them (6 running of 4, until reaped)."""
    w1, got1 = claimers["w1"]
    assert w1.run_once(8) == 4
    finish(engine, got1[:2])
    claim = w1.store.claim_permitted

    def lost(*args: Any, **kwargs: Any) -> Any:
        claim(*args, **kwargs)
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(w1.store, "claim_permitted", lost)
    with pytest.raises(psycopg.OperationalError):
        w1.run_once(8)
    monkeypatch.undo()
    assert running(engine) == 4
    w1.run_once(8)
    assert running(engine) == 4


def test_the_locked_claim_counts_permits_held(engine: sa.Engine, claimers: Any) -> None:
    """A queue given a rate limit too goes back to the locked claim, which counts the permits
    workers still hold as running: the limit holds while the paths change."""
    (w1, _), (w2, _) = claimers["w1"], claimers["w2"]
    assert w1.run_once(2) == 2  # w1 leases for what it wants: 2
    with engine.begin() as c:
        c.execute(sa.text("UPDATE flowq.permits SET held = 3 WHERE worker = 'w1'"))
        c.execute(sa.text("UPDATE flowq.queues SET rate_limit = 1000, rate_period = 1 "
                          "WHERE name = 'lim'"))
    w2.refresh()
    assert w2.controls == {"lim": "limited"}
    assert w2.run_once(8) == 1  # 4 - max(3 held, 2 running)
    assert w1.run_once(8) == 0  # w1's permits are void on the locked path
    assert running(engine) == 3


def test_an_older_worker_registered_sends_every_claim_the_locked_way(
        engine: sa.Engine, claimers: Any) -> None:
    """A worker of a release before permits counts running jobs only: while one is registered
    (no `capabilities`), nobody claims under permits, and permits held are given back at the
    next look at the queues, counted as running until then."""
    (w1, _), (w2, _) = claimers["w1"], claimers["w2"]
    assert w1.run_once(3) == 3 and held(engine) == {"w1": 3}
    with engine.begin() as c:
        c.execute(sa.text("INSERT INTO flowq.workers (name, host, pid, queues, tasks, "
                          "concurrency, version) VALUES ('old', 'h', 2, ARRAY['lim'], "
                          "ARRAY['t'], 8, '0.7')"))
    w2.refresh()
    assert w2.controls == {"lim": "limited"}
    assert w2.run_once(8) == 1  # 4 - 3 running
    assert w1.run_once(8) == 0  # its permits are void on the locked path
    w1.refresh()
    assert w1.controls == {"lim": "limited"} and held(engine) == {"w1": 3}  # = running
    assert running(engine) == 4
    with engine.begin() as c:  # the older worker stops: permits again
        c.execute(sa.text("DELETE FROM flowq.workers WHERE name = 'old'"))
    w1.refresh()
    assert w1.controls == {"lim": "permits"}


def test_permits_are_given_back_when_idle_and_at_shutdown(engine: sa.Engine,
                                                          claimers: Any) -> None:
    (w1, got1), (w3, _) = claimers["w1"], claimers["w3"]
    with engine.begin() as c:
        c.execute(sa.text("DELETE FROM flowq.jobs WHERE id > (SELECT min(id) + 2 "
                          "FROM flowq.steps)"))
    assert w1.run_once(8) == 3  # the queue is empty after: w1 keeps what runs only
    assert held(engine) == {"w1": 3}
    finish(engine, got1[:1])
    w1.refresh()  # no claim since the last one ran
    w1.refresh()  # a poll without a claim of the queue: w1 keeps what runs
    assert held(engine) == {"w1": 2}
    assert w3.run_once(8) == 0 and not w3.held_back  # nothing due
    w1.release_permits()  # at shutdown, after the release: its jobs are pending again
    assert held(engine) == {"w1": 2}  # they still run here: they keep theirs
    finish(engine, got1)
    w1.release_permits()
    assert held(engine) == {}


# -- real workers ---------------------------------------------------------------------------


def _ledger_peak(engine: sa.Engine) -> int:
    with engine.connect() as c:
        rows = list(c.execute(sa.text("SELECT started, ended FROM queue_ledger "
                                      "WHERE task = 'capped'")))
    return max_overlap(rows)


def held_by_pid(engine: sa.Engine, pid: int) -> int:
    """The permits rows of the worker process `pid` (names are host:pid:suffix)."""
    return int(scalar(engine, "SELECT count(*) FROM flowq.permits "
                      "WHERE split_part(worker, ':', 2) = :p", p=str(pid)))


def _done(engine: sa.Engine) -> int:
    return int(scalar(engine, "SELECT count(*) FROM queue_ledger WHERE task = 'capped'"))


@pytest.mark.slow
def test_exact_across_workers_and_a_killed_workers_permits_come_back(
        ledger: sa.Engine, db_url: str, spawn_worker: Any) -> None:
    """Three workers on `capped` (concurrency 3); one is SIGKILLed while it runs jobs under
    its permits. Its permits come back at the first lease after it is out of the registry,
    the others drain the queue, and the ledger never saw more than 3 handlers at once
    (handlers write their start and end; a killed one's job ran again elsewhere)."""
    with ledger.begin() as conn:
        flowq.enqueue_many(conn, qa.capped, [{"sleep": 0.02}] * 300)
    workers = [spawn_worker("queues_app:app", db_url, "-c", "4", "--queues", "capped", *FAST)
               for _ in range(3)]
    wait_until(lambda: _done(ledger) >= 50, timeout=120, message="50 capped jobs done")
    holders = [w for w in workers if held_by_pid(ledger, w.pid)]
    victim = holders[0] if holders else workers[0]
    victim.signal(signal.SIGKILL)
    victim.wait(10)
    wait_until(lambda: not scalar(ledger, "SELECT count(*) FROM flowq.workers WHERE "
                                  "split_part(name, ':', 2) = :p", p=str(victim.pid)),
               timeout=60, message="the killed worker's registry entry expired")
    with ledger.begin() as conn:  # the next lease (work to do) takes its permits back
        flowq.enqueue_many(conn, qa.capped, [{"sleep": 0.02}] * 30)
    wait_until(lambda: not held_by_pid(ledger, victim.pid), timeout=60,
               message="the killed worker's permits reclaimed")
    wait_until(lambda: _done(ledger) == 330, timeout=180, message="330 capped jobs done")
    assert _ledger_peak(ledger) <= 3
    assert _ledger_peak(ledger) >= 2  # they ran in parallel, up to the limit
    rest = [w for w in workers if w is not victim]
    for w in rest:
        w.signal(signal.SIGTERM)
    for w in rest:
        assert w.wait(60) == 0
    assert held(ledger, "capped") == {}  # the clean stops gave theirs back


@pytest.mark.slow
def test_a_clean_stop_gives_its_permits_back(ledger: sa.Engine, db_url: str,
                                             spawn_worker: Any) -> None:
    """SIGTERM while handlers run under permits: they finish within the grace period, and the
    worker gives back every permit before it exits."""
    with ledger.begin() as conn:
        flowq.enqueue_many(conn, qa.capped, [{"sleep": 1.0}] * 6)
    worker = spawn_worker("queues_app:app", db_url, "-c", "4", "--queues", "capped", *FAST)
    wait_until(lambda: held(ledger, "capped") and running(ledger, "capped") == 3,
               timeout=60, message="3 capped jobs running under permits")
    worker.signal(signal.SIGTERM)
    assert worker.wait(60) == 0
    assert held(ledger, "capped") == {}
    assert "gave back queue permits at shutdown" in worker.log()


@pytest.mark.slow
def test_a_stopped_worker_comes_back_to_no_permits(ledger: sa.Engine, db_url: str,
                                                   spawn_worker: Any) -> None:
    """A worker SIGSTOPped while it runs jobs under permits: the reaper requeues its jobs, its
    entry expires, a lease gives its permits to the other; SIGCONT, it finds none and claims
    nothing until it leases again, and its late completions are refused by the fence. The
    ledger (written through ctx.session, committed with the success) never sees more than
    the limit at once."""
    with ledger.begin() as conn:
        flowq.enqueue_many(conn, qa.capped, [{"sleep": 0.5}] * 3 + [{"sleep": 0.02}] * 100)
    zombie = spawn_worker("queues_app:app", db_url, "-c", "4", "--queues", "capped", *FAST)
    wait_until(lambda: held_by_pid(ledger, zombie.pid) and running(ledger, "capped") == 3,
               timeout=60, message="the first worker running 3 jobs under its permits")
    zombie.signal(signal.SIGSTOP)
    try:
        other = spawn_worker("queues_app:app", db_url, "-c", "4", "--queues", "capped", *FAST)
        wait_until(lambda: not held_by_pid(ledger, zombie.pid), timeout=60,
                   message="the stopped worker's permits reclaimed")
        assert _ledger_peak(ledger) <= 3
    finally:
        zombie.signal(signal.SIGCONT)
    wait_until(lambda: _done(ledger) == 103, timeout=120, message="103 capped jobs done")
    assert _ledger_peak(ledger) <= 3
    for w in (zombie, other):
        w.signal(signal.SIGTERM)
    for w in (zombie, other):
        assert w.wait(60) == 0
    assert held(ledger, "capped") == {}
