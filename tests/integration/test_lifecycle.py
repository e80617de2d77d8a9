"""The job lifecycle as a Hypothesis state machine, against a real PostgreSQL.

Every action is one of flowq's own named statements (`flowq.queries`), `Reaper.run_once`, or
`flowq.ops.runs.cancel_run`/`retry_run`; the only SQL written here reads rows for checking, or
plays the clock: a worker that stalls (its heartbeat pushed an hour back) and time passing (a
retry's `run_at` pulled into the past).

The model: a few runs (plain tasks, 2- and 3-step pipelines) enqueued with `flowq.enqueue_many`,
and workers w1..w3, each holding the claims (job id, lease, attempts) it believes it has. A
worker forgets a claim only when it writes its outcome (complete, retry, end, release); a
reaped worker keeps believing, and every claim ever held stays in `ever` for stale writes. A
claim's identity in the model is its serial number, never its lease, so the model knows which
claim each running row runs under without trusting the token it checks. The model also
predicts every row (status, attempts, lease, holder, cancel flag, due, stale), and the
database must agree after every step.

Invariants, after every step:
1. A running row's (id, lease) matches exactly one claim in all workers' holdings: the claim
   the model says it runs under, held by the worker in `locked_by` (at most one is the
   property; exactly one holds because a worker only lets go of a claim by writing).
2. A fenced write lands exactly on the claims the model says are current, and a SELECT just
   before it must agree (their rows run under their lease; no other claim matches a running
   row): returned rows are empty otherwise. Checked inside each rule; a write with an old
   claim also leaves its run's rows unchanged, column for column.
3. A job completes once: a completion lands at most once per id, a succeeded row never changes
   again, each success of a non-last step inserts exactly one successor (none if its run was
   cancelled), and a run's rows are steps 0..n-1, all but the latest succeeded.
4. Leases strictly increase per job across claims and never repeat across jobs.
5. Row shapes: pending has no claim columns nor finished_at; running has a lease, locked_by,
   locked_at, heartbeat_at; final rows have finished_at and no claim columns.

At teardown the system is driven to completion (every worker presumed dead: stall, reap, let
time pass, claim and complete everything) in a bounded number of rounds. Provable, so
asserted: every row ends final (not merely "final or pending in the future": time is let
pass), and a run whose latest step succeeded without a cancel reached its pipeline's last step.

Queue and key limits, a rate, unique runs, joins and signals are the second model's, in
test_lifecycle_limits.py (its own app and the worker's claim-to-outcome path); it shares
this one's settings, STALE_AFTER and the row shapes (`check_row_shape`).

The machine found a bug, fixed since and pinned by the last test: one batch holding two
claims of one pipeline step (an attempt lost to the reaper and the same worker's re-claim)
inserted its successor twice, because successors were joined on the job id alone; they are
joined on the claim (id, lease) now.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Final

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import flowq
from flowq import FlowQ, Pipeline, Retry, RunStateError
from flowq.db.schema import TERMINAL_STATUSES, jobs, notify_channel
from flowq.db.sql import Queries
from flowq.db.sql.fragments import bind_rows
from flowq.ops.runs import cancel_run, retry_run
from flowq.worker.reaper import Reaper

Q = Queries("flowq")
CHANNEL = notify_channel("flowq")
WORKERS: Final = ("w1", "w2", "w3")
DRAINER: Final = "drainer"  # the worker teardown uses to finish everything
QUEUES: Final = ("lc_a", "lc_b")
# A stalled heartbeat is set an hour back; a live one is at most a few seconds old.
STALE_AFTER: Final = 600.0
DRAIN_ROUNDS: Final = 8  # a 3-step pipeline needs 4 (reap, then one round per step)
COLUMNS: Final = tuple(c.name for c in jobs.c)

SETTINGS = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI cannot flake
    database=None,
    report_multiple_bugs=False,  # one minimal failure, soon, rather than every distinct one
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# -- the app: its definitions give each step's name, queue and attempt cap --------------------

APP = FlowQ()


@APP.task(name="lc_plain", queue="lc_a", retry=Retry(max_attempts=1))
def lc_plain(ctx: Any, n: int) -> dict[str, int]:
    return {"n": n}


PIPE2 = APP.pipeline("lc_pipe2", queue="lc_b")


@PIPE2.step(name="fetch", retry=Retry(max_attempts=2))
def p2_fetch(ctx: Any, n: int) -> dict[str, int]:
    return {"n": n}


@PIPE2.step(name="store", retry=Retry(max_attempts=1))
def p2_store(ctx: Any, n: int) -> dict[str, int]:
    return {"n": n}


PIPE3 = APP.pipeline("lc_pipe3", queue="lc_b")


@PIPE3.step(name="extract", retry=Retry(max_attempts=3))
def p3_extract(ctx: Any, n: int) -> dict[str, int]:
    return {"n": n}


@PIPE3.step(name="transform", queue="lc_a", retry=Retry(max_attempts=2))
def p3_transform(ctx: Any, n: int) -> dict[str, int]:
    return {"n": n}


@PIPE3.step(name="load", retry=Retry(max_attempts=2))
def p3_load(ctx: Any, n: int) -> dict[str, int]:
    return {"n": n}


def pipeline(name: str) -> Pipeline:
    found = APP.get(name)
    assert found is not None
    return found


# -- the model --------------------------------------------------------------------------------


@dataclass
class Job:
    """What the model expects one `flowq.jobs` row to hold."""

    id: int
    run_id: int
    task: str
    step_index: int
    queue: str
    max_attempts: int
    status: str = "pending"
    attempts: int = 0
    lease: int | None = None
    locked_by: str | None = None
    cancel_requested: bool = False
    due: bool = True  # pending: run_at <= now()
    stale: bool = False  # running: heartbeat older than STALE_AFTER
    leases: list[int] = field(default_factory=list)  # every lease drawn for it, in order
    claim: int | None = None  # serial of the claim it was last claimed with


@dataclass(frozen=True, order=True)
class Claim:
    """A claim as `claim_jobs` returned it to `worker`: what the worker believes it holds.

    `serial` (the claim's rank in the example) is its identity in the model, so the model
    never needs the lease to tell claims apart: a token that came round again would show."""

    worker: str
    serial: int
    id: int
    lease: int
    attempts: int
    max_attempts: int
    task: str
    step_index: int


def bind(rows: list[dict[str, Any]], *, single: bool, prefix: str = "") -> dict[str, Any]:
    """Bind parameters in the shape `flowq.queries` expects: scalars for one row, arrays for a
    batch (`id` -> `ids`)."""
    columns = tuple((name, "") for name in rows[0])  # the types are the statement's
    return bind_rows(columns, [SimpleNamespace(**r) for r in rows], single=single,
                     prefix=prefix)


def successor(claim: Claim, result: str) -> dict[str, Any] | None:
    """The next step a success of `claim` creates (the completer's shape), or None."""
    steps = pipeline(claim.task).steps
    if claim.step_index + 1 >= len(steps):
        return None
    nxt = steps[claim.step_index + 1]
    return {"id": claim.id, "lease": claim.lease, "task": claim.task, "step": nxt.name,
            "step_index": nxt.index,
            "queue": nxt.queue, "max_attempts": nxt.retry.attempt_cap, "args": result,
            "map_index": None, "delay": 0.0}


def derived_status(steps: list[Job]) -> str:
    """A run's status as `flowq.runs` documents it; `steps` in step order."""
    if any(s.cancel_requested or s.status == "cancelled" for s in steps):
        return "cancelled"
    return steps[-1].status


def check_row_shape(r: Any) -> None:
    """Invariant 5 on one `flowq.jobs` row (test_lifecycle_limits checks it too): a running
    row has its claim columns and no finished_at; any other has no claim columns, and
    finished_at iff it is final."""
    claim = (r.locked_by, r.locked_at, r.heartbeat_at)
    if r.status == "running":
        assert r.lease is not None and None not in claim and r.attempts >= 1, r
        assert r.finished_at is None, r
    else:
        assert claim == (None, None, None), r
        assert (r.finished_at is not None) == (r.status in TERMINAL_STATUSES), r


FENCED: Final = ("heartbeat_jobs", "complete_jobs", "complete_job", "complete_steps",
                 "complete_step", "retry_job", "end_job", "release_jobs")


def fenced_write(name: str, claim: Claim) -> tuple[sa.TextClause, dict[str, Any]]:
    """Statement `name` as the holder of `claim` would send it."""
    key = [{"id": claim.id, "lease": claim.lease}]
    done = [{**key[0], "result": '{"late": true}'}]
    nxt = [{"id": claim.id, "lease": claim.lease, "task": claim.task, "step": "late",
            "step_index": 99,
            "queue": QUEUES[0], "max_attempts": 1, "args": "{}", "map_index": None,
            "delay": 0.0}]
    notify = {"channel": CHANNEL}
    params: dict[str, dict[str, Any]] = {
        "heartbeat_jobs": {**bind([{**key[0], "progress": None}], single=False),
                           "worker": "late"},
        "release_jobs": {**bind(key, single=False), **notify},
        "complete_jobs": {**bind(done, single=False), **notify},
        "complete_job": {**bind(done, single=True), **notify},
        "complete_steps": {**bind(done, single=False),
                           **bind(nxt, single=False, prefix="next_"), **notify},
        "complete_step": {**bind(done, single=True),
                          **bind(nxt, single=False, prefix="next_"), **notify},
        "retry_job": {**key[0], "delay": 0.0, "error": "late retry"},
        "end_job": {**key[0], "status": "dead", "error": "late end", **notify},
    }
    statement: sa.TextClause = getattr(Q, name)
    return statement, params[name]


class LifecycleMachine(RuleBasedStateMachine):
    """Workers claiming, beating, completing, failing, releasing and stalling; the reaper;
    operators cancelling and retrying runs. `engine` is set by the test."""

    engine: sa.Engine

    def __init__(self) -> None:
        super().__init__()
        self.jobs: dict[int, Job] = {}
        self.held: dict[str, list[Claim]] = {w: [] for w in WORKERS}
        self.ever: list[Claim] = []
        self.all_leases: set[int] = set()
        self.completed: set[int] = set()
        self.frozen: dict[int, tuple[Any, ...]] = {}  # each succeeded row, as first seen
        # False from the start of an action until the invariants pass: teardown only drives a
        # system whose last step checked out (else it would mask the first failure).
        self.settled = False

    # -- reading --------------------------------------------------------------------------

    def rows(self) -> dict[int, Any]:
        with self.engine.connect() as conn:
            return {r.id: r for r in conn.execute(sa.text("""
                SELECT *, run_at <= now() AS is_due,
                       heartbeat_at < now() - make_interval(secs => :stale) AS is_stale
                  FROM flowq.steps ORDER BY id"""), {"stale": STALE_AFTER})}

    def run_rows(self, run_id: int) -> list[tuple[Any, ...]]:
        with self.engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(
                "SELECT * FROM flowq.steps WHERE run_id = :r ORDER BY id"), {"r": run_id})]

    def steps_of(self, run_id: int) -> list[Job]:
        return sorted((j for j in self.jobs.values() if j.run_id == run_id),
                      key=lambda j: (j.step_index, j.id))

    def runs(self, *statuses: str) -> list[int]:
        """Run ids (all, or those whose derived status is one of `statuses`)."""
        run_ids = sorted({j.run_id for j in self.jobs.values()})
        return [r for r in run_ids if not statuses or derived_status(self.steps_of(r)) in statuses]

    def current(self, claim: Claim) -> bool:
        job = self.jobs[claim.id]
        return job.status == "running" and job.claim == claim.serial

    def landing(self, claims: list[Claim]) -> set[Claim]:
        """The claims a fenced write must apply to (invariant 2): those the model says are
        current. A SELECT just before the write must agree: their rows run under their lease,
        and no other claim's (id, lease) matches a running row."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.text(
                "SELECT id, lease FROM flowq.steps WHERE id = ANY(:ids) AND status = 'running'"),
                {"ids": [c.id for c in claims]}).all()
        running = {(r.id, r.lease) for r in rows}
        for c in claims:
            matches, current = (c.id, c.lease) in running, self.current(c)
            assert matches == current, (
                f"{c} matches its row's (id, lease) but is not the claim the row runs under"
                if matches else f"{c} is current, yet its row does not run under its lease")
        return {c for c in claims if self.current(c)}

    def forget(self, worker: str, claims: list[Claim]) -> None:
        self.held[worker] = [c for c in self.held[worker] if c not in claims]

    def holders(self) -> list[str]:
        return sorted(w for w, claims in self.held.items() if claims)

    def running(self) -> list[int]:
        # In (run, step) order rather than by id: a batch's successors get their ids in join
        # order, and draws must not depend on a plan.
        running = [j for j in self.jobs.values() if j.status == "running"]
        return [j.id for j in sorted(running, key=lambda j: (j.run_id, j.step_index))]

    # -- actions (each rule draws its arguments, then calls one of these) ---------------------

    def enqueue(self, counts: dict[str, int]) -> None:
        self.settled = False
        with self.engine.begin() as conn:
            conn.execute(sa.text("TRUNCATE flowq.jobs, flowq.job_history"))  # one database for all examples
            for name, n in counts.items():
                if n:
                    flowq.enqueue_many(conn, pipeline(name), [{"n": i} for i in range(n)])
        for r in self.rows().values():
            self.jobs[r.id] = Job(id=r.id, run_id=r.run_id, task=r.task, step_index=0,
                                  queue=r.queue, max_attempts=r.max_attempts)

    def claim(self, worker: str, queue: str, limit: int) -> None:
        self.settled = False
        with self.engine.connect() as conn:
            due = [r.id for r in conn.execute(sa.text("""
                SELECT id FROM flowq.steps
                 WHERE status = 'pending' AND queue = :q AND run_at <= now()
                 ORDER BY priority, run_at, id"""), {"q": queue})]
        model = [j.id for j in self.jobs.values()
                 if j.status == "pending" and j.queue == queue and j.due]
        assert sorted(due) == sorted(model), f"due in {queue}: {due}, model {model}"
        with self.engine.begin() as conn:
            got = sorted(conn.execute(Q.claim_jobs, {"queue": queue, "limit": limit,
                                                     "worker": worker}).all(),
                         key=lambda r: (r.run_id, r.step_index))  # RETURNING has no order
        assert sorted(r.id for r in got) == sorted(due[:limit])
        for r in got:
            job = self.jobs[r.id]
            # (4) a fresh lease: above every earlier one of this job, never seen on any job
            assert r.lease not in self.all_leases, f"lease {r.lease} repeated"
            assert not job.leases or r.lease > job.leases[-1], (job.leases, r.lease)
            assert (r.attempts, r.cancel_requested, r.run_id, r.step_index) == (
                job.attempts + 1, job.cancel_requested, job.run_id, job.step_index)
            job.status, job.attempts, job.lease, job.locked_by = (
                "running", r.attempts, r.lease, worker)
            job.stale = False
            job.leases.append(r.lease)
            self.all_leases.add(r.lease)
            c = Claim(worker, len(self.ever), r.id, r.lease, r.attempts, r.max_attempts,
                      r.task, r.step_index)
            job.claim = c.serial
            self.held.setdefault(worker, []).append(c)
            self.ever.append(c)

    def heartbeat(self, worker: str) -> None:
        self.settled = False
        claims = self.held[worker]
        landing = self.landing(claims)
        with self.engine.begin() as conn:
            # The model's workers have no registry entry: each beat refreshes every job's
            # own heartbeat (the fallback of a worker whose entry expired).
            got = conn.execute(Q.heartbeat_jobs, {**bind(
                [{"id": c.id, "lease": c.lease, "progress": None} for c in claims],
                single=False), "worker": worker}).all()
        assert sorted(r.id for r in got) == sorted(c.id for c in landing)  # (2)
        for c in landing:
            self.jobs[c.id].stale = False

    def complete(self, worker: str, claims: list[Claim], *, single: bool) -> None:
        """Complete `claims` in one statement, as the completer batches successes: with the
        successors of those that have a next step (complete_steps) or without."""
        self.settled = False
        single = single and len(claims) == 1
        landing = self.landing(claims)
        results = {c: json.dumps({"by": worker, "lease": c.lease}) for c in claims}
        done = [{"id": c.id, "lease": c.lease, "result": results[c]} for c in claims]
        nexts = [n for c in claims if (n := successor(c, results[c])) is not None]
        params = {**bind(done, single=single), "channel": CHANNEL}
        if nexts:
            params.update(bind(nexts, single=False, prefix="next_"))
            stmt = Q.complete_step if single else Q.complete_steps
        else:
            stmt = Q.complete_job if single else Q.complete_jobs
        with self.engine.begin() as conn:
            got = conn.execute(stmt, params).all()
        self.forget(worker, claims)
        assert sorted(r.id for r in got) == sorted(c.id for c in landing)  # (2)
        for r in got:
            job = self.jobs[r.id]
            assert r.cancel_requested == job.cancel_requested
            assert r.id not in self.completed, f"job {r.id} completed twice"  # (3)
            self.completed.add(r.id)
            job.status, job.locked_by, job.stale = "succeeded", None, False
            self.add_successor(job)

    def add_successor(self, job: Job) -> None:
        """After `job` succeeded: its successor exists exactly once, or not at all if its run
        was cancelled (or it was the last step)."""
        steps = pipeline(job.task).steps
        with self.engine.connect() as conn:
            found = conn.execute(sa.text("""
                SELECT id, queue, max_attempts, step FROM flowq.steps
                 WHERE run_id = :r AND step_index = :i"""),
                {"r": job.run_id, "i": job.step_index + 1}).all()
        if job.cancel_requested or job.step_index + 1 >= len(steps):
            assert found == [], f"job {job.id} created a successor it must not: {found}"
            return
        nxt = steps[job.step_index + 1]
        assert len(found) == 1, f"job {job.id}'s successor inserted {len(found)} times"  # (3)
        [r] = found
        assert (r.queue, r.max_attempts, r.step) == (nxt.queue, nxt.retry.attempt_cap, nxt.name)
        self.jobs[r.id] = Job(id=r.id, run_id=job.run_id, task=job.task,
                              step_index=job.step_index + 1, queue=r.queue,
                              max_attempts=r.max_attempts)

    def retry(self, worker: str, claim: Claim, delay: float) -> None:
        self.settled = False
        landing = self.landing([claim])
        with self.engine.begin() as conn:
            got = conn.execute(Q.retry_job, {"id": claim.id, "lease": claim.lease,
                                             "delay": delay, "error": "boom"}).all()
        self.forget(worker, [claim])
        assert len(got) == len(landing)  # (2)
        if got:
            job = self.jobs[claim.id]
            expected = "cancelled" if job.cancel_requested else "pending"
            assert got[0].status == expected
            job.status, job.locked_by, job.stale, job.due = expected, None, False, delay == 0

    def end(self, worker: str, claim: Claim, status: str) -> None:
        self.settled = False
        landing = self.landing([claim])
        with self.engine.begin() as conn:
            got = conn.execute(Q.end_job, {"id": claim.id, "lease": claim.lease,
                                           "status": status, "error": "boom",
                                           "channel": CHANNEL}).all()
        self.forget(worker, [claim])
        assert len(got) == len(landing)  # (2)
        if got:
            assert got[0].status == status
            job = self.jobs[claim.id]
            job.status, job.locked_by, job.stale = status, None, False

    def release(self, worker: str, claims: list[Claim]) -> None:
        self.settled = False
        landing = self.landing(claims)
        with self.engine.begin() as conn:
            got = conn.execute(Q.release_jobs, {**bind(
                [{"id": c.id, "lease": c.lease} for c in claims], single=False),
                "channel": CHANNEL}).all()
        self.forget(worker, claims)
        assert sorted(r.id for r in got) == sorted(c.id for c in landing)  # (2)
        for r in got:
            job = self.jobs[r.id]
            job.status = "cancelled" if job.cancel_requested else "pending"
            job.attempts = max(job.attempts - 1, 0)
            job.locked_by, job.stale, job.due = None, False, True

    def stall(self, job_ids: list[int]) -> None:
        """The holders stop heartbeating (and keep believing they hold their claims)."""
        self.settled = False
        with self.engine.begin() as conn:
            conn.execute(sa.text("""
                UPDATE flowq.jobs SET heartbeat_at = now() - interval '1 hour'
                 WHERE id = ANY(:ids)"""), {"ids": job_ids})
        for i in job_ids:
            self.jobs[i].stale = True

    def reap(self) -> None:
        self.settled = False
        stale = [j for j in self.jobs.values() if j.status == "running" and j.stale]
        assert Reaper(self.engine, "flowq", stale_after=STALE_AFTER).run_once() == len(stale)
        for job in stale:
            job.status = ("cancelled" if job.cancel_requested
                          else "dead" if job.attempts >= job.max_attempts else "pending")
            job.locked_by, job.stale, job.due = None, False, True

    def let_time_pass(self) -> None:
        """Every retry scheduled later becomes due."""
        self.settled = False
        with self.engine.begin() as conn:
            conn.execute(sa.text("""
                UPDATE flowq.jobs SET run_at = now() - interval '1 second'
                 WHERE status = 'pending' AND run_at > now()"""))
        for job in self.jobs.values():
            if job.status == "pending":
                job.due = True

    def cancel(self, run_id: int) -> None:
        self.settled = False
        steps = self.steps_of(run_id)
        if derived_status(steps) in ("succeeded", "dead"):
            before = self.run_rows(run_id)
            with pytest.raises(RunStateError):
                cancel_run(self.engine, run_id)
            assert self.run_rows(run_id) == before
            return
        done = cancel_run(self.engine, run_id)
        pending = tuple(s.id for s in steps if s.status == "pending")
        flagged = tuple(s.id for s in steps if s.status == "running" and not s.cancel_requested)
        assert (done.cancelled, done.cancel_requested) == (pending, flagged)
        assert done.run.status == "cancelled"
        for s in steps:
            if s.status == "pending":
                s.status, s.cancel_requested = "cancelled", True
            elif s.status == "running":
                s.cancel_requested = True

    def retry_dead_run(self, run_id: int) -> None:
        self.settled = False
        steps = self.steps_of(run_id)
        if derived_status(steps) != "dead":
            before = self.run_rows(run_id)
            with pytest.raises(RunStateError):
                retry_run(self.engine, run_id)
            assert self.run_rows(run_id) == before
            return
        done = retry_run(self.engine, run_id)
        latest = steps[-1]
        assert done.job_id == latest.id
        latest.status, latest.attempts, latest.due = "pending", 0, True

    def stale_write(self, claim: Claim, name: str) -> None:
        """A worker writes with a claim it held long ago: nothing at all changes."""
        self.settled = False
        assert self.landing([claim]) == set()
        before = self.run_rows(self.jobs[claim.id].run_id)
        statement, params = fenced_write(name, claim)
        with self.engine.begin() as conn:
            assert conn.execute(statement, params).all() == []  # (2)
        assert self.run_rows(self.jobs[claim.id].run_id) == before

    # -- rules ----------------------------------------------------------------------------

    @initialize(plain=st.integers(0, 2), pipe2=st.integers(0, 2), pipe3=st.integers(1, 2))
    def start(self, plain: int, pipe2: int, pipe3: int) -> None:
        self.enqueue({"lc_plain": plain, "lc_pipe2": pipe2, "lc_pipe3": pipe3})

    @rule(worker=st.sampled_from(WORKERS), queue=st.sampled_from(QUEUES),
          limit=st.integers(1, 3))
    def claim_jobs(self, worker: str, queue: str, limit: int) -> None:
        self.claim(worker, queue, limit)

    @precondition(lambda self: self.holders())
    @rule(data=st.data())
    def heartbeat_jobs(self, data: st.DataObject) -> None:
        self.heartbeat(data.draw(st.sampled_from(self.holders()), label="worker"))

    @precondition(lambda self: self.holders())
    @rule(data=st.data())
    def complete_jobs(self, data: st.DataObject) -> None:
        worker = data.draw(st.sampled_from(self.holders()), label="worker")
        claims = data.draw(st.lists(st.sampled_from(self.held[worker]), min_size=1,
                                    max_size=3, unique=True), label="claims")
        single = len(claims) == 1 and data.draw(st.booleans(), label="single")
        self.complete(worker, claims, single=single)

    @precondition(lambda self: self.holders())
    @rule(data=st.data(), delay=st.sampled_from([0.0, 0.0, 3600.0]))
    def fail_retry(self, data: st.DataObject, delay: float) -> None:
        """The handler failed: retry_job if the claim has attempts left, else end_job dead
        (the executor's choice)."""
        worker = data.draw(st.sampled_from(self.holders()), label="worker")
        claim = data.draw(st.sampled_from(self.held[worker]), label="claim")
        if claim.attempts < claim.max_attempts:
            self.retry(worker, claim, delay)
        else:
            self.end(worker, claim, "dead")

    @precondition(lambda self: self.holders())
    @rule(data=st.data(), status=st.sampled_from(["dead", "dead", "cancelled"]))
    def fail_dead(self, data: st.DataObject, status: str) -> None:
        """end_job: dead (out of attempts, or not retryable), or cancelled (CancelRun)."""
        worker = data.draw(st.sampled_from(self.holders()), label="worker")
        self.end(worker, data.draw(st.sampled_from(self.held[worker]), label="claim"), status)

    @precondition(lambda self: self.holders())
    @rule(data=st.data())
    def release_jobs(self, data: st.DataObject) -> None:
        worker = data.draw(st.sampled_from(self.holders()), label="worker")
        claims = data.draw(st.lists(st.sampled_from(self.held[worker]), min_size=1,
                                    unique=True), label="claims")
        self.release(worker, claims)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def stall_workers(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(self.running()), min_size=1, unique=True),
                        label="stalled")
        self.stall(ids)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def reap_jobs(self, data: st.DataObject) -> None:
        """Some workers stall (they keep believing they hold their claims), then a reaper pass."""
        stalled = data.draw(st.lists(st.sampled_from(self.running()), unique=True),
                            label="stalled")
        if stalled:
            self.stall(stalled)
        self.reap()

    @precondition(lambda self: any(j.status == "pending" and not j.due
                                   for j in self.jobs.values()))
    @rule()
    def time_passes(self) -> None:
        self.let_time_pass()

    # A cancel is final: at most two per example, or most examples would cancel every run
    # before anything else happened (rules are drawn uniformly).
    @precondition(lambda self: len(self.runs("cancelled")) < 2
                  and self.runs("pending", "running", "succeeded", "dead"))
    @rule(data=st.data())
    def cancel_a_run(self, data: st.DataObject) -> None:
        live = self.runs("pending", "running", "succeeded", "dead")
        running = self.runs("running")
        # Cancelling a step in flight is the subtle case (it must finish without a successor):
        # pick a running run every other time there is one.
        if bool(running) and data.draw(st.booleans(), label="in_flight"):
            live = running
        self.cancel(data.draw(st.sampled_from(live), label="run_id"))

    # Any run once one is dead (the others must refuse): retrying a dead run is the point.
    @precondition(lambda self: self.runs("dead"))
    @rule(data=st.data())
    def retry_a_run(self, data: st.DataObject) -> None:
        self.retry_dead_run(data.draw(st.sampled_from(self.runs()), label="run_id"))

    @precondition(lambda self: any(not self.current(c) for c in self.ever))
    @rule(data=st.data(), name=st.sampled_from(FENCED))
    def write_with_old_claim(self, data: st.DataObject, name: str) -> None:
        old = [c for c in self.ever if not self.current(c)]
        # The dangerous case: the job runs again, under a newer claim. Every other time.
        rerun = [c for c in old if self.jobs[c.id].status == "running"]
        if bool(rerun) and data.draw(st.booleans(), label="job_runs_again"):
            old = rerun
        self.stale_write(data.draw(st.sampled_from(old), label="old_claim"), name)

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def invariants_hold(self) -> None:
        rows = self.rows()
        self.check_model(rows)
        self.check_one_holder_per_running_row(rows)
        self.check_nothing_completes_twice(rows)
        self.check_leases(rows)
        self.check_row_shapes(rows)
        self.settled = True

    def check_model(self, rows: dict[int, Any]) -> None:
        assert set(rows) == set(self.jobs), "rows appeared or vanished"
        for i, r in rows.items():
            j = self.jobs[i]
            assert (r.run_id, r.task, r.step_index, r.queue, r.max_attempts, r.status,
                    r.attempts, r.lease, r.locked_by, r.cancel_requested) == (
                j.run_id, j.task, j.step_index, j.queue, j.max_attempts, j.status,
                j.attempts, j.lease, j.locked_by, j.cancel_requested), f"job {i}: {j}"
            if r.status == "pending":
                assert r.is_due == j.due, f"job {i}: due {r.is_due}, model {j.due}"
            if r.status == "running":
                assert r.is_stale == j.stale, f"job {i}: stale {r.is_stale}, model {j.stale}"

    def check_one_holder_per_running_row(self, rows: dict[int, Any]) -> None:  # (1)
        for r in rows.values():
            if r.status != "running":
                continue
            holders = [c for held in self.held.values() for c in held
                       if (c.id, c.lease) == (r.id, r.lease)]
            assert len(holders) == 1, f"job {r.id} lease {r.lease} held by {holders}"
            [c] = holders
            assert (c.worker, c.serial) == (r.locked_by, self.jobs[r.id].claim), (
                f"job {r.id} runs under {c}, not under the claim the model knows")

    def check_nothing_completes_twice(self, rows: dict[int, Any]) -> None:  # (3)
        for i, snapshot in self.frozen.items():
            assert tuple(getattr(rows[i], c) for c in COLUMNS) == snapshot, (
                f"succeeded job {i} changed")
        for r in rows.values():
            if r.status == "succeeded" and r.id not in self.frozen:
                self.frozen[r.id] = tuple(getattr(r, c) for c in COLUMNS)
        runs: dict[int, list[Any]] = {}
        for r in rows.values():
            runs.setdefault(r.run_id, []).append(r)
        for run_id, steps in runs.items():
            steps.sort(key=lambda r: r.step_index)
            assert [s.step_index for s in steps] == list(range(len(steps))), (
                f"run {run_id} has steps {[s.step_index for s in steps]}")
            assert all(s.status == "succeeded" for s in steps[:-1]), (
                f"run {run_id}: a step was followed before it succeeded")
            last = steps[-1]
            if last.status == "succeeded" and not last.cancel_requested:
                assert last.step_index == len(pipeline(last.task).steps) - 1, (
                    f"run {run_id}: step {last.step_index} succeeded without a successor")

    def check_leases(self, rows: dict[int, Any]) -> None:  # (4)
        for r in rows.values():
            leases = self.jobs[r.id].leases
            assert leases == sorted(set(leases))
            assert r.lease == (leases[-1] if leases else None)
        assert len(self.all_leases) == sum(len(j.leases) for j in self.jobs.values())

    def check_row_shapes(self, rows: dict[int, Any]) -> None:  # (5)
        for r in rows.values():
            check_row_shape(r)

    # -- teardown: drive everything to an end ---------------------------------------------

    def teardown(self) -> None:
        if not self.settled:
            return
        for _ in range(DRAIN_ROUNDS):
            if all(j.status in TERMINAL_STATUSES for j in self.jobs.values()):
                break
            if self.running():  # every worker is presumed dead
                self.stall(self.running())
                self.reap()
            self.let_time_pass()
            for queue in QUEUES:
                self.claim(DRAINER, queue, limit=100)
            if self.held.get(DRAINER):
                self.complete(DRAINER, list(self.held[DRAINER]), single=False)
            self.invariants_hold()
        stuck = {j.id: j.status for j in self.jobs.values() if j.status not in TERMINAL_STATUSES}
        assert not stuck, f"not final after {DRAIN_ROUNDS} rounds: {stuck}"


