"""Acceptance: a release rolls out under running workers (issue 20).

Workers of the previous release (the code at 8e9b26f, schema head 0006, kept in
tests/releases/flowq-0006.tar.gz) drain a ledger while this release's `flowq migrate` applies
its revisions beside them, held up for a while by a long transaction on flowq.jobs (its lock
waits are bounded, it rolls back and tries again); then workers of this release start beside
the old ones, more work is enqueued with the new code, the old workers are stopped midway (one
SIGTERM, one SIGKILL) and the new ones drain. Checked against the ledger: every job ran, its
`ctx.session` row written exactly once, nothing lost, every row final, no traceback from
either release. The numbers (jobs, doubles, lost, the longest gap between claims while
migrating, the migration's time) are printed (`pytest -s`).

Both releases run the same app (written into the test's directory: it uses only API the two
share) from a directory of their own, in this venv: the old one with its extracted tree first
on PYTHONPATH, never the repository's (a `python -m` run from the repository root would put
the new flowq first).
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import pytest
import sqlalchemy as sa
from support import (
    WorkerProcess,
    assert_no_crash_lines,
    backends,
    end_workers,
    held_by,
    rows,
    scalar,
    stop_workers,
)

from flowq.db.migrations import HEAD_REVISION
from flowq.testing import wait_until

RELEASE: Final = Path(__file__).resolve().parents[1] / "releases" / "flowq-0006.tar.gz"
PREVIOUS_HEAD: Final = "0006"
# Fast failure detection, so that the SIGKILLed worker's jobs come back within the test.
FAST: Final = ("--concurrency", "4", "--heartbeat-interval", "0.5", "--stale-after", "3",
               "--reap-interval", "0.5", "--poll-interval", "0.5")
OLD_RECORDS, OLD_FLOWS = 300, 40  # enqueued by the old release on schema 0006
NEW_RECORDS, NEW_FLOWS = 300, 30  # enqueued by this release beside the old workers
STEPS: Final = ("first", "second", "third")
LEDGER_DDL: Final = ("CREATE TABLE rolling_ledger (job_id bigint NOT NULL, run_id bigint NOT "
                     "NULL, step text NOT NULL, attempt int NOT NULL, release text NOT NULL, "
                     "at timestamptz NOT NULL DEFAULT clock_timestamp())")

APP: Final = '''
"""The rolling-release app: one ledger row per job through ctx.session (both releases)."""
import os
import time

import sqlalchemy as sa

import flowq

app = flowq.FlowQ()


def _write(ctx, step):
    ctx.session.execute(sa.text(
        "INSERT INTO rolling_ledger (job_id, run_id, step, attempt, release) "
        "VALUES (:j, :r, :s, :a, :rel)"),
        {"j": ctx.job_id, "r": ctx.run_id, "s": step, "a": ctx.attempt,
         "rel": os.environ.get("ROLLING_RELEASE", "?")})


@app.task()
def record(ctx, n: int, sleep: float = 0.0) -> None:
    if sleep:
        time.sleep(sleep)
    _write(ctx, "record")


flow = app.pipeline("flow")


@flow.step()
def first(ctx, n: int) -> dict:
    _write(ctx, "first")
    return {"n": n}


@flow.step()
def second(ctx, n: int) -> dict:
    time.sleep(0.02)
    _write(ctx, "second")
    return {"n": n}


@flow.step()
def third(ctx, n: int) -> None:
    _write(ctx, "third")
'''

ENQUEUE: Final = '''
import sys
import sqlalchemy as sa
import flowq
import rolling_app
engine = sa.create_engine(sys.argv[1])
with engine.begin() as conn:
    for n in range(int(sys.argv[2])):
        flowq.enqueue(conn, rolling_app.record, n=n, sleep=float(sys.argv[4]))
    for n in range(int(sys.argv[3])):
        flowq.enqueue(conn, rolling_app.flow, n=n)
print(flowq.__file__)
'''


class Release:
    """One release's flowq, run from `cwd` with `pythonpath` first (empty: the installed one)."""

    def __init__(self, name: str, pythonpath: list[Path], cwd: Path) -> None:
        self.name = name
        self.pythonpath = pythonpath
        self.cwd = cwd

    def env(self) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        return {**keep, "ROLLING_RELEASE": self.name,
                "PYTHONPATH": os.pathsep.join(str(p) for p in self.pythonpath)}

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, *args], cwd=self.cwd, env=self.env(),
                              capture_output=True, text=True, timeout=timeout)

    def popen(self, args: list[str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "wb") as out:
            return subprocess.Popen([sys.executable, *args], cwd=self.cwd, env=self.env(),
                                    stdout=out, stderr=subprocess.STDOUT)


@pytest.fixture
def releases(tmp_path: Path) -> tuple[Release, Release]:
    """(the previous release, this one), each with the app beside it."""
    old_tree = tmp_path / "flowq-0006"
    with tarfile.open(RELEASE) as tar:
        tar.extractall(old_tree, filter="data")
    apps = tmp_path / "apps"
    apps.mkdir()
    (apps / "rolling_app.py").write_text(textwrap.dedent(APP))
    run_dir = tmp_path / "run"  # neither tree: `python -m` puts the cwd first on sys.path
    run_dir.mkdir()
    return (Release("old", [old_tree, apps], run_dir), Release("new", [apps], run_dir))


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start `flowq worker rolling_app:app` of a release; killed at teardown if still running,
    logs printed for a failed test."""
    procs: list[WorkerProcess] = []

    def spawn(release: Release, url: str, *args: str) -> WorkerProcess:
        log = tmp_path / f"worker-{release.name}-{len(procs)}.log"
        proc = release.popen(["-m", "flowq", "worker", "rolling_app:app", "--database-url", url,
                              *FAST, *args], log)
        procs.append(WorkerProcess(proc, log))
        return procs[-1]

    yield spawn
    end_workers(procs, tail=4000)


def _listening(engine: sa.Engine, *workers: WorkerProcess) -> None:
    for w in workers:
        wait_until(lambda w=w: backends(engine, "listen", pid=w.pid) or w.proc.poll() is not None,
                   timeout=60, message=f"worker {w.pid} listening")
        assert w.proc.poll() is None, w.log()[-3000:]


def _db_now(engine: sa.Engine) -> Any:
    return scalar(engine, "SELECT clock_timestamp()")


def _longest_gap(engine: sa.Engine, since: Any, until: Any, backlog_runs: int) -> float:
    """The longest time between two ledger writes (or one and the window's ends) while the
    migration ran and the old release's backlog (runs up to `backlog_runs`) lasted: claims
    stalled behind its DDL show up as a gap, an empty queue must not. (A claim's own time is
    not kept: a finished job's locked_at is cleared.)"""
    last = scalar(engine, "SELECT max(at) FROM rolling_ledger WHERE run_id <= :r",
                  r=backlog_runs)
    until = min(until, last)
    writes = [r[0] for r in rows(engine, "SELECT at FROM rolling_ledger WHERE at BETWEEN :a "
                                 "AND :b ORDER BY at", a=since, b=until)]
    points = [since, *writes, until]
    return max((b - a).total_seconds() for a, b in itertools.pairwise(points))


def test_a_release_rolls_out_under_running_workers(
        empty_db_url: str, releases: tuple[Release, Release],
        start: Callable[..., WorkerProcess], tmp_path: Path) -> None:
    old, new = releases
    url = empty_db_url
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        _roll_out(engine, url, old, new, start, tmp_path)
    finally:
        engine.dispose()


def _roll_out(engine: sa.Engine, url: str, old: Release, new: Release,
              start: Callable[..., WorkerProcess], tmp_path: Path) -> None:
    began = time.monotonic()
    # The previous release's schema, by the previous release's own `flowq migrate`.
    done = old.run("-m", "flowq", "migrate", "--database-url", url)
    assert done.returncode == 0 and f"revision {PREVIOUS_HEAD}" in done.stdout, done
    with engine.begin() as conn:
        conn.exec_driver_sql(LEDGER_DDL)
    enq = old.run("-c", ENQUEUE, url, str(OLD_RECORDS), str(OLD_FLOWS), "0.1")
    assert enq.returncode == 0 and "flowq-0006" in enq.stdout, enq
    backlog_runs = scalar(engine, "SELECT max(run_id) FROM flowq.jobs")

    old_workers = [start(old, url) for _ in range(2)]
    _listening(engine, *old_workers)
    wait_until(lambda: scalar(engine, "SELECT count(*) FROM rolling_ledger") >= 20, timeout=60,
               message="the old workers draining")

    # A long transaction holding a lock on flowq.jobs (a report, an idle session): 0007's
    # ALTER TABLE cannot have its lock; it waits at most lock_timeout each try, and the old
    # workers' claims queued behind it go on.
    holder_engine = sa.create_engine(url, poolclass=sa.pool.NullPool,
                                     connect_args={"application_name": "rolling-report"})
    holder = holder_engine.connect()
    holder.execute(sa.text("SELECT count(*) FROM flowq.jobs"))
    migrate_since = _db_now(engine)
    clock = time.monotonic()
    migrate_log = tmp_path / "migrate.log"
    migrating = new.popen(["-m", "flowq", "migrate", "--database-url", url], migrate_log)
    try:
        wait_until(lambda: "trying again" in migrate_log.read_text() or migrating.poll()
                   is not None, timeout=60, message="the migration retrying")
        retried_while_held = "rolling-report" in migrate_log.read_text()
    finally:
        holder.rollback()
        holder.close()
        holder_engine.dispose()
    assert migrating.wait(timeout=90) == 0, migrate_log.read_text()
    migrate_s = time.monotonic() - clock
    migrate_until = _db_now(engine)
    migrate_out = migrate_log.read_text()
    assert f"to {HEAD_REVISION}." in migrate_out and retried_while_held, migrate_out
    retries = migrate_out.count("trying again")
    assert len(migrate_out.splitlines()) == retries + 1, migrate_out  # one line per retry
    assert all(w.proc.poll() is None for w in old_workers), "an old worker stopped on 0007"

    # The previous release restarted now refuses to start (it predates the newer-schema
    # rule): one sentence, a clean exit, which docs/operations.md tells.
    refused = old.run("-m", "flowq", "worker", "rolling_app:app", "--database-url", url)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused
    assert f"is at revision {HEAD_REVISION}, and this flowq needs {PREVIOUS_HEAD}" \
        in refused.stderr, refused

    new_workers = [start(new, url) for _ in range(2)]
    _listening(engine, *new_workers)
    enq = new.run("-c", ENQUEUE, url, str(NEW_RECORDS), str(NEW_FLOWS), "0.1")
    assert enq.returncode == 0 and "flowq-0006" not in enq.stdout, enq
    wait_until(lambda: scalar(engine, "SELECT count(*) FROM rolling_ledger WHERE release = "
                              "'new'") >= 5, timeout=60, message="the new workers running")
    old_after = scalar(engine, "SELECT count(*) FROM rolling_ledger WHERE release = 'old' "
                       "AND at > :t", t=migrate_until)

    # Midway: one old worker stopped as a deploy stops it, the other killed outright.
    pending = scalar(engine, "SELECT count(*) FROM flowq.steps WHERE status <> 'succeeded'")
    termed, killed = old_workers
    wait_until(lambda: held_by(engine, killed.pid), timeout=30, interval=0.01,
               message="the old worker to be killed holding jobs")
    termed.signal(signal.SIGTERM)
    killed.signal(signal.SIGKILL)
    assert termed.wait(timeout=60) == 0, termed.log()[-3000:]
    killed.wait(timeout=10)

    total_jobs = OLD_RECORDS + NEW_RECORDS + len(STEPS) * (OLD_FLOWS + NEW_FLOWS)
    wait_until(lambda: scalar(engine, "SELECT count(*) FROM flowq.steps WHERE status = "
                              "'succeeded'") == total_jobs, timeout=90,
               message="every job succeeded")
    stop_workers(*new_workers)

    ledger = rows(engine, "SELECT job_id, run_id, step, release FROM rolling_ledger")
    jobs = rows(engine, "SELECT id, run_id, coalesce(step, task) AS step, status "
                        "FROM flowq.steps")
    per_job: dict[int, int] = {}
    for r in ledger:
        per_job[r.job_id] = per_job.get(r.job_id, 0) + 1
    doubles = sum(1 for c in per_job.values() if c > 1)
    lost = sum(1 for j in jobs if per_job.get(j.id, 0) == 0)
    not_final = [j for j in jobs if j.status != "succeeded"]
    flows = rows(engine, "SELECT run_id, count(*) AS steps FROM flowq.steps WHERE task = 'flow' "
                         "GROUP BY run_id")
    by_release = {rel: sum(1 for r in ledger if r.release == rel) for rel in ("old", "new")}
    gap = _longest_gap(engine, migrate_since, migrate_until, backlog_runs)
    numbers = (f"jobs={len(jobs)} (expected {total_jobs}) ledger_rows={len(ledger)} "
               f"doubles={doubles} lost={lost} not_final={len(not_final)} "
               f"old_rows={by_release['old']} (after migrate: {old_after}) "
               f"new_rows={by_release['new']} pending_at_stop={pending} "
               f"migrate_s={migrate_s:.2f} migrate_retries={retries} "
               f"longest_ledger_gap_while_migrating_s={gap:.2f} "
               f"total_s={time.monotonic() - began:.1f}")
    print("rolling release:", numbers)
    assert len(jobs) == total_jobs and len(ledger) == total_jobs, numbers
    assert doubles == 0 and lost == 0 and not not_final, numbers
    assert len(flows) == OLD_FLOWS + NEW_FLOWS and {f.steps for f in flows} == {3}, numbers
    assert old_after > 0 and by_release["new"] > 0, numbers  # both releases ran on 0007
    assert pending > 0, numbers  # the old workers were stopped with work left
    for w in (termed, killed, *new_workers):
        assert "Traceback" not in w.log(), w.log()[-3000:]
    assert_no_crash_lines(termed, killed, *new_workers)
    # The new workers met the schema they know: no newer-schema warning.
    assert not any("newer than this flowq" in w.log() for w in new_workers)
