"""Flow control and workflows as a Hypothesis state machine, against a real PostgreSQL.

The second lifecycle model (test_lifecycle.py holds the first: the fence, one claim at a
time, predicted row by row). This one drives what the first leaves out: queue limits
(concurrency, a rate), per-key limits (keyed jobs in their task's queue, in a limited queue
and in a queue nobody declared: issue 20 #1), unique runs, a join of two parents and a step
waiting for a signal. A second machine rather than more rules on the first: its app, its
queue declarations and its actions (the worker's own path from claim to written outcome)
differ, and the first one's row-by-row prediction would have to model every statement here;
the budget of each stays its own.

Every action goes through flowq's own code, as the worker sends it: the claim path the
claimer picks (`Store.controlled_queues`, then `Store.claim` or `Store.claim_limited` in a
transaction, or for a queue limited by its concurrency alone, now and then a lease of permits
and `Store.claim_permitted` under them, worker w3 out of the registry so that leases take its
permits back), or `Store.claim` sent to any queue (a worker that has not yet seen a limit);
`flowq.worker.attempt.Attempt`, prepared at claim time as the executor does, run or failed
and judged; `flowq.worker.writes` (`write_successes` for a batch of successes, the
completer's statement, `write_outcome` for the rest); `Store.release`; `Reaper.run_once`;
`WaitExpirer.run_once`; `flowq.enqueue` (with `queue=`, `unique_key=`),
`flowq.enqueue_many`, `flowq.signal`, `flowq.ops.runs.cancel_run` and `retry_run`,
`flowq.ops.queues.pause` and `resume`; the worker's queue declarations
(`Registry.declare_queues`).
The only SQL written here reads rows, or plays the clock: a stalled heartbeat, a retry or a
wait timeout whose time has come.

Invariants, after every step:
1. A declared concurrency limit: never more than N of the queue's jobs running.
2. A per-key limit: never more than `key_limit` jobs of one concurrency key running in one
   queue, whatever queue the job was enqueued into; every queue holding a pending keyed
   job is controlled (claimed the limited way), and a plain claim of a controlled queue
   claims nothing. A paused queue gives nothing through either claim path.
3. A rate (a period of 366 days: no token comes back while the test runs): at most `limit`
   claims in the example, re-claims after a reap or a release included.
4. At most one active run per unique key; an enqueue of a key held by an active run returns
   that run (`created=False`), a free key makes a new run.
5. Each step of a run exists at most once (a join and a signalled step included); the join
   step exists iff its counter (`flowq.joins`) reached zero, the counter counts exactly the
   parents that succeeded without a cancel, whatever the order, duplication (a stale claim
   completing after its re-claim) or reaps of their completions.
6. A signal is sent once: its payload never changes (a second send of it is `created=False`,
   of another payload a SignalError, to a finished run a RunStateError), `delivered` says
   whether the waiting step was reached and runnable; the waiting step ends one way only: it
   succeeds with the payload if the signal was sent before its attempt started, else that
   attempt fails with SignalTimeout (and its retry, if any, gets the payload).
7. One holder per running row (the claim the worker believes it holds, in `locked_by`); a
   succeeded row never changes; row shapes by status.

At teardown the system is driven to its end through the same limited claims (every worker
presumed dead, time let pass, waits expired) in a bounded number of rounds: every row ends
final, except pending jobs of the rate-limited queue once its `limit` claims are spent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final

import pytest
import sqlalchemy as sa
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from tenacity import wait_fixed
from test_lifecycle import SETTINGS as LIFECYCLE_SETTINGS  # the first model's helpers
from test_lifecycle import STALE_AFTER, check_row_shape

import flowq
from flowq import FlowQ, Pipeline, Rate, Retry, RunStateError
from flowq.db.rows import ClaimedJob
from flowq.db.runner import runner
from flowq.db.schema import ACTIVE_STATUSES, TERMINAL_STATUSES
from flowq.db.store import Store
from flowq.errors import SignalError
from flowq.ops.queues import pause, resume
from flowq.ops.runs import cancel_run, get_run, retry_run
from flowq.worker.attempt import Attempt, Call
from flowq.worker.model import Outcome, Succeeded
from flowq.worker.reaper import Reaper
from flowq.worker.registry import Registry
from flowq.worker.waits import WaitExpirer
from flowq.worker.writes import write_outcome, write_successes

WORKERS: Final = ("w1", "w2", "w3")
DRAINER: Final = "drainer"
DRAIN_ROUNDS: Final = 40  # a key limit of 1 drains one job of a key per round
CONCURRENCY: Final = 2  # queue lm_q
RATE: Final = 3  # starts of queue lm_r per 366 days: none comes back during a test
# lm_k: the keyed tasks' own queue; lm_x: a queue nobody declares, keyed jobs enqueued into
# it by `queue=` (issue 20 #1); lm_w: workflows and unique runs, claimed the plain way.
QUEUES: Final = ("lm_q", "lm_r", "lm_k", "lm_x", "lm_w")
# What becomes of a claim a worker holds, each time the worker works.
FATES: Final = ("run on", "succeed", "succeed", "fail", "release")
PAYLOADS: Final = ({"box": "A"}, {"box": "B"})
JOINED: Final = ("left", "right")

SETTINGS = settings(LIFECYCLE_SETTINGS, max_examples=30)  # the first model's, derandomized

# -- the app ----------------------------------------------------------------------------------

APP = FlowQ()
APP.queue("lm_q", concurrency=CONCURRENCY)
APP.queue("lm_r", rate_limit=Rate(RATE, per=366 * 86400))
# A fixed wait of an hour: a retry is due only when the model lets time pass (a jittered
# second would come due on the wall clock, and the draws would depend on it).
TWO = Retry(max_attempts=2, wait=wait_fixed(3600))


@APP.task(name="lm_limited", queue="lm_q", retry=TWO)
def lm_limited(ctx: Any, n: int) -> dict[str, int]:
    return {"n": n}


@APP.task(name="lm_rated", queue="lm_r", retry=TWO)
def lm_rated(ctx: Any, n: int) -> dict[str, int]:
    return {"n": n}


# Keys of the two keyed tasks never meet (a... and b...): each key has one limit.
@APP.task(name="lm_key1", queue="lm_k", retry=TWO,
          concurrency_key=lambda customer: f"a{customer}", key_concurrency=1)
def lm_key1(ctx: Any, customer: int) -> dict[str, int]:
    return {"customer": customer}


@APP.task(name="lm_key2", queue="lm_k", retry=TWO,
          concurrency_key=lambda customer: f"b{customer}", key_concurrency=2)
def lm_key2(ctx: Any, customer: int) -> dict[str, int]:
    return {"customer": customer}


@APP.task(name="lm_unique", queue="lm_w", retry=TWO)
def lm_unique(ctx: Any, n: int) -> dict[str, int]:
    return {"n": n}


JOIN = APP.pipeline("lm_join", queue="lm_w")


@JOIN.step(name="start", retry=TWO)
def j_start(ctx: Any, n: int) -> dict[str, int]:
    return {"n": n}


@JOIN.step(name="left", parents=["start"], retry=TWO)
def j_left(ctx: Any, n: int) -> dict[str, int]:
    return {"l": n}


@JOIN.step(name="right", parents=["start"], retry=TWO)
def j_right(ctx: Any, n: int) -> dict[str, int]:
    return {"r": n}


@JOIN.step(name="merge", parents=["left", "right"], retry=TWO)
def j_merge(ctx: Any, left: dict[str, int], right: dict[str, int]) -> dict[str, Any]:
    return {"left": left, "right": right}


SIGNAL = APP.pipeline("lm_signal", queue="lm_w")


@SIGNAL.step(name="prep", retry=TWO)
def s_prep(ctx: Any, n: int) -> dict[str, int]:
    return {"n": n}


# A retry policy given: a timed-out attempt is retried, and the retry runs with the payload
# if the signal came meanwhile.
@SIGNAL.step(name="gated", wait_for="go", wait_timeout=3600, retry=TWO)
def s_gated(ctx: Any, n: int, go: dict[str, str]) -> dict[str, Any]:
    return {"got": go}


# What producers enqueue: (task, queue=, unique_key=). Keyed jobs also go to a limited queue
# and to a queue nobody declares.
ENQUEUES: Final = (
    ("lm_limited", None, None), ("lm_rated", None, None), ("lm_join", None, None),
    ("lm_signal", None, None), ("lm_unique", None, "u1"), ("lm_unique", None, "u2"),
    ("lm_key1", None, None), ("lm_key1", "lm_x", None), ("lm_key1", "lm_q", None),
    ("lm_key2", None, None), ("lm_key2", "lm_x", None), ("lm_key2", "lm_q", None),
    ("lm_key1", "lm_x", "u1"), ("lm_key2", None, "u1"))  # unique and keyed: its own statement

KINDS: Final[dict[str, Pipeline]] = {p.name: p for p in (
    lm_limited, lm_rated, lm_key1, lm_key2, lm_unique, JOIN, SIGNAL)}


# -- the model --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """A claim as a worker holds it: the claimed row, and its attempt prepared at claim time
    (as the executor prepares it when the job starts), with whether the signal it waits for
    had been sent by then."""

    serial: int
    worker: str
    job: ClaimedJob
    attempt: Attempt
    prepared: Call | Outcome
    signal_sent: bool


@dataclass
class RunModel:
    run_id: int
    task: str
    unique_key: str | None = None
    payload: Any = None  # the signal sent, once it is


class LimitsMachine(RuleBasedStateMachine):
    """Producers, workers (claiming through every path, running, failing, releasing,
    stalling), the reaper, the waits' expiry, signal senders and operators cancelling.
    `engine` is set by the test."""

    engine: sa.Engine

    def __init__(self) -> None:
        super().__init__()
        self.runs: dict[int, RunModel] = {}
        self.held: dict[str, list[Held]] = {w: [] for w in (*WORKERS, DRAINER)}
        self.serials = 0
        self.rated_claims = 0
        self.cancels = 0
        self.paused: set[str] = set()
        self.frozen: dict[int, tuple[Any, ...]] = {}
        self.settled = False  # see test_lifecycle.py: teardown drives a checked system only

    # -- reading ------------------------------------------------------------------------

    def rows(self) -> list[Any]:
        with self.engine.connect() as conn:
            return conn.execute(sa.text("SELECT * FROM flowq.steps ORDER BY id")).all()

    def read(self, sql: str, **params: Any) -> list[Any]:
        with self.engine.connect() as conn:
            return conn.execute(sa.text(sql), params).all()

    def active(self) -> set[int]:
        """The runs with a row pending, running or waiting."""
        return {r.run_id for r in self.read(
            "SELECT DISTINCT run_id FROM flowq.steps WHERE status = ANY(:s)",
            s=list(ACTIVE_STATUSES))}

    def signal_sent(self, run_id: int) -> bool:
        return bool(self.read("SELECT 1 FROM flowq.signals WHERE run_id = :r AND name = 'go' "
                              "AND sent_at IS NOT NULL", r=run_id))

    def due_queues(self) -> list[str]:
        return [r.queue for r in self.read(
            "SELECT DISTINCT queue FROM flowq.steps WHERE status = 'pending' AND run_at <= now() "
            "ORDER BY queue")]

    def later(self) -> bool:
        """Whether a retry or a wait is due later (time passing changes something)."""
        return bool(self.read("SELECT 1 FROM flowq.steps WHERE status IN ('pending', 'waiting') "
                              "AND run_at > now() LIMIT 1"))

    def signal_runs(self, *, live: bool) -> list[int]:
        runs = sorted(r.run_id for r in self.runs.values() if r.task == "lm_signal")
        return sorted(set(runs) & self.active()) if live else runs

    def holders(self) -> list[str]:
        return [w for w in WORKERS if self.held[w]]

    def running(self) -> list[int]:
        return [r.id for r in self.rows() if r.status == "running"]

    @contextmanager
    def store(self) -> Iterator[tuple[sa.Connection, Store]]:
        with self.engine.begin() as conn:
            yield conn, Store(runner(conn))

    # -- actions ------------------------------------------------------------------------

    def reset(self) -> None:
        self.settled = False
        with self.engine.begin() as conn:  # one database for all examples
            conn.execute(sa.text("TRUNCATE flowq.jobs, flowq.job_history, flowq.joins, "
                                 "flowq.join_shards, flowq.signals, flowq.uniques, flowq.queues, flowq.permits, "
                                 "flowq.workers"))
        # w1 and w2 are in the registry; w3 is not (as a worker whose entry expired): every
        # lease of a queue takes its permits back, while its running jobs still count.
        for worker in WORKERS[:2]:
            Registry(self.engine, "flowq", worker=worker, queues=APP.queues, tasks=[],
                     concurrency=1).register()
        # What a worker of APP writes when it starts: the limits, and the keyed tasks' queue.
        Registry(self.engine, "flowq", worker="lm", queues=APP.queues, tasks=[], concurrency=1
                 ).declare_queues(APP.declared_queues, APP.keyed_queues)

    def enqueue(self, task: str, *, n: int, queue: str | None = None,
                unique_key: str | None = None, many: int = 0) -> None:
        """`flowq.enqueue` one run, or with `many`, `flowq.enqueue_many` that many runs (its
        own statement: keyed jobs mark their queue there too)."""
        self.settled = False
        definition = KINDS[task]
        args = {"customer": n} if definition.concurrency_key is not None else {"n": n}
        if many:
            with self.engine.begin() as conn:
                ids = flowq.enqueue_many(conn, definition, [args] * many, queue=queue)
            assert len(ids) == many and not set(ids) & set(self.runs)
            self.runs.update((i, RunModel(i, task)) for i in ids)
            return
        holder = None
        if unique_key is not None:  # a key of the task (another task's key is another)
            active = self.active()
            live = [r for r in self.runs.values() if (r.task, r.unique_key) == (
                task, unique_key) and r.run_id in active]
            assert len(live) <= 1
            holder = live[0].run_id if live else None
        with self.engine.begin() as conn:
            done = flowq.enqueue(conn, definition, queue=queue, unique_key=unique_key, **args)
        if holder is not None:  # (4) the active run holding the key comes back
            assert (done.id, done.created) == (holder, False)
            return
        assert done.created and done.id not in self.runs
        self.runs[done.id] = RunModel(done.id, task, unique_key)

    def claim(self, worker: str, queue: str, limit: int, *, plain: bool,
              lease: bool = True) -> None:
        """Claim as the claimer does (the queue's controls decide the path), or `plain`: the
        unlimited statement, as a worker that has not yet seen the queue's limits sends it.
        A queue claimed under permits is claimed under the ones the worker holds, after a
        lease if `lease`; permits are given back when no due job is left."""
        self.settled = False
        with self.store() as (_, store):
            controls = store.controlled_queues([queue])
            assert controls.get(queue, False) == (queue in self.paused)
            permits = store.controls([queue]).get(queue) == "permits"
        if permits and not plain:
            if lease:
                with self.store() as (_, store):
                    for statement, params in store.lease_permits_statements(queue, limit,
                                                                            worker):
                        store.run(statement, params)
            with self.store() as (_, store):
                mine = [h.job.id for h in self.held[worker] if h.job.queue == queue]
                permitted = store.claim_permitted(queue, limit, worker, mine)
                got = permitted.jobs
                if not permitted.more:
                    store.release_permits(queue, worker)
        else:
            with self.store() as (_, store):
                if plain or queue not in controls:
                    got = store.claim(queue, limit, worker)
                    if queue in controls:  # (2) a controlled queue is never claimed plainly
                        assert got == [], f"plain claim of controlled {queue} took {got}"
                else:
                    # A paused queue is skipped by the claimer; claimed anyway, as by a
                    # worker that has not re-read the table since the pause, it gives nothing.
                    got = store.claim_limited(queue, limit, worker).jobs
                    if queue in self.paused:
                        assert got == [], f"claim of paused {queue} took {got}"
        if queue == "lm_r":
            self.rated_claims += len(got)
        for job in sorted(got, key=lambda j: j.id):
            with self.engine.connect() as conn:
                attempt = Attempt(APP, job, read=lambda s, p, c=conn: c.execute(s, p).all())
                prepared = attempt.prepare()
            sent = self.signal_sent(job.run_id) if job.step == "gated" else False
            self.held[worker].append(Held(self.serials, worker, job, attempt, prepared, sent))
            self.serials += 1

    def landing(self, held: list[Held]) -> set[int]:
        """The serials whose rows run under their lease (where a fenced write must land)."""
        ids = [h.job.id for h in held]
        rows = {(r.id, r.lease) for r in self.read(
            "SELECT id, lease FROM flowq.steps WHERE id = ANY(:ids) AND status = 'running'",
            ids=ids)}
        return {h.serial for h in held if h.job.claim in rows}

    def outcome(self, held: Held, succeed: bool) -> Outcome:
        """What the attempt ends with: its handler's result, or a failure it raised; an
        attempt that could not start (a missed signal) has its outcome already."""
        if not isinstance(held.prepared, Call):
            return held.prepared
        if not succeed:
            return held.attempt.judge_exception(RuntimeError("boom"))
        return held.attempt.judge(held.prepared())

    def finish(self, worker: str, chosen: list[Held], succeed: bool) -> None:
        """The attempts of `chosen` end; their outcomes are written as the completer writes
        them: the successes in one batch, each other outcome by itself."""
        self.settled = False
        landing = self.landing(chosen)
        outcomes = [(h, self.outcome(h, succeed)) for h in chosen]
        for h, outcome in outcomes:
            if h.job.step == "gated":  # (6) one way only: the payload, or SignalTimeout
                if h.signal_sent and succeed:
                    assert isinstance(outcome, Succeeded), outcome
                    payload = self.runs[h.job.run_id].payload
                    assert json.loads(outcome.result) == {"got": payload}
                elif not h.signal_sent:
                    assert not isinstance(outcome, Succeeded)
                    assert "SignalTimeout" in outcome.text, outcome  # type: ignore[union-attr]
        successes = [(h.job, o) for h, o in outcomes if isinstance(o, Succeeded)]
        with self.store() as (_, store):
            written = write_successes(store, successes) if successes else set()
            for h, o in outcomes:
                if not isinstance(o, Succeeded):
                    w = write_outcome(store, h.job, o)
                    assert (w is not None) == (h.serial in landing), (h, o, w)
        assert written == {h.job.id for h, o in outcomes
                           if isinstance(o, Succeeded) and h.serial in landing}
        gone = {h.serial for h in chosen}
        self.held[worker] = [h for h in self.held[worker] if h.serial not in gone]

    def release(self, worker: str, chosen: list[Held]) -> None:
        self.settled = False
        landing = self.landing(chosen)
        with self.store() as (_, store):
            released = store.release([h.job.claim for h in chosen])
        assert sorted(released) == sorted(h.job.id for h in chosen if h.serial in landing)
        gone = {h.serial for h in chosen}
        self.held[worker] = [h for h in self.held[worker] if h.serial not in gone]

    def stall_and_reap(self, ids: list[int]) -> None:
        """Workers of `ids` stop heartbeating (they keep believing they hold their claims);
        a reaper pass."""
        self.settled = False
        with self.engine.begin() as conn:
            conn.execute(sa.text("UPDATE flowq.jobs SET heartbeat_at = now() - interval "
                                 "'1 hour' WHERE id = ANY(:ids)"), {"ids": ids})
        stale = len(self.read("SELECT id FROM flowq.steps WHERE status = 'running' AND "
                              "heartbeat_at < now() - make_interval(secs => :s)", s=STALE_AFTER))
        assert Reaper(self.engine, "flowq", stale_after=STALE_AFTER).run_once() == stale

    def let_time_pass(self) -> None:
        """Retries scheduled later become due; waits reach their timeout, and the expiry pass
        makes them runnable (without the payload)."""
        self.settled = False
        with self.engine.begin() as conn:
            conn.execute(sa.text("UPDATE flowq.jobs SET run_at = now() - interval '1 second' "
                                 "WHERE status IN ('pending', 'waiting') AND run_at > now()"))
        waiting = len(self.read("SELECT id FROM flowq.steps WHERE status = 'waiting'"))
        assert WaitExpirer(self.engine, "flowq").run_once() == waiting

    def signal(self, run_id: int, payload: Any) -> None:
        """Send signal 'go' to `run_id`: what comes back is decided by the run's rows and the
        signal sent before, read just before."""
        self.settled = False
        run = self.runs[run_id]
        status = get_run(self.engine, run_id).status
        reached = self.read("SELECT status FROM flowq.steps WHERE run_id = :r AND step = "
                            "'gated'", r=run_id)
        before = self.read("SELECT * FROM flowq.signals WHERE run_id = :r", r=run_id)
        with self.engine.connect() as conn:  # a refused signal is rolled back at close
            if status in ("succeeded", "dead", "cancelled") or run_id not in self.active():
                with pytest.raises(RunStateError):
                    flowq.signal(conn, run_id, "go", payload)
            elif run.payload is not None and run.payload != payload:
                with pytest.raises(SignalError):
                    flowq.signal(conn, run_id, "go", payload)
            else:
                sent = flowq.signal(conn, run_id, "go", payload)
                conn.commit()
                assert sent.created == (run.payload is None)
                # delivered: the waiting step was reached and is runnable now
                assert sent.delivered == (sent.created and bool(reached) and reached[0].status
                                          in ("waiting", "pending")), (sent, reached)
                run.payload = payload
                return
        assert self.read("SELECT * FROM flowq.signals WHERE run_id = :r", r=run_id) == before

    def pause(self, queue: str) -> None:
        """Pause `queue`, or resume it if it is paused."""
        self.settled = False
        if queue in self.paused:
            assert resume(self.engine, queue)
            self.paused.discard(queue)
        else:
            assert pause(self.engine, queue)
            self.paused.add(queue)

    def retry_dead(self, run_id: int) -> None:
        """`flowq runs retry`: a dead run's dead steps run again; any other run refuses."""
        self.settled = False
        status = get_run(self.engine, run_id).status
        if status != "dead":
            with pytest.raises(RunStateError):
                retry_run(self.engine, run_id)
            return
        # A dead step waiting for a signal waits again (with a new timeout).
        assert retry_run(self.engine, run_id).run.status in ("pending", "waiting")

    def cancel(self, run_id: int) -> None:
        self.settled = False
        status = get_run(self.engine, run_id).status
        if status in ("succeeded", "dead"):
            with pytest.raises(RunStateError):
                cancel_run(self.engine, run_id)
            return
        assert cancel_run(self.engine, run_id).run.status == "cancelled"
        self.cancels += 1

    # -- rules ----------------------------------------------------------------------------

    # A batch of work to begin with.
    @initialize(what=st.lists(st.sampled_from(ENQUEUES), min_size=2, max_size=6),
                n=st.integers(0, 1))
    def start(self, what: list[tuple[str, str | None, str | None]], n: int) -> None:
        self.reset()
        for task, queue, unique_key in what:
            self.enqueue(task, n=n, queue=queue, unique_key=unique_key)

    @rule(data=st.data(), worker=st.sampled_from(WORKERS), limit=st.integers(0, 4),
          plain=st.sampled_from([False, False, False, True]), lease=st.booleans())
    def work(self, data: st.DataObject, worker: str, limit: int, plain: bool,
             lease: bool) -> None:
        """A worker claims (mostly from a queue with due work: an empty claim teaches
        little), and each claim it held before succeeds, fails, is released or goes on
        running. Claims of reaped jobs it still holds write too: late, duplicated
        completions."""
        # What it held before ends (or runs on); what it claims now has just started: it
        # runs on through the next steps (reaps, other claims) and ends at a later turn.
        fates = [data.draw(st.sampled_from(FATES), label=f"claim {h.serial}")
                 for h in self.held[worker]]
        chosen = list(zip(self.held[worker], fates, strict=True))
        if limit:
            due = self.due_queues()
            queues = due if due and data.draw(st.integers(0, 3), label="busy") else QUEUES
            self.claim(worker, data.draw(st.sampled_from(queues), label="queue"), limit,
                       plain=plain, lease=lease)
        for fate in ("succeed", "fail"):
            ended = [h for h, f in chosen if f == fate]
            if ended:
                self.finish(worker, ended, fate == "succeed")
        released = [h for h, f in chosen if f == "release"]
        if released:
            self.release(worker, released)

    # Two keys per keyed task, so that keys meet their limits; now and then a batch
    # (`enqueue_many`, which takes no unique key).
    @rule(what=st.sampled_from(ENQUEUES), n=st.integers(0, 1),
          many=st.sampled_from([0, 2]))
    def enqueue_work(self, what: tuple[str, str | None, str | None], n: int, many: int
                     ) -> None:
        task, queue, unique_key = what
        self.enqueue(task, n=n, queue=queue, unique_key=unique_key,
                     many=0 if unique_key else many)

    @rule(data=st.data(), reap=st.booleans())
    def clock(self, data: st.DataObject, reap: bool) -> None:
        """Some workers stall and a reaper pass runs (they keep their claims, and write with
        them later); or time passes: retries become due, waits time out (the expiry pass),
        racing the signals."""
        running = self.running()
        if reap and running:
            self.stall_and_reap(data.draw(st.lists(st.sampled_from(running), min_size=1,
                                                   unique=True), label="stalled"))
        else:
            self.let_time_pass()

    @precondition(lambda self: self.signal_runs(live=True))
    @rule(data=st.data(), payload=st.sampled_from(PAYLOADS))
    def send_signal(self, data: st.DataObject, payload: Any) -> None:
        # Mostly to a run still going: a finished one refuses (checked every fourth time).
        runs = self.signal_runs(live=bool(data.draw(st.integers(0, 3), label="live")))
        self.signal(data.draw(st.sampled_from(runs), label="run_id"), payload)

    # One rule for the operators, so that their actions do not crowd out the workers'.
    @precondition(lambda self: self.runs)
    @rule(data=st.data(), action=st.sampled_from(["retry", "retry", "cancel", "pause"]))
    def operate(self, data: st.DataObject, action: str) -> None:
        """`flowq runs retry` (mostly of a dead run), `flowq runs cancel` (at most twice: a
        cancel is final), or `flowq queues pause`/`resume`. Unique runs are not retried:
        `runs retry` does not check the key again (documented: if a new run took the key
        meanwhile, both are active)."""
        if action == "pause":
            self.pause(data.draw(st.sampled_from(QUEUES), label="queue"))
            return
        runs = sorted(self.runs)
        if action == "cancel" and self.cancels < 2:
            self.cancel(data.draw(st.sampled_from(runs), label="run_id"))
            return
        runs = [r for r in runs if self.runs[r].unique_key is None]
        dead = [r for r in runs if get_run(self.engine, r).status == "dead"]
        if dead and data.draw(st.integers(0, 3), label="dead"):
            runs = dead
        if runs:
            self.retry_dead(data.draw(st.sampled_from(runs), label="run_id"))

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def invariants_hold(self) -> None:
        rows = self.rows()
        self.check_limits(rows)
        self.check_uniques(rows)
        self.check_steps_once(rows)
        self.check_signals(rows)
        self.check_holders_and_shapes(rows)
        self.settled = True

    def check_limits(self, rows: list[Any]) -> None:  # (1), (2), (3)
        running = [r for r in rows if r.status == "running"]
        assert sum(r.queue == "lm_q" for r in running) <= CONCURRENCY, running
        by_key: dict[tuple[str, str], list[Any]] = {}
        for r in running:
            if r.concurrency_key is not None:
                by_key.setdefault((r.queue, r.concurrency_key), []).append(r)
        for (queue, key), group in by_key.items():
            limit = KINDS[group[0].task].key_concurrency
            assert {r.key_limit for r in group} == {limit}, group
            assert len(group) <= limit, f"{len(group)} of key {key} run in {queue}: {group}"
        keyed = {r.queue for r in rows if r.status == "pending" and r.concurrency_key}
        with self.engine.connect() as conn:
            controlled = Store(runner(conn)).controlled_queues(sorted(keyed))
        assert keyed <= set(controlled), f"{keyed - set(controlled)} hold keyed jobs, uncontrolled"
        assert self.rated_claims <= RATE, f"{self.rated_claims} starts in lm_r (rate {RATE})"

    def check_uniques(self, rows: list[Any]) -> None:  # (4)
        active = {r.run_id for r in rows if r.status in ACTIVE_STATUSES}
        holders: dict[tuple[str, str], list[int]] = {}
        for r in self.runs.values():
            if r.unique_key is not None and r.run_id in active:
                holders.setdefault((r.task, r.unique_key), []).append(r.run_id)
        assert all(len(h) == 1 for h in holders.values()), holders

    def check_steps_once(self, rows: list[Any]) -> None:  # (5)
        steps: dict[tuple[int, str], int] = {}
        for r in rows:
            steps[r.run_id, r.step] = steps.get((r.run_id, r.step), 0) + 1
        assert all(n == 1 for n in steps.values()), {k: n for k, n in steps.items() if n > 1}
        counters = {(c.run_id, c.step): c for c in self.read("SELECT * FROM flowq.joins")}
        for run in self.runs.values():
            if run.task != "lm_join":
                continue
            counted = sum(1 for r in rows if r.run_id == run.run_id and r.step in JOINED
                          and r.status == "succeeded" and not r.cancel_requested)
            c = counters.get((run.run_id, "merge"))
            assert (c.remaining if c else 2) == 2 - counted, (run.run_id, c, counted)
            merged = (run.run_id, "merge") in steps
            assert merged == (c is not None and c.remaining == 0), (run.run_id, c)

    def check_signals(self, rows: list[Any]) -> None:  # (6)
        sent = {s.run_id: s for s in self.read(
            "SELECT * FROM flowq.signals WHERE sent_at IS NOT NULL")}
        for run in self.runs.values():
            if run.task != "lm_signal":
                assert run.run_id not in sent
                continue
            assert (run.run_id in sent) == (run.payload is not None)
            if run.payload is not None:
                assert sent[run.run_id].payload == run.payload
        for r in rows:
            if r.step == "gated" and r.status == "succeeded":
                assert r.result == {"got": self.runs[r.run_id].payload}, r

    def check_holders_and_shapes(self, rows: list[Any]) -> None:  # (7)
        for r in rows:
            check_row_shape(r)
            if r.status == "running":
                holders = [h for held in self.held.values() for h in held
                           if h.job.claim == (r.id, r.lease)]
                assert [h.worker for h in holders] == [r.locked_by], (r, holders)
            if r.status == "succeeded":
                snapshot = tuple(r)
                assert self.frozen.setdefault(r.id, snapshot) == snapshot, f"job {r.id} changed"

    # -- teardown: drive everything to an end ---------------------------------------------

    def teardown(self) -> None:
        if not self.settled:
            return

        def stuck() -> list[Any]:
            return [r for r in self.rows() if r.status not in TERMINAL_STATUSES
                    and not (r.queue == "lm_r" and r.status == "pending"
                             and self.rated_claims == RATE)]

        for queue in sorted(self.paused):
            self.pause(queue)  # resumed
        with self.engine.begin() as conn:  # out of the registry: their permits come back
            conn.execute(sa.text("DELETE FROM flowq.workers"))
        for _ in range(DRAIN_ROUNDS):
            if not stuck():
                break
            if self.running():  # every worker is presumed dead
                self.stall_and_reap(self.running())
            self.let_time_pass()
            for queue in QUEUES:
                self.claim(DRAINER, queue, limit=100, plain=False)
            if self.held[DRAINER]:
                self.finish(DRAINER, list(self.held[DRAINER]), succeed=True)
            self.invariants_hold()
        left = stuck()
        assert not left, f"not final after {DRAIN_ROUNDS} rounds: {left}"
        # (5) every join whose parents both succeeded without a cancel ran once
        for run in self.runs.values():
            if run.task == "lm_join":
                rows = {r.step: r for r in self.rows() if r.run_id == run.run_id}
                if all(s in rows and rows[s].status == "succeeded"
                       and not rows[s].cancel_requested for s in JOINED):
                    assert "merge" in rows, run


# Passing takes a few tens of seconds; a failure is shrunk for up to Hypothesis' own five
# minutes before it is reported, which the suite's 300 s timeout would cut short.
@pytest.mark.timeout(420)
def test_limits_uniques_joins_and_signals(engine: sa.Engine) -> None:
    class Machine(LimitsMachine):
        pass

    Machine.engine = engine
    run_state_machine_as_test(Machine, settings=SETTINGS)


def machine(engine: sa.Engine) -> LimitsMachine:
    """The model above, driven by hand: the races a test must always see, not only when the
    draws happen on them. Its invariants are checked after every action."""

    class Machine(LimitsMachine):
        pass

    Machine.engine = engine
    m = Machine()
    m.reset()
    return m


def claim_one(m: LimitsMachine, worker: str, step: str) -> Held:
    """`worker` claims the next due job of lm_w (a plain queue): one of `step`."""
    before = len(m.held[worker])
    m.claim(worker, "lm_w", 1, plain=False)
    m.invariants_hold()
    [held] = m.held[worker][before:]
    assert held.job.step == step, held
    return held


def test_a_join_counts_a_parent_once_through_reaps_and_late_completions(
        engine: sa.Engine) -> None:
    """w1's claim of `left` is reaped and w1 claims it again; both claims then complete in
    one batch (the completer's), and w2's late claim of `right`, reaped and re-claimed by
    w3, completes after its re-claim: each parent counts once, the join is created once."""
    m = machine(engine)
    m.enqueue("lm_join", n=1)
    m.finish("w1", [claim_one(m, "w1", "start")], succeed=True)
    m.invariants_hold()
    old_left = claim_one(m, "w1", "left")
    old_right = claim_one(m, "w2", "right")
    m.stall_and_reap([old_left.job.id, old_right.job.id])
    m.invariants_hold()
    new_left = claim_one(m, "w1", "left")
    new_right = claim_one(m, "w3", "right")
    m.finish("w1", [old_left, new_left], succeed=True)  # one batch, two claims of one job
    m.invariants_hold()
    m.finish("w3", [new_right], succeed=True)
    m.invariants_hold()
    m.finish("w2", [old_right], succeed=True)  # late: lands nowhere, counts nothing
    m.invariants_hold()
    m.finish("w1", [claim_one(m, "w1", "merge")], succeed=True)
    m.invariants_hold()
    [run_id] = m.runs
    assert [r.step for r in m.rows() if r.run_id == run_id] == [
        "start", "left", "right", "merge"]
    assert get_run(engine, run_id).status == "succeeded"


def test_a_signal_racing_its_timeout_ends_one_way(engine: sa.Engine) -> None:
    """The wait times out (the expiry pass) and an attempt starts without the payload; the
    signal comes while it runs (sent, not delivered; the same payload again is a no-op,
    another refused); that attempt fails with SignalTimeout, and its retry runs with the
    payload. A signal that comes while its step waits is delivered and runs with it. A step
    whose attempts all timed out is dead and refuses the signal; `runs retry` makes it wait
    again, and the signal is delivered."""
    m = machine(engine)
    m.enqueue("lm_signal", n=1)
    [raced] = m.runs
    m.finish("w1", [claim_one(m, "w1", "prep")], succeed=True)
    m.invariants_hold()
    m.let_time_pass()  # the wait times out: runnable without the payload
    m.invariants_hold()
    late = claim_one(m, "w1", "gated")
    for payload in (PAYLOADS[0], PAYLOADS[0], PAYLOADS[1]):  # sent; no-op; refused
        m.signal(raced, payload)
        m.invariants_hold()
    m.finish("w1", [late], succeed=True)  # it started without: SignalTimeout, retried
    m.invariants_hold()
    assert m.read("SELECT status, attempts, last_error LIKE 'SignalTimeout%' AS timed_out "
                  "FROM flowq.steps WHERE id = :i", i=late.job.id) == [("pending", 1, True)]
    m.let_time_pass()
    m.finish("w2", [claim_one(m, "w2", "gated")], succeed=True)  # with the payload
    m.invariants_hold()
    assert get_run(engine, raced).result == {"got": PAYLOADS[0]}

    m.enqueue("lm_signal", n=2)
    [waits] = set(m.runs) - {raced}
    m.finish("w3", [claim_one(m, "w3", "prep")], succeed=True)
    m.signal(waits, PAYLOADS[1])  # delivered: the step waits
    m.invariants_hold()
    m.finish("w3", [claim_one(m, "w3", "gated")], succeed=True)
    m.invariants_hold()
    assert get_run(engine, waits).result == {"got": PAYLOADS[1]}
    m.signal(waits, PAYLOADS[1])  # finished: refused

    m.enqueue("lm_signal", n=3)
    [missed] = set(m.runs) - {raced, waits}
    m.finish("w1", [claim_one(m, "w1", "prep")], succeed=True)
    for _ in range(2):  # both attempts time out: dead
        m.let_time_pass()
        m.finish("w1", [claim_one(m, "w1", "gated")], succeed=True)
        m.invariants_hold()
    m.signal(missed, PAYLOADS[0])  # dead: refused
    m.retry_dead(missed)  # `flowq runs retry`: the step waits again
    m.invariants_hold()
    m.signal(missed, PAYLOADS[0])  # delivered now
    m.finish("w2", [claim_one(m, "w2", "gated")], succeed=True)
    m.invariants_hold()
    assert get_run(engine, missed).result == {"got": PAYLOADS[0]}
