"""The worker fault suite, for 3-step pipelines: real `flowq worker` processes, real crashes.

Runs of `relay` (tests/apps/pipeline_fault_app.py) have three steps; each step writes one
ledger row through `ctx.session`, which commits with the step's success and the insert of
its successor. Whatever hits the workers mid-run (SIGKILL, PostgreSQL restarted, one role's
connections terminated, a frozen worker waking up after its steps were taken over), the end
must be the same, checked by `assert_runs_exact`: every run succeeded with exactly three
steps (step_index 0, 1 and 2, once each), every step's arguments are the previous step's
result, and the ledger holds exactly one row per step of every run, written by the very
attempt whose result the next step received.

Runs are enqueued staggered (`enqueue_relays(stagger=...)`), so while later runs start,
earlier ones are in their second or third step: a fault finds runs at every step. Time is
never asserted; tests wait on conditions with deadlines, with short heartbeat, reap and
poll intervals to stay fast.
"""

from __future__ import annotations

import random
import signal
from collections import defaultdict
from collections.abc import Iterable, Sequence
from itertools import pairwise
from typing import Any

import pipeline_fault_app as pfa
import pytest
import sqlalchemy as sa
from support import (
    Row,
    Spawn,
    WorkerProcess,
    backends,
    held_by,
    held_when_killed,
    stop_workers,
    terminate,
)
from support import rows as query
from support import spawn_ready as spawn_workers

import flowq
from flowq.local.postgres import LocalPostgres
from flowq.names import DEFAULT_SCHEMA
from flowq.testing import job_rows, wait_until
from flowq.worker.reaper import Reaper

APP = "pipeline_fault_app:app"
# A dead worker's steps are reaped about a second after its last heartbeat.
FAST = ["--heartbeat-interval", "0.2", "--stale-after", "1.0", "--reap-interval", "0.3",
        "--poll-interval", "0.2"]
STEP_SLEEP = 0.2
ALL_STEPS = {0, 1, 2}
ROLES = ("session", "complete", "claim", "heartbeat", "maintain", "listen")


# -- helpers ----------------------------------------------------------------------------------

def enqueue_relays(engine: sa.Engine, n: int, *, start: int = 0, stagger: float = 0.0,
                   sleeps: Sequence[float] = (STEP_SLEEP,) * 3) -> list[int]:
    """Enqueue `n` runs of `relay`, the i-th due `i * stagger` seconds from now; their ids."""
    with engine.begin() as conn:
        return [flowq.enqueue(conn, pfa.relay, n=start + i, sleeps=list(sleeps), trail=[],
                              delay=i * stagger).id for i in range(n)]


def steps_succeeded(engine: sa.Engine) -> int:
    return int(query(engine, "SELECT count(*) FROM flowq.steps WHERE status = 'succeeded'")[0][0])


def steps_in_flight(engine: sa.Engine) -> set[int]:
    """The step indexes at which some run is waiting or running."""
    return {r[0] for r in query(engine, "SELECT DISTINCT step_index FROM flowq.steps "
                                        "WHERE status IN ('pending', 'running')")}


def spawn_ready(spawn_worker: Spawn, engine: sa.Engine, url: str, n: int, *args: str
                ) -> list[WorkerProcess]:
    """Start `n` workers and wait until each is up (listening), so that staggered runs are
    not all overdue at once when the workers claim their first steps."""
    return spawn_workers(spawn_worker, engine, APP, url, n, *args, *FAST)


def describe_rows(rows: Iterable[Row]) -> list[str]:
    return [f"job {r.id} run {r.run_id} {r.step}#{r.step_index} {r.status} attempts={r.attempts}"
            f" locked_by={r.locked_by} heartbeat_at={r.heartbeat_at} run_at={r.run_at} "
            f"error={(r.last_error or '').splitlines()[:1]}" for r in rows]


def wait_runs_done(engine: sa.Engine, run_ids: Sequence[int], timeout: float = 90.0) -> None:
    """Wait until every run in `run_ids` ended; AssertionError at once if a step ended other
    than succeeded, or with the unfinished steps at the deadline (a run stuck)."""
    def done() -> bool:
        rows = job_rows(engine, where="run_id = ANY(:ids)", ids=list(run_ids))
        ended = [r for r in rows if r.status in ("dead", "cancelled")]
        assert not ended, f"steps ended unsuccessfully: {describe_rows(ended)}"
        return (not any(r.status in ("pending", "running") for r in rows)
                and sum(r.step_index == 2 for r in rows) == len(run_ids))

    try:
        wait_until(done, timeout=timeout, interval=0.1, message="every run to end")
    except AssertionError as exc:
        if "timed out" not in str(exc):
            raise
        left = job_rows(engine, where="run_id = ANY(:ids) AND status IN ('pending', 'running')",
                        ids=list(run_ids))
        raise AssertionError(f"{exc}; unfinished steps: {describe_rows(left)}") from None


