"""Acceptance tests of the worker with real `flowq worker` processes and real crashes.

Every test checks a ledger: each `record` job appends one row through `ctx.session`, which
commits with the job's success, so after any crash, kill, restart or zombie the ledger must
hold exactly one row per job (nothing lost, nothing done twice). Time is never asserted;
tests wait on conditions with deadlines, and use short heartbeat/reap/poll intervals to stay
fast.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import faulty_app
import ledger_app
import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from support import APPS_DIR, Spawn, backends, held_by, terminate

import flowq
from flowq.cli import main
from flowq.local.postgres import LocalPostgres
from flowq.testing import job_rows, wait_until
from flowq.worker import WorkerConfig

# Short maintenance intervals: a dead worker's jobs are reaped about a second after it dies.
FAST = ["--heartbeat-interval", "0.2", "--stale-after", "1.0", "--reap-interval", "0.3",
        "--poll-interval", "0.2"]


# -- helpers ----------------------------------------------------------------------------------

def enqueue_records(engine: sa.Engine, n: int, *, sleep: float = 0.0, start: int = 0,
                    task: flowq.Pipeline = ledger_app.record) -> list[int]:
    with engine.begin() as conn:
        return flowq.enqueue_many(conn, task, [{"n": start + i, "sleep": sleep}
                                               for i in range(n)])


def status_counts(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return dict(conn.execute(sa.text(  # type: ignore[arg-type]
            "SELECT status, count(*) FROM flowq.steps GROUP BY status")).all())


def all_succeeded(engine: sa.Engine, n: int) -> Callable[[], bool]:
    return lambda: status_counts(engine) == {"succeeded": n}


def assert_ledger_exact(engine: sa.Engine, task: str = "record") -> int:
    """Every succeeded `task` job has exactly one ledger row, and no other job has any."""
    with engine.connect() as conn:
        per_job = conn.execute(sa.text("""
            SELECT j.id, j.status, count(l.job_id) AS n
              FROM flowq.steps j LEFT JOIN ledger l ON l.job_id = j.id
             WHERE j.task = :task GROUP BY j.id, j.status"""), {"task": task}).all()
        orphans = conn.execute(sa.text(
            "SELECT count(*) FROM ledger l WHERE NOT EXISTS "
            "(SELECT 1 FROM flowq.steps j WHERE j.id = l.job_id)")).scalar()
    wrong = [(r.id, r.status, r.n) for r in per_job if r.n != (r.status == "succeeded")]
    assert not wrong, f"ledger rows per job are not one per succeeded job: {wrong[:20]}"
    assert orphans == 0
    return sum(r.n for r in per_job)


def ledger_rows(engine: sa.Engine, job_id: int) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT * FROM ledger WHERE job_id = :j"),
                                 {"j": job_id}))


def held_ids(engine: sa.Engine, pid: int) -> list[int]:
    """Ids of the running jobs claimed by the worker process `pid`."""
    return [r.id for r in held_by(engine, pid)]


def holding(engine: sa.Engine, pid: int, n: int) -> Callable[[], list[int]]:
    """A condition: the ids of the running jobs of worker `pid`, once there are `n` of them."""
    return lambda: ids if len(ids := held_ids(engine, pid)) == n else []


def children_of(pid: int) -> list[int]:
    """Live child processes of `pid` (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


@pytest.fixture
def reap_children() -> Iterator[list[int]]:
    """Pids appended here are SIGKILLed at teardown (children of a killed supervisor)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def one_sentence(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    assert "Traceback" not in output, output
    assert len(lines) == 1, output
    return lines[0]


# -- throughput and crashes ---------------------------------------------------------------------

@pytest.mark.slow
def test_ten_thousand_jobs_over_four_processes(ledger: sa.Engine, db_url: str,
                                               spawn_worker: Spawn,
                                               reap_children: list[int]) -> None:
    n = 10_000
    enqueue_records(ledger, n)
    sup = spawn_worker("ledger_app:app", db_url, "--processes", "4", "--concurrency", "8",
                       "--no-job-log", "--heartbeat-interval", "1", "--stale-after", "10",
                       "--poll-interval", "0.5")
    children = wait_until(lambda: c if len(c := children_of(sup.pid)) == 4 else [],
                          timeout=30, message="four worker processes")
    reap_children.extend(children)

    wait_until(all_succeeded(ledger, n), timeout=240, interval=0.5,
               message="all 10,000 jobs succeeded")
    assert assert_ledger_exact(ledger) == n
    with ledger.connect() as conn:
        pids = set(conn.execute(sa.text("SELECT DISTINCT pid FROM ledger")).scalars())
    assert pids <= set(children) and len(pids) > 1
    assert "lost the claim" not in sup.log()  # no job was taken from a live worker

    sup.signal(signal.SIGTERM)
    assert sup.wait(timeout=60) == 0
    assert children_of(sup.pid) == []
    assert status_counts(ledger) == {"succeeded": n}


def test_ctrl_c_drains_the_children_of_the_supervisor(ledger: sa.Engine, db_url: str,
                                                      tmp_path: Path,
                                                      reap_children: list[int]) -> None:
    """A terminal's Ctrl-C signals the whole foreground process group: each child must still
    see one signal (and drain), not two (and exit at once)."""
    enqueue_records(ledger, 4, sleep=2.0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(APPS_DIR), os.environ.get("PYTHONPATH", "")])}
    log = tmp_path / "supervisor.log"
    with open(log, "wb") as out:
        sup = subprocess.Popen(
            [sys.executable, "-m", "flowq", "worker", "ledger_app:app", "--database-url", db_url,
             "--processes", "2", "--concurrency", "2", *FAST],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_until(lambda: status_counts(ledger).get("running") == 4, timeout=60,
                   message="both children running jobs")
        reap_children.extend(children_of(sup.pid))
        os.killpg(sup.pid, signal.SIGINT)
        assert sup.wait(timeout=60) == 0, log.read_text()
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
            sup.wait()
    assert "second signal" not in log.read_text()
    assert status_counts(ledger) == {"succeeded": 4}
    assert assert_ledger_exact(ledger) == 4


def test_children_of_a_killed_supervisor_drain_and_exit(ledger: sa.Engine, db_url: str,
                                                       spawn_worker: Spawn,
                                                       reap_children: list[int]) -> None:
    """Children live in their own process groups, so a SIGKILLed supervisor cannot take them
    down with it: they notice it is gone, finish their jobs and exit instead of running on."""
    enqueue_records(ledger, 4, sleep=1.0)
    sup = spawn_worker("ledger_app:app", db_url, "--processes", "2", "--concurrency", "2",
                       *FAST)
    wait_until(lambda: status_counts(ledger).get("running") == 4, timeout=60,
               message="both children running jobs")
    children = children_of(sup.pid)
    reap_children.extend(children)
    sup.signal(signal.SIGKILL)
    sup.wait()

    def alive(pid: int) -> bool:
        try:
            return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
        except OSError:
            return False

    def gone() -> bool:
        return not any(alive(pid) for pid in children)

    wait_until(gone, timeout=60, message="the orphaned children to exit")
    assert status_counts(ledger) == {"succeeded": 4}
    assert assert_ledger_exact(ledger) == 4


def test_sigkill_with_running_jobs_then_another_worker_finishes_them(
        ledger: sa.Engine, db_url: str, spawn_worker: Spawn) -> None:
    ids = enqueue_records(ledger, 12, sleep=1.0)
    victim = spawn_worker("ledger_app:app", db_url, "--concurrency", "4", *FAST)
    killed = wait_until(holding(ledger, victim.pid, 4), timeout=30,
                        message="the victim holding four running jobs")
    victim.signal(signal.SIGKILL)
    victim.wait()
    rescuer = spawn_worker("ledger_app:app", db_url, "--concurrency", "4", *FAST)

    wait_until(all_succeeded(ledger, len(ids)), timeout=60, message="every job succeeded")
    assert assert_ledger_exact(ledger) == len(ids)
    for row in job_rows(ledger, where="id = ANY(:ids)", ids=killed):
        assert row.attempts >= 2
        assert "WorkerLost" in row.last_error and "stopped heartbeating" in row.last_error
        (entry,) = ledger_rows(ledger, row.id)
        assert entry.pid == rescuer.pid and entry.attempt == row.attempts
    rescuer.signal(signal.SIGTERM)
    assert rescuer.wait() == 0


def test_a_job_that_kills_every_worker_ends_dead(ledger: sa.Engine, db_url: str,
                                                 spawn_worker: Spawn,
                                                 reap_children: list[int]) -> None:
    """Crashes count as attempts: the poison job goes dead, the supervisor restarts the
    children it killed, and the other jobs are done exactly once."""
    with ledger.begin() as conn:
        poison = flowq.enqueue(conn, faulty_app.kill_worker)
    enqueue_records(ledger, 20, sleep=0.05, task=faulty_app.record)
    sup = spawn_worker("faulty_app:app", db_url, "--processes", "2", "--concurrency", "2",
                       *FAST)
    try:
        wait_until(lambda: status_counts(ledger) == {"succeeded": 20, "dead": 1}, timeout=90,
                   message="the poison job dead and the rest done")
        reap_children.extend(children_of(sup.pid))
        (row,) = job_rows(ledger, where="run_id = :r", r=poison.id)
        assert row.attempts == 2 and "WorkerLost" in row.last_error
        assert assert_ledger_exact(ledger) == 20
        assert sup.log().count("worker process exited; restarting") == 2
        sup.signal(signal.SIGTERM)
        assert sup.wait(timeout=60) == 0
    finally:
        reap_children.extend(children_of(sup.pid))


def test_default_bound_for_the_jobs_of_a_dead_worker() -> None:
    """The SIGKILL test runs with short intervals; with the defaults, the same sequence (last
    heartbeat, stale, next reap pass, NOTIFY or poll) ends well within the promised 60 s."""
    c = WorkerConfig()
    assert c.heartbeat_interval + c.stale_after + c.reap_interval + c.poll_interval < 60


def flowq_reap(url: str) -> str:
    """`flowq reap --stale-after 1`, in-process; what it printed."""
    done = CliRunner().invoke(main, ["reap", "--database-url", url, "--stale-after", "1"])
    assert done.exit_code == 0, (done.output, done.exception)
    return done.stdout


@pytest.mark.parametrize("reaper", ["worker", "flowq reap"])
def test_zombie_worker_writes_nothing_after_its_job_was_reaped(
        ledger: sa.Engine, db_url: str, spawn_worker: Spawn, reaper: str) -> None:
    (run_id,) = enqueue_records(ledger, 1, sleep=2.0)
    zombie = spawn_worker("ledger_app:app", db_url, "--concurrency", "1", *FAST)
    (job_id,) = wait_until(lambda: held_ids(ledger, zombie.pid), timeout=30,
                           message="worker A running the job")
    zombie.signal(signal.SIGSTOP)  # its heartbeat stops; its handler is frozen mid-sleep
    try:
        if reaper == "worker":
            rescuer = spawn_worker("ledger_app:app", db_url, "--concurrency", "1", *FAST)
        else:
            rescuer = spawn_worker("ledger_app:app", db_url, "--concurrency", "1",
                                   "--no-maintenance", *FAST)
            wait_until(lambda: "reaped 1 job(s)." in flowq_reap(db_url), timeout=30,
                       interval=0.2, message="`flowq reap` requeueing the job")
        wait_until(all_succeeded(ledger, 1), timeout=60, message="worker B completing the job")
    finally:
        zombie.signal(signal.SIGCONT)
    # A wakes up with its handler done and a claim it no longer holds.
    wait_until(lambda: "completion dropped" in zombie.log(), timeout=30,
               message="worker A logging its dropped completion")

    (row,) = job_rows(ledger)
    assert row.status == "succeeded" and row.attempts == 2
    assert "WorkerLost" in row.last_error
    (entry,) = ledger_rows(ledger, job_id)
    assert entry.pid == rescuer.pid and entry.attempt == 2 and entry.run_id == run_id
    assert zombie.proc.poll() is None  # A carries on
    for w in (zombie, rescuer):
        w.signal(signal.SIGTERM)
        assert w.wait() == 0
    assert len(ledger_rows(ledger, job_id)) == 1


def test_retries_follow_the_tenacity_policy_then_dead(engine: sa.Engine, db_url: str,
                                                      spawn_worker: Spawn) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(faulty_app.ATTEMPT_LOG_DDL))
        run = flowq.enqueue(conn, faulty_app.always_fail, n=7)
    w = spawn_worker("faulty_app:app", db_url, "--concurrency", "2", *FAST)
    wait_until(lambda: status_counts(engine) == {"dead": 1}, timeout=60, message="job dead")

    (row,) = job_rows(engine)
    assert row.run_id == run.id and row.attempts == faulty_app.RETRY_ATTEMPTS
    assert row.last_error.startswith("ValueError: always fails (n=7)")
    assert "Traceback" in row.last_error
    with engine.connect() as conn:
        starts = conn.execute(sa.text(
            "SELECT attempt, started_at FROM attempt_log ORDER BY attempt")).all()
    assert [a for a, _ in starts] == list(range(1, faulty_app.RETRY_ATTEMPTS + 1))
    gaps = [(b - a).total_seconds() for (_, a), (_, b) in itertools.pairwise(starts)]
    assert all(g >= faulty_app.RETRY_WAIT for g in gaps), gaps
    assert "job dead" in w.log()
    w.signal(signal.SIGTERM)
    assert w.wait() == 0


# -- shutdown -----------------------------------------------------------------------------------

def test_sigterm_lets_running_handlers_finish(ledger: sa.Engine, db_url: str,
                                              spawn_worker: Spawn) -> None:
    enqueue_records(ledger, 8, sleep=1.0)
    w = spawn_worker("ledger_app:app", db_url, "--concurrency", "4", *FAST)
    in_flight = wait_until(holding(ledger, w.pid, 4), timeout=30, message="four running jobs")
    w.signal(signal.SIGTERM)
    assert w.wait() == 0

    rows = {r.id: r for r in job_rows(ledger)}
    assert all(rows[i].status == "succeeded" for i in in_flight)
    assert {r.status for r in rows.values()} <= {"succeeded", "pending"}
    assert all(r.attempts == 0 for r in rows.values() if r.status == "pending")
    assert assert_ledger_exact(ledger) == sum(r.status == "succeeded" for r in rows.values())


def test_sigterm_releases_handlers_past_the_grace_period(ledger: sa.Engine, db_url: str,
                                                         spawn_worker: Spawn) -> None:
    enqueue_records(ledger, 3, sleep=10.0)
    w = spawn_worker("ledger_app:app", db_url, "--concurrency", "3", "--shutdown-grace", "0.5",
                     *FAST)
    wait_until(holding(ledger, w.pid, 3), timeout=30, message="running jobs")
    w.signal(signal.SIGTERM)
    assert w.wait(timeout=30) == 0

    rows = job_rows(ledger)
    assert [(r.status, r.attempts, r.locked_by) for r in rows] == [("pending", 0, None)] * 3
    assert assert_ledger_exact(ledger) == 0
    assert "released unfinished jobs" in w.log()


def test_second_sigterm_exits_at_once(ledger: sa.Engine, db_url: str,
                                      spawn_worker: Spawn) -> None:
    enqueue_records(ledger, 2, sleep=60.0)
    w = spawn_worker("ledger_app:app", db_url, "--concurrency", "2", "--shutdown-grace", "120",
                     *FAST)
    wait_until(holding(ledger, w.pid, 2), timeout=30, message="running jobs")
    w.signal(signal.SIGTERM)
    wait_until(lambda: "shutting down" in w.log(), timeout=10, message="the first signal")
    w.signal(signal.SIGTERM)
    assert w.wait(timeout=20) != 0  # long before the handlers or the grace period end
    assert "second signal" in w.log()
    # What was running is left to the reaper.
    assert {r.status for r in job_rows(ledger)} == {"running"}


# -- bad input and faults ---------------------------------------------------------------------

def test_unknown_task_is_retried_later_and_the_worker_keeps_running(
        ledger: sa.Engine, db_url: str, spawn_worker: Spawn) -> None:
    with ledger.begin() as conn:  # as a newer producer would: by name, into a served queue
        stranger = flowq.enqueue(conn, "no_such_task", queue="default", x=1)
    w = spawn_worker("ledger_app:app", db_url, "--concurrency", "2", *FAST)

    def tried_twice() -> Any:
        (row,) = job_rows(ledger, where="run_id = :r", r=stranger.id)
        return row.attempts >= 2 and row.status in ("pending", "running") and row
    row = wait_until(tried_twice, timeout=30, message="the unknown task retried")
    assert row.last_error.startswith("UnknownTaskError:") and "'no_such_task'" in row.last_error
    assert "job failed; retrying" in w.log()

    enqueue_records(ledger, 5)
    wait_until(lambda: status_counts(ledger).get("succeeded") == 5, timeout=30,
               message="known jobs still completing")
    assert assert_ledger_exact(ledger) == 5
    assert w.proc.poll() is None
    w.signal(signal.SIGTERM)
    assert w.wait() == 0


def test_non_json_results_fail_the_step_for_good(engine: sa.Engine, db_url: str,
                                                spawn_worker: Spawn) -> None:
    """Running the handler again would repeat its side effects and return the same value, so
    a result that cannot be stored ends the step `dead` after one attempt."""
    with engine.begin() as conn:
        as_set = flowq.enqueue(conn, faulty_app.returns_set)
        with_nul = flowq.enqueue(conn, faulty_app.returns_nul)
    w = spawn_worker("faulty_app:app", db_url, "--concurrency", "2", *FAST)
    wait_until(lambda: status_counts(engine) == {"dead": 2}, timeout=30, message="both dead")

    rows = {r.run_id: r for r in job_rows(engine)}
    for run_id, reason in ((as_set.id, "is a builtins.set, which is not JSON"),
                           (with_nul.id, "contains a NUL character")):
        row = rows[run_id]
        assert row.attempts == 1 and row.result is None and row.locked_by is None
        assert row.last_error.startswith("InvalidResultError:") and reason in row.last_error
    assert w.proc.poll() is None
    w.signal(signal.SIGTERM)
    assert w.wait() == 0


def test_worker_against_a_database_without_the_schema(empty_db_url: str,
                                                      spawn_worker: Spawn) -> None:
    w = spawn_worker("ledger_app:app", empty_db_url)
    assert w.wait(timeout=60) != 0
    assert "run `flowq migrate`" in one_sentence(w.log())


@pytest.mark.parametrize("spec", ["ledger_app:app", "no_such_module_xyz:app"])
def test_supervisor_refuses_to_start_on_bad_input(empty_db_url: str, spawn_worker: Spawn,
                                                  reap_children: list[int], spec: str) -> None:
    """With --processes, a fault every child would hit is reported once, not restarted forever."""
    w = spawn_worker(spec, empty_db_url, "--processes", "2")
    try:
        code = w.wait(timeout=60)
    finally:
        reap_children.extend(children_of(w.pid))
    assert code != 0
    says = "run `flowq migrate`" if spec == "ledger_app:app" else "no such module"
    assert says in one_sentence(w.log())


def test_worker_against_a_url_where_nothing_listens(spawn_worker: Spawn) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    w = spawn_worker("ledger_app:app", f"postgresql://postgres:secret@127.0.0.1:{port}/flowq",
                     "--start-timeout", "0")  # tried once (tests/unit/test_worker_start.py)
    assert w.wait(timeout=60) != 0
    sentence = one_sentence(w.log())
    assert "cannot connect" in sentence or "cannot reach" in sentence
    assert "secret" not in sentence


@pytest.mark.parametrize("spec, says", [
    ("no_such_module_xyz:app", "no such module"),
    ("ledger_app:no_such_app", "is not a flowq.FlowQ app"),
    ("ledger_app:LEDGER_DDL", "is not a flowq.FlowQ app"),
    (":app", "expected MODULE:APP"),
    ("..relative:app", "a dotted module name, not a path"),
    ("tests/apps/ledger_app.py:app", "a dotted module name, not a path"),
])
def test_worker_with_a_bad_app_spec(db_url: str, spawn_worker: Spawn, spec: str,
                                    says: str) -> None:
    w = spawn_worker(spec, db_url)
    assert w.wait(timeout=60) != 0
    assert says in one_sentence(w.log())


@pytest.mark.slow
def test_database_restart_mid_run(flowq_postgres: LocalPostgres | None, ledger: sa.Engine, db_url: str,
                                  spawn_worker: Spawn) -> None:
    if flowq_postgres is None:
        pytest.skip("needs the embedded server to restart it")
    enqueue_records(ledger, 200, sleep=0.02)
    w = spawn_worker("ledger_app:app", db_url, "--concurrency", "4", *FAST)
    wait_until(lambda: status_counts(ledger).get("succeeded", 0) >= 20, timeout=30,
               message="the run under way")
    flowq_postgres.restart()
    ledger.dispose()  # the test's own pooled connections died with the server
    enqueue_records(ledger, 100, start=200)

    wait_until(all_succeeded(ledger, 300), timeout=120, interval=0.2,
               message="every job succeeded after the restart")
    assert assert_ledger_exact(ledger) == 300
    assert w.proc.poll() is None
    w.signal(signal.SIGTERM)
    assert w.wait() == 0


@pytest.mark.slow
def test_terminated_connections_one_role_at_a_time(ledger: sa.Engine, db_url: str,
                                                   spawn_worker: Spawn) -> None:
    w = spawn_worker("faulty_app:app", db_url, "--concurrency", "4", *FAST)
    total = 0

    def round_of_jobs() -> None:
        nonlocal total
        enqueue_records(ledger, 10, start=total, task=faulty_app.record)
        with ledger.begin() as conn:
            flowq.enqueue_many(conn, faulty_app.noop, [{"n": total + i} for i in range(10)])
        total += 10
        wait_until(all_succeeded(ledger, 2 * total), timeout=60,
                   message=f"round of jobs completing ({total} records so far)")
        assert assert_ledger_exact(ledger) == total

    round_of_jobs()
    for role in ("claim", "complete", "maintain", "session", "listen"):
        victims = wait_until(lambda r=role: backends(ledger, r), timeout=30,  # type: ignore[misc]
                             message=f"a {role} connection")
        terminate(ledger, victims)
        if role == "listen":
            old = set(victims)
            wait_until(lambda: set(backends(ledger, "listen")) - old, timeout=30,  # noqa: B023
                       message="the listener reconnecting")
        round_of_jobs()
        assert w.proc.poll() is None, f"worker died after its {role} connection was killed"
    w.signal(signal.SIGTERM)
    assert w.wait() == 0


# -- wake-up ----------------------------------------------------------------------------------

def test_notify_wakes_an_idle_worker_long_before_its_poll(ledger: sa.Engine, db_url: str,
                                                          spawn_worker: Spawn) -> None:
    poll = 30.0
    w = spawn_worker("ledger_app:app", db_url, "--poll-interval", str(poll))

    def listening() -> list[int]:
        # Idle: the first poll has run (claim connection used) and LISTEN is in place.
        with ledger.connect() as conn:
            return backends(ledger, "claim") and list(conn.execute(sa.text(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND application_name LIKE 'flowq listen %' AND query LIKE 'LISTEN%'"
            )).scalars())

    listener = wait_until(listening, timeout=30, message="the worker idle and listening")
    enqueue_records(ledger, 1)
    wait_until(all_succeeded(ledger, 1), timeout=poll / 3, message="woken by NOTIFY")

    # A dropped LISTEN connection is re-established, and wakes the worker again.
    with ledger.connect() as conn:
        conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": listener[0]})
    wait_until(lambda: (pids := listening()) and pids != listener, timeout=30,
               message="the listener back")
    enqueue_records(ledger, 1, start=1)
    wait_until(all_succeeded(ledger, 2), timeout=poll / 3, message="woken by NOTIFY again")
    assert assert_ledger_exact(ledger) == 2
    w.signal(signal.SIGTERM)
    assert w.wait() == 0


def test_poll_only_worker_still_completes_jobs(ledger: sa.Engine, db_url: str,
                                               spawn_worker: Spawn) -> None:
    w = spawn_worker("ledger_app:app", db_url, "--no-listen", "--poll-interval", "0.5")
    wait_until(lambda: backends(ledger, "claim"), timeout=30, message="the worker polling")
    enqueue_records(ledger, 5)
    wait_until(all_succeeded(ledger, 5), timeout=30, message="jobs completed by polling")
    assert backends(ledger, "listen") == []
    assert assert_ledger_exact(ledger) == 5
    w.signal(signal.SIGTERM)
    assert w.wait() == 0
