"""Failover of the primary (issue 20): a primary and a streaming standby (PostgreSQL's own
physical replication, both started here from the binaries of the server the suite runs on),
flowq given both hosts with `target_session_attrs=read-write`, one worker in SQLAlchemy's
multi-host URL form (`?host=a&host=b`) and one in libpq's (`a,b` before the path).

Mid-drain of ledger jobs (tasks and two-step pipelines writing one ledger row per step through
`ctx.session`, and plain tasks), and mid-enqueue from a producer writing one business row per
enqueue in the same transaction (retrying each order with `flowq.db.is_transient` and an
idempotency key, as docs/operations.md shows), the primary goes:

- `crash-sync`: stopped at once (`pg_ctl -m immediate`) with synchronous replication, the
  standby promoted: every enqueue that committed is on the new primary and ran, every ledger
  row exactly once per step;
- `crash-async`: the same with asynchronous replication: what was lost is only what had not
  been replicated, never one half of a transaction (business rows and jobs stay one to one),
  and every job on the new primary ran, its ledger rows exactly once;
- `switchover`: made read-only in place (`default_transaction_read_only`, every connection
  kept), then the standby promoted once it caught up: nothing lost, and the worker's
  connections leave the read-only server by themselves.

In each, the workers reconnect by themselves (the times are printed), log no traceback and
one outage line each, not a line per part. After a crash, the old primary comes back
read-only and gets none of flowq's connections: new work goes to the new primary.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import tenacity
from failover_app import LEDGER_DDL, ORDERS_DDL, fo_pipe
from support import assert_no_crash_lines, rows, scalar

import flowq
import flowq.db
from flowq.local.postgres import FAST_SETTINGS, LocalPostgres, embedded_bindir
from flowq.ops.doctor import doctor
from flowq.testing import wait_until

APP = "failover_app:app"
RECORDS, PLAIN, PIPES = 800, 200, 100
TIMEOUT = 120.0


def _major(bindir: Path) -> int | None:
    try:
        out = subprocess.run([str(bindir / "pg_ctl"), "--version"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"\(PostgreSQL\)\s+(\d+)", out)
    return int(found.group(1)) if found else None


@pytest.fixture(scope="module")
def bindir(flowq_server_url: str, flowq_postgres: LocalPostgres | None) -> Path:
    """The binaries of the PostgreSQL the suite runs on (its major version), to build a
    primary and a standby from: the embedded server's, or /usr/lib/postgresql/N/bin."""
    engine = sa.create_engine(flowq_server_url)
    try:
        major = int(scalar(engine, "SHOW server_version_num")) // 10000
    finally:
        engine.dispose()
    candidates = [flowq_postgres.bindir] if flowq_postgres is not None else []
    candidates.append(Path(f"/usr/lib/postgresql/{major}/bin"))
    with contextlib.suppress(flowq.FlowqError):
        candidates.append(embedded_bindir())
    for c in candidates:
        if (c / "pg_basebackup").exists() and _major(c) == major:
            return c
    pytest.skip(f"no PostgreSQL {major} binaries with pg_basebackup here (looked in "
                f"{', '.join(map(str, candidates))}): cannot build a primary and a standby")


@dataclass
class Pair:
    primary: LocalPostgres
    standby: LocalPostgres

    def url(self, form: str = "sqlalchemy", *, first: LocalPostgres | None = None) -> str:
        a, b = (self.primary, self.standby) if first is not self.standby else (
            self.standby, self.primary)
        if form == "sqlalchemy":
            return (f"postgresql+psycopg://postgres@/postgres?host=127.0.0.1:{a.port}"
                    f"&host=127.0.0.1:{b.port}&target_session_attrs=read-write")
        return (f"postgresql+psycopg://postgres@127.0.0.1:{a.port},127.0.0.1:{b.port}/postgres"
                "?target_session_attrs=read-write")