def assert_runs_exact(engine: sa.Engine, run_ids: Sequence[int]) -> list[Row]:
    """Every run succeeded with its three steps once each, each step's arguments are the
    previous step's result, and the ledger holds one row per step, written by the attempt
    whose result was passed on (the run's final `trail` names it); no other ledger rows.
    Returns the steps' job rows."""
    jobs = job_rows(engine, where="run_id = ANY(:ids)", ids=list(run_ids))
    entries: dict[int, list[Row]] = defaultdict(list)
    for e in query(engine, "SELECT * FROM pipeline_ledger ORDER BY id"):
        entries[e.job_id].append(e)
    by_run: dict[int, list[Row]] = defaultdict(list)
    for j in jobs:
        by_run[j.run_id].append(j)

    wrong: list[str] = []
    expected = [(i, name, "succeeded") for i, name in enumerate(pfa.STEPS)]
    for run_id in run_ids:
        steps = sorted(by_run[run_id], key=lambda j: (j.step_index, j.id))
        if [(j.step_index, j.step, j.status) for j in steps] != expected:
            wrong.append(f"run {run_id} has steps {describe_rows(steps)}")
            continue
        wrong += [f"run {run_id}: step {b.step} got {b.args}, but {a.step} returned {a.result}"
                  for a, b in pairwise(steps) if b.args != a.result]
        marks = []
        for j in steps:
            found = entries.get(j.id, [])
            if len(found) != 1:
                wrong.append(f"run {run_id}: step {j.step} (job {j.id}, attempts {j.attempts}) "
                             f"has {len(found)} ledger rows: {found}")
                continue
            (e,) = found
            if (e.run_id, e.step, e.attempt, e.payload["args"]) != (run_id, j.step, j.attempts,
                                                                     j.args):
                wrong.append(f"run {run_id}: ledger row {e} does not match job {j.id} (attempts "
                             f"{j.attempts}, args {j.args})")
            marks.append(f"{j.step}:{j.id}:{e.attempt}:{e.pid}")
        if steps[-1].result["trail"] != marks:
            wrong.append(f"run {run_id}: the result's trail {steps[-1].result['trail']} is not "
                         f"the committed attempts {marks}")
    ours = {j.id for j in jobs}
    strays = [e for job_id, found in entries.items() if job_id not in ours for e in found]
    assert not wrong, f"{len(wrong)} problem(s): " + "\n".join(wrong[:20])
    assert not strays, f"ledger rows of no step of these runs: {strays[:20]}"
    return jobs


def claims(engine: sa.Engine, ids: Iterable[int]) -> dict[int, tuple[Any, ...]]:
    """What a write by a worker that lost these claims could change, per job id."""
    return {r.id: (r.status, r.lease, r.attempts, r.locked_by, r.result, r.finished_at)
            for r in job_rows(engine, where="id = ANY(:ids)", ids=list(ids))}


# -- SIGKILL ----------------------------------------------------------------------------------