def test_job_lifecycle(engine: sa.Engine) -> None:
    class Machine(LifecycleMachine):
        pass

    Machine.engine = engine
    run_state_machine_as_test(Machine, settings=SETTINGS)


def test_a_batch_with_two_claims_of_one_step_inserts_one_successor(engine: sa.Engine) -> None:
    """Found by the state machine above (shrunk): w1 claims a pipeline step, stalls and is
    reaped, claims the step again, then completes both attempts in one batch. The fence
    holds (only the new claim's row is updated), but the successors are joined on the job id,
    so both successor rows of the batch match that one completed row."""
    with engine.begin() as conn:
        flowq.enqueue(conn, PIPE2, n=1)
        [old] = conn.execute(Q.claim_jobs, {"queue": "lc_b", "limit": 1, "worker": "w1"}).all()
        conn.execute(sa.text("UPDATE flowq.jobs SET heartbeat_at = now() - interval '1 hour'"))
    assert Reaper(engine, "flowq", stale_after=STALE_AFTER).run_once() == 1
    with engine.begin() as conn:
        [new] = conn.execute(Q.claim_jobs, {"queue": "lc_b", "limit": 1, "worker": "w1"}).all()
    claims = [Claim("w1", n, r.id, r.lease, r.attempts, r.max_attempts, r.task, r.step_index)
              for n, r in enumerate((old, new))]
    nexts = [successor(c, "{}") for c in claims]
    with engine.begin() as conn:
        done = conn.execute(Q.complete_steps, {
            **bind([{"id": c.id, "lease": c.lease, "result": "{}"} for c in claims],
                   single=False),
            **bind([n for n in nexts if n is not None], single=False, prefix="next_"),
            "channel": CHANNEL}).all()
        assert [r.id for r in done] == [new.id]  # the fence holds: only the new attempt lands
        steps = conn.execute(sa.text(
            "SELECT step_index FROM flowq.steps WHERE run_id = :r ORDER BY step_index"),
            {"r": new.run_id}).scalars().all()
    assert steps == [0, 1]  # before the fix: [0, 1, 1]