@pytest.fixture
def pair(bindir: Path, request: pytest.FixtureRequest) -> Iterator[Pair]:
    """A primary and its streaming standby (synchronous with `sync`), both running."""
    sync = request.param == "crash-sync"
    # Commits wait for the local WAL write as in production (fsync stays off: the old
    # primary's disk is thrown away), and for the standby too only with `sync`.
    settings = {**FAST_SETTINGS, "synchronous_commit": "on",
                "wal_sender_timeout": "5s", "wal_receiver_status_interval": "1s"}
    primary = LocalPostgres(bindir=bindir, settings=settings).start()
    standby: LocalPostgres | None = None
    try:
        standby = primary.standby()
        standby.start()
        engine = sa.create_engine(primary.url, isolation_level="AUTOCOMMIT")
        try:
            if sync:
                with engine.connect() as conn:
                    conn.execute(sa.text("ALTER SYSTEM SET synchronous_standby_names = '*'"))
                    conn.execute(sa.text("SELECT pg_reload_conf()"))
            wanted = "sync" if sync else "async"
            request.node.user_properties.append(("replication", wanted))
            wait_until(lambda: scalar(engine, "SELECT count(*) FROM pg_stat_replication "
                                              "WHERE sync_state = :s", s=wanted) == 1,
                       timeout=60, message=f"the standby streaming ({wanted})")
        finally:
            engine.dispose()
        yield Pair(primary, standby)
    finally:
        if standby is not None:
            standby.stop("immediate")
        primary.stop("immediate")


@dataclass
class Producer:
    """Enqueues one `fo_record` job per transaction beside one business row (`fo_orders`),
    until stopped. An order whose transaction fails transiently is tried again, the same
    order with the same idempotency key, so an ambiguous commit never doubles it."""

    url: str
    committed: dict[int, int] = field(default_factory=dict)  # n -> job id
    failed: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def order(self, maker: Any, n: int) -> int:
        with maker.begin() as s:
            s.execute(sa.text("INSERT INTO fo_orders (n, job_id) VALUES (:n, 0) "
                              "ON CONFLICT (n) DO NOTHING"), {"n": n})
            job = s.enqueue("fo_record", idempotency_key=f"fo-order-{n}", n=n)
            s.execute(sa.text("UPDATE fo_orders SET job_id = :j WHERE n = :n"),
                      {"j": job.job_id, "n": n})
        return job.job_id

    def run(self, start: int) -> None:
        engine = flowq.db.create_engine(self.url, pool_size=1, max_overflow=0,
                                        connect_args={"connect_timeout": 3})
        maker = sa.orm.sessionmaker(engine, class_=flowq.Session)
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(flowq.db.is_transient),
            wait=tenacity.wait_exponential(multiplier=0.05, max=1),
            stop=tenacity.stop_after_delay(TIMEOUT), reraise=True,
            before_sleep=lambda state: self.failed.append(
                type(getattr(state.outcome.exception(), "orig", None)).__name__))
        try:
            for n in range(start, start + 10**6):
                if self.stop.is_set():
                    return
                self.committed[n] = retrying(self.order, maker, n)
                self.stop.wait(0.004)
        finally:
            engine.dispose()


def _on(engine: sa.Engine, role: str, pid: int) -> bool:
    """Whether worker process `pid` has a connection of `role` on `engine`'s server."""
    return bool(rows(engine, "SELECT 1 FROM pg_stat_activity WHERE application_name LIKE :n",
                     n=f"flowq {role} %:{pid}:%"))


def _autocommit(engine: sa.Engine, *statements: str) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for statement in statements:
            conn.execute(sa.text(statement))