def test_sigkill_mid_pipeline_twice_then_replacements_finish_every_run(
        ledger: sa.Engine, db_url: str, spawn_worker: Spawn) -> None:
    """Two workers; twice, at a random point of progress, the one picked at random is killed
    while it holds steps at two step indexes at least and runs wait at all three; a
    replacement starts each time."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    workers = spawn_ready(spawn_worker, ledger, db_url, 2, "--concurrency", "4")
    run_ids = enqueue_relays(ledger, 60, stagger=0.05)
    total = 3 * len(run_ids)
    killed: dict[int, int] = {}  # job id -> pid of the worker killed holding it
    for lo, hi in ((0.15, 0.35), (0.4, 0.6)):  # runs wait at all three steps until ~70%
        progress = int(total * rng.uniform(lo, hi))
        victim = rng.choice(workers)

        def mid_pipeline(victim: WorkerProcess = victim, progress: int = progress) -> list[Row]:
            if steps_succeeded(ledger) < progress or steps_in_flight(ledger) != ALL_STEPS:
                return []
            held = held_by(ledger, victim.pid)
            return held if len({r.step_index for r in held}) >= 2 else []

        wait_until(mid_pipeline, timeout=60,
                   message=f"the victim mid-pipeline past {progress} steps (seed {seed})")
        victim.signal(signal.SIGKILL)
        victim.wait()
        killed.update((r.id, victim.pid) for r in held_when_killed(ledger, victim.pid))
        workers.remove(victim)
        workers.append(spawn_worker(APP, db_url, "--concurrency", "4", *FAST))

    wait_runs_done(ledger, run_ids)
    jobs = {j.id: j for j in assert_runs_exact(ledger, run_ids)}
    assert killed, f"no step was held by a killed worker (seed {seed})"
    for job_id, pid in killed.items():
        j = jobs[job_id]
        assert j.attempts >= 2 and j.last_error.startswith("WorkerLost:"), (seed, j)
        (e,) = query(ledger, "SELECT * FROM pipeline_ledger WHERE job_id = :j", j=job_id)
        assert e.pid != pid
    stop_workers(*workers)


# -- PostgreSQL restart -----------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_database_restart_mid_pipeline(flowq_postgres: LocalPostgres | None, ledger: sa.Engine,
                                       db_url: str, spawn_worker: Spawn, mode: str) -> None:
    """The server restarts while steps are inside their transactions at every step index.
    The embedded server runs with synchronous_commit off (`FAST_SETTINGS`), so an immediate
    shutdown may also lose the last commits the workers were told succeeded, as a failover
    to an asynchronous replica would: the runs must end exactly the same."""
    if flowq_postgres is None:
        pytest.skip("needs the embedded server to restart it")
    workers = spawn_ready(spawn_worker, ledger, db_url, 2, "--concurrency", "4")
    run_ids = enqueue_relays(ledger, 60, stagger=0.05)
    wait_until(lambda: steps_succeeded(ledger) >= 40 and steps_in_flight(ledger) == ALL_STEPS
               and len(backends(ledger, "session", state="idle in transaction")) >= 2,
               timeout=60, message="runs at every step, some steps inside their transaction")
    flowq_postgres.restart(mode)
    ledger.dispose()  # the test's own pooled connections died with the server
    run_ids += enqueue_relays(ledger, 20, start=60, stagger=0.05)

    wait_runs_done(ledger, run_ids, timeout=120)
    jobs = assert_runs_exact(ledger, run_ids)
    assert any(j.attempts > 1 for j in jobs)  # the restart did interrupt steps
    assert all(w.proc.poll() is None for w in workers)
    stop_workers(*workers)


# -- terminated connections -------------------------------------------------------------------

def test_terminated_connections_of_each_role_mid_pipeline(ledger: sa.Engine, db_url: str,
                                                          spawn_worker: Spawn) -> None:
    """A round of runs per role: while steps are inside their transactions, every connection
    of that role (of both workers) is terminated; then one round with every connection at
    once. 'session' goes first: the steps it fails are retried through the completer, whose
    connection ('complete') is opened by the first failure (steps complete on their session)."""
    workers = spawn_ready(spawn_worker, ledger, db_url, 2, "--concurrency", "3")
    run_ids: list[int] = []
    for roles in [*((role,) for role in ROLES), ROLES]:
        batch = enqueue_relays(ledger, 12, start=len(run_ids), stagger=0.08)
        run_ids += batch

        def ready(roles: tuple[str, ...] = roles) -> list[int]:
            if (steps_in_flight(ledger) != ALL_STEPS
                    or len(backends(ledger, "session", state="idle in transaction")) < 2):
                return []
            found = {role: backends(ledger, role) for role in roles}
            # One role: wait for its connections. All: whichever are open (after the
            # 'complete' round, that connection is reopened only by the next failure).
            return ([p for pids in found.values() for p in pids]
                    if all(found.values()) or len(roles) > 1 else [])

        victims = wait_until(ready, timeout=30,
                             message=f"steps in their transactions and {roles} connections")
        listening = set(backends(ledger, "listen"))
        terminate(ledger, victims)
        if "listen" in roles:
            wait_until(lambda: set(backends(ledger, "listen")) - listening,  # noqa: B023
                       timeout=30, message="the listeners reconnecting")

        wait_runs_done(ledger, batch, timeout=60)
        jobs = assert_runs_exact(ledger, run_ids)
        if "session" in roles:  # steps whose transaction was cut were run again
            assert any(j.attempts > 1 for j in jobs if j.run_id in batch), roles
        dead = [w.pid for w in workers if w.proc.poll() is not None]
        assert not dead, f"worker(s) {dead} died after their {roles} connections were cut"
    stop_workers(*workers)


# -- a zombie worker --------------------------------------------------------------------------

@pytest.mark.parametrize("wake", ["after the rescue", "during the rescue"])
def test_zombie_past_stale_after_changes_nothing_when_it_wakes(
        ledger: sa.Engine, db_url: str, spawn_worker: Spawn, wake: str) -> None:
    """Worker A is frozen (SIGSTOP) holding four steps: the first, second and third step of
    three runs, each inside its open transaction with its ledger row written, and a second
    step not yet at its ledger write. Worker B reaps them and runs them again. A resumes
    (SIGCONT) either after B finished every run, when its late completions find the steps
    `succeeded`, or while B runs those very steps (B frozen meanwhile), when they find them
    `running` under B's lease: only the lease tells them apart. Either way A's completions
    must be dropped: no ledger row, no result, no second successor. Neither worker does
    maintenance: the test reaps (`Reaper.run_once`), so a frozen B is never reaped."""
    hold = 2.0  # in-transaction from hold/2 to hold; the 2 * hold step writes after that
    sleeps = [[hold, 0, 0], [0, hold, 0], [0, 0, hold], [0, 2 * hold, 0]]
    with ledger.begin() as conn:
        run_ids = [flowq.enqueue(conn, pfa.relay, n=i, sleeps=s, trail=[]).id
                   for i, s in enumerate(sleeps)]
    quiet = ("--concurrency", "4", "--no-maintenance", *FAST)
    zombie = spawn_worker(APP, db_url, *quiet)

    def open_transactions(worker: WorkerProcess) -> list[int]:
        return backends(ledger, "session", pid=worker.pid, state="idle in transaction")

    def caught() -> list[Row]:
        held = held_by(ledger, zombie.pid)
        ok = (sorted(r.step_index for r in held) == [0, 1, 1, 2]
              and len(open_transactions(zombie)) == 3)
        return held if ok else []

    held = {r.id for r in wait_until(caught, timeout=30,
                                     message="A holding four steps, three in a transaction")}
    zombie.signal(signal.SIGSTOP)
    rescuer = spawn_worker(APP, db_url, *quiet)
    try:
        reaper = Reaper(ledger, DEFAULT_SCHEMA, stale_after=1.0)
        reaped = 0

        def reaped_all() -> bool:
            nonlocal reaped
            reaped += reaper.run_once()
            return reaped == len(held)

        wait_until(reaped_all, timeout=30, interval=0.2, message="A's steps reaped")
        if wake == "after the rescue":
            wait_runs_done(ledger, run_ids, timeout=60)
            assert len(open_transactions(zombie)) == 3  # A's ledger rows, not committed
            before = assert_runs_exact(ledger, run_ids)
        else:
            wait_until(lambda: {r.id for r in held_by(ledger, rescuer.pid)} >= held, timeout=60,
                       message="B running every step A held")
            rescuer.signal(signal.SIGSTOP)
            rescuing = claims(ledger, held)
    finally:
        zombie.signal(signal.SIGCONT)
    try:
        wait_until(lambda: zombie.log().count("completion dropped") == len(held), timeout=30,
                   message="A logging each of its completions dropped")
        wait_until(lambda: not open_transactions(zombie), timeout=30,
                   message="A's transactions rolled back")
        if wake == "during the rescue":
            # A's writes came while B held the very same steps: B's claims stand untouched.
            assert claims(ledger, held) == rescuing
            assert query(ledger, "SELECT * FROM pipeline_ledger WHERE job_id = ANY(:ids)",
                         ids=list(held)) == []
    finally:
        rescuer.signal(signal.SIGCONT)

    wait_runs_done(ledger, run_ids, timeout=60)
    after = assert_runs_exact(ledger, run_ids)
    if wake == "after the rescue":
        assert after == before
    for j in after:
        if j.id in held:
            assert j.attempts == 2 and j.last_error.startswith("WorkerLost:"), j
            (e,) = query(ledger, "SELECT * FROM pipeline_ledger WHERE job_id = :j", j=j.id)
            assert e.pid == rescuer.pid and e.attempt == 2
    assert zombie.proc.poll() is None  # A carries on
    stop_workers(zombie, rescuer)