@pytest.mark.parametrize("pair", ["crash-sync", "crash-async", "switchover"], indirect=True)
def test_failover_mid_drain_and_mid_enqueue(pair: Pair, spawn_worker: Any,
                                            request: pytest.FixtureRequest) -> None:
    scenario = request.node.callspec.params["pair"]
    lossless = scenario != "crash-async"
    engine = sa.create_engine(pair.url())
    flowq.migrate(engine)
    with engine.begin() as conn:
        conn.execute(sa.text(LEDGER_DDL))
        conn.execute(sa.text(ORDERS_DDL))
    old = sa.create_engine(pair.primary.url)
    if scenario == "crash-sync":  # `flowq doctor` pointed at the standby: a plain warning
        on_standby = sa.create_engine(pair.standby.url)
        try:
            found = {c.name: c for c in doctor(on_standby)}
        finally:
            on_standby.dispose()
        assert found["primary"].level == "WARN" and "standby" in found["primary"].found
        assert found["listen"].level == "WARN", found["listen"]
    # A claim replicated without its completion (asynchronous) is reaped after --stale-after.
    args = ("-c", "8", "--heartbeat-interval", "1", "--poll-interval", "1", "--stale-after",
            "5")
    workers = [spawn_worker(APP, pair.url("sqlalchemy"), *args),
               spawn_worker(APP, pair.url("libpq"), *args)]
    for w in workers:
        wait_until(lambda w=w: _on(old, "listen", w.pid), timeout=60,
                   message=f"worker {w.pid} listening")
    maker = sa.orm.sessionmaker(engine, class_=flowq.Session)
    with maker.begin() as s:
        s.enqueue_many("fo_record", [{"n": i} for i in range(RECORDS)])
        s.enqueue_many("fo_plain", [{"n": i} for i in range(PLAIN)])
        s.enqueue_many(fo_pipe, [{"n": i} for i in range(PIPES)])
    engine.dispose()
    producer = Producer(pair.url())
    thread = threading.Thread(target=producer.run, args=(10**6,), daemon=True)
    thread.start()

    wait_until(lambda: scalar(old, "SELECT count(*) FROM fo_ledger") >= RECORDS // 4,
               timeout=TIMEOUT, interval=0.02, message="a quarter of the ledger written")
    failed = time.monotonic()
    if scenario == "switchover":
        # Demoted in place: every connection stays, and the next transaction is read-only.
        _autocommit(old, "ALTER SYSTEM SET default_transaction_read_only = on",
                    "SELECT pg_reload_conf()")
        # A transaction begun before a session read the new setting still writes: once every
        # session has read it (they do at their next command; 0.5 s is plenty) and those
        # transactions ended, nothing writes, and the standby replays all there is.
        time.sleep(0.5)
        settled = scalar(old, "SELECT clock_timestamp()")
        wait_until(lambda: not scalar(old, "SELECT count(*) FROM pg_stat_activity WHERE "
                                           "xact_start < :t AND pid <> pg_backend_pid()",
                                      t=settled),
                   timeout=TIMEOUT, interval=0.02, message="the last writers on the old primary")
        lsn = scalar(old, "SELECT pg_current_wal_lsn()")
        stand = sa.create_engine(pair.standby.url)
        wait_until(lambda: scalar(stand, "SELECT pg_last_wal_replay_lsn() >= :l",
                                  l=lsn), timeout=TIMEOUT, interval=0.02,
                   message="the standby caught up")
        stand.dispose()
    else:
        pair.primary.stop("immediate")
    pair.standby.promote()
    promoted = time.monotonic()

    new = sa.create_engine(pair.standby.url)
    promoted_at = scalar(new, "SELECT clock_timestamp()")
    # The LISTEN and the heartbeat (the claim and completion connections show in the
    # ledger) of every worker on the new primary; the seconds from the failure.
    back: dict[tuple[str, int], float] = {}

    def every_worker_back() -> bool:
        for role in ("listen", "heartbeat"):
            for w in workers:
                if (role, w.pid) not in back and _on(new, role, w.pid):
                    back[role, w.pid] = time.monotonic() - failed
        return len(back) == 2 * len(workers)

    wait_until(every_worker_back, timeout=TIMEOUT, interval=0.05,
               message="every worker listening and heartbeating on the new primary")
    listening = [v for (role, _), v in back.items() if role == "listen"]
    beating = [v for (role, _), v in back.items() if role == "heartbeat"]
    after = len(producer.committed)
    wait_until(lambda: len(producer.committed) >= after + 200, timeout=TIMEOUT,
               message="the producer committing on the new primary")
    producer.stop.set()
    thread.join(timeout=30)

    def drained() -> bool:
        return not scalar(new, "SELECT count(*) FROM flowq.steps WHERE status NOT IN "
                               "('succeeded', 'dead', 'cancelled')")

    wait_until(drained, timeout=TIMEOUT, interval=0.2, message="everything drained")
    if scenario == "switchover":
        # The hot-path connections and the LISTEN left the read-only server by themselves.
        for role in ("claim", "complete", "heartbeat", "listen"):
            for w in workers:
                assert not _on(old, role, w.pid), f"worker {w.pid} still has {role} on the old"

    # When each worker wrote on the new primary again, from its promotion (server clocks).
    resumed = [float(r.after) for r in rows(
        new, "SELECT extract(epoch FROM min(at) - :t) AS after FROM fo_ledger "
             "WHERE at > :t GROUP BY pid", t=promoted_at)]
    # The business rows and their jobs: one to one, whatever was lost.
    orders = {r.n: r.job_id for r in rows(new, "SELECT n, job_id FROM fo_orders")}
    record_jobs = {r.id for r in rows(new, "SELECT id FROM flowq.steps WHERE task = 'fo_record'"
                                           " AND (args->>'n')::bigint >= :s", s=10**6)}
    assert set(orders.values()) == record_jobs, "a business row without its job, or back"
    lost = {n for n in producer.committed if n not in orders}
    if lossless:
        assert not lost, f"{len(lost)} enqueues that committed are gone after failover"
    statuses = dict(rows(new, "SELECT status, count(*) FROM flowq.steps GROUP BY 1"))
    assert set(statuses) == {"succeeded"}, statuses
    doubles = rows(new, "SELECT job_id, step, count(*) FROM fo_ledger GROUP BY 1, 2 "
                        "HAVING count(*) > 1")
    assert not doubles, f"ledger rows written twice: {doubles[:5]}"
    missing = scalar(new, "SELECT count(*) FROM flowq.steps j WHERE task IN ('fo_record', "
                          "'fo_pipe') AND NOT EXISTS (SELECT 1 FROM fo_ledger l WHERE "
                          "l.job_id = j.id)")
    assert missing == 0, f"{missing} succeeded jobs without their ledger row"

    if scenario != "switchover":
        # The old primary comes back read-only: nothing of flowq's connects there.
        pair.primary.settings["default_transaction_read_only"] = "on"
        pair.primary.start()
        late = flowq.db.create_engine(pair.url())
        with sa.orm.sessionmaker(late, class_=flowq.Session).begin() as s:
            s.enqueue_many("fo_record", [{"n": 2 * 10**6 + i} for i in range(100)])
        late.dispose()
        wait_until(drained, timeout=TIMEOUT, interval=0.2, message="the last jobs drained")
        old.dispose()  # its connections were to the server before the crash
        on_old = rows(old, "SELECT application_name FROM pg_stat_activity "
                           "WHERE application_name LIKE 'flowq %'")
        assert not on_old, f"flowq connected to the read-only old primary: {on_old}"
    old.dispose()

    for w in workers:
        w.signal(signal.SIGTERM)
    for w in workers:
        assert w.wait(timeout=60) == 0, w.log()[-3000:]
    assert_no_crash_lines(*workers)
    for w in workers:
        log = w.log()
        assert "Traceback" not in log, log[-5000:]
        told = log.count("database connection lost; reconnecting")
        assert told <= 2, f"worker {w.pid} told the outage {told} times"
        assert "database connection back" in log
    warnings = [sum("WARNING" in line and "job" not in line.split("WARNING")[1][:40]
                    for line in w.log().splitlines()) for w in workers]
    jobs = sum(statuses.values())
    print(f"\nfailover ({scenario}): {jobs} jobs, {len(doubles)} doubles, {len(lost)} lost "
          f"of {len(producer.committed)} committed enqueues; promoted "
          f"{promoted - failed:.2f} s after the failure; workers writing again "
          f"{sorted(round(v, 2) for v in resumed)} s after the promotion, listening "
          f"{sorted(round(v, 2) for v in listening)} s and heartbeating "
          f"{sorted(round(v, 2) for v in beating)} s after the failure; producer retries "
          f"{len(producer.failed)} ({sorted(set(producer.failed))}); non-job warning lines per "
          f"worker {warnings}")
    new.dispose()
