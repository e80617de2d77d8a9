"""History retention (`flowq.db.history`, the pruner's pass): the day partitions of
`flowq.job_history` made ahead, whole old days dropped once their kept runs are re-homed and
their pruned runs' dependent rows gone, the rule row by row for the DEFAULT partition, and
the move of finished rows an earlier release left in `jobs`. Old days are made by hand: a
partition for a past day, rows inserted into it with an old `retired_at`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import date, datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa

import flowq
from flowq.db.history import IN_DEFAULT, PRUNER_LOCK, day_bounds, ensure_partitions
from flowq.db.sql import Queries
from flowq.db.sql.history import partition_name
from flowq.errors import RunNotFoundError
from flowq.ops.runs import cancel_run, get_run, retry_run
from flowq.testing import running_worker, wait_until
from flowq.worker.pruner import Pruner

Q = Queries("flowq")
DAY = 86400.0
HOUR = 3600.0


def today(engine: sa.Engine) -> date:
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT (now() AT TIME ZONE 'UTC')::date")).scalar_one()


def partitions(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'flowq.job_history'::regclass ORDER BY 1")).scalars())


def make_day(engine: sa.Engine, day: date) -> str:
    """A partition for a past `day`, as an earlier pass would have made it."""
    name = partition_name(day)
    with engine.begin() as conn:
        conn.execute(sa.text(
            f"CREATE TABLE flowq.{name} PARTITION OF flowq.job_history FOR VALUES "
            f"FROM ('{day} 00:00+00') TO ('{day + timedelta(days=1)} 00:00+00')"))
    return name


def add_finished(conn: sa.Connection, run_id: int | None = None, *, status: str = "succeeded",
                 finished: datetime | float, retired: datetime | None = None) -> int:
    """One finished row written straight into `job_history`: `finished` a time or seconds
    ago, `retired` its partition key (default: now()); returns its run id."""
    ago = finished if isinstance(finished, float) else None
    at = finished if isinstance(finished, datetime) else None
    return int(conn.execute(sa.text("""
        INSERT INTO flowq.job_history (id, run_id, task, step, step_index, queue, status,
                                       priority, attempts, max_attempts, args,
                                       cancel_requested, run_at, created_at, joined,
                                       finished_at, retired_at)
        SELECT nextval(pg_get_serial_sequence('flowq.jobs', 'id')),
               COALESCE(:run_id, nextval('flowq.run_id_seq')), 't', 't', 0, 'default', :status,
               0, 1, 10, '{}', false, f.at, f.at, false, f.at, COALESCE(:retired, now())
          FROM (SELECT COALESCE(CAST(:at AS timestamptz),
                                now() - make_interval(secs => :ago)) AS at) f
        RETURNING run_id"""), {"run_id": run_id, "status": status, "at": at, "ago": ago,
                               "retired": retired}).scalar_one())


def add_dependents(conn: sa.Connection, run_id: int) -> None:
    """One row in each table hanging off run `run_id`."""
    params = {"r": run_id, "k": f"key-{run_id}"}
    for sql in (
            "INSERT INTO flowq.run_keys (key, run_id) VALUES (:k, :r)",
            "INSERT INTO flowq.uniques (key, run_id) VALUES (:k, :r)",
            "INSERT INTO flowq.checkpoints (run_id, step, map_index, name, position, result) "
            "VALUES (:r, 't', -1, 'c', 0, '1')",
            "INSERT INTO flowq.signals (run_id, name) VALUES (:r, 'go')",
            "INSERT INTO flowq.joins (run_id, step, parents, remaining) VALUES (:r, 't', 2, 0)",
            "INSERT INTO flowq.children (run_id, parent_run_id, parent_step, parent_map_index, "
            "parent_job_id, name) VALUES (nextval('flowq.run_id_seq'), :r, 't', -1, 0, 'c')"):
        conn.execute(sa.text(sql), params)


def dependents(engine: sa.Engine, run_id: int) -> dict[str, int]:
    with engine.connect() as conn:
        return {table: conn.execute(sa.text(
                    f"SELECT count(*) FROM flowq.{table} WHERE {column} = :r"),
                    {"r": run_id}).scalar_one()
                for table, column in (("run_keys", "run_id"), ("uniques", "run_id"),
                                      ("checkpoints", "run_id"), ("signals", "run_id"),
                                      ("joins", "run_id"), ("children", "parent_run_id"))}


def homes(engine: sa.Engine, run_id: int) -> list[str]:
    """The table each row of run `run_id` sits in."""
    with engine.connect() as conn:
        return sorted(conn.execute(sa.text(
            "SELECT tableoid::regclass::text FROM flowq.jobs WHERE run_id = :r UNION ALL "
            "SELECT tableoid::regclass::text FROM flowq.job_history WHERE run_id = :r"),
            {"r": run_id}).scalars())


def test_partitions_are_created_ahead_and_idempotently(engine: sa.Engine) -> None:
    day = today(engine)
    days = [partition_name(day + timedelta(days=n)) for n in range(3)]
    with engine.connect() as conn:
        done = ensure_partitions(conn, "flowq", days_ahead=2)
    assert done.created == tuple(day + timedelta(days=n) for n in range(3))
    assert not done.skipped and not done.refused
    assert partitions(engine) == [*days, "job_history_default"]
    with engine.connect() as conn:
        assert ensure_partitions(conn, "flowq", days_ahead=2).created == ()
    assert partitions(engine) == [*days, "job_history_default"]
    with engine.begin() as conn:  # a completion lands in today's partition
        run_id = conn.execute(sa.text(
            "INSERT INTO flowq.jobs (task, step, status, finished_at) "
            "VALUES ('t', 't', 'succeeded', now()) RETURNING run_id")).scalar_one()
    assert homes(engine, run_id) == [f"flowq.{days[0]}"]
    # The pruner's pass makes them too (the worker's start calls the same).
    Pruner(engine, "flowq", days_ahead=3).run_once()
    assert partitions(engine)[:4] == [*days, partition_name(day + timedelta(days=3))]


def test_a_day_with_rows_in_default_or_a_busy_lock_is_skipped_not_an_error(
        engine: sa.Engine) -> None:
    day = today(engine)
    with engine.begin() as conn:  # today's rows, retired before today had a partition
        run_id = add_finished(conn, finished=60.0)
    with engine.connect() as conn:
        done = ensure_partitions(conn, "flowq", days_ahead=1)
    assert done.skipped == {day: IN_DEFAULT}
    assert done.created == (day + timedelta(days=1),) and not done.refused
    assert Pruner(engine, "flowq").run_once() == 0  # the pass goes on without the day
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM flowq.job_history WHERE run_id = :r"), {"r": run_id})
    with engine.connect() as reader:  # a reader of the DEFAULT partition, in a transaction
        reader.execute(sa.text("SELECT count(*) FROM flowq.job_history_default"))
        with engine.connect() as conn:
            done = ensure_partitions(conn, "flowq", days_ahead=1)
        assert list(done.skipped) == [day] and "lock timeout" in done.skipped[day]
        reader.rollback()
    with engine.connect() as conn:
        assert ensure_partitions(conn, "flowq", days_ahead=1).created == (day,)


def test_a_day_older_than_retention_is_dropped_and_kept_runs_are_rehomed(
        engine: sa.Engine) -> None:
    day = today(engine)
    old = day - timedelta(days=10)
    noon = datetime(old.year, old.month, old.day, 12, tzinfo=timezone.utc)
    name = make_day(engine, old)
    with engine.connect() as conn:
        ensure_partitions(conn, "flowq")
    with engine.begin() as conn:
        pruned = add_finished(conn, finished=noon, retired=noon)
        add_finished(conn, pruned, finished=noon, retired=noon)
        add_dependents(conn, pruned)
        live = add_finished(conn, finished=noon, retired=noon)  # its next step is pending
        conn.execute(sa.text("INSERT INTO flowq.jobs (run_id, task, step) VALUES (:r, 't', 'u')"),
                     {"r": live})
        add_dependents(conn, live)
        dead = add_finished(conn, status="dead", finished=noon, retired=noon)
        later = add_finished(conn, finished=noon, retired=noon)  # a step ended an hour ago
        add_finished(conn, later, finished=HOUR)
        spread = add_finished(conn, finished=noon, retired=noon)  # and a row in DEFAULT
        add_finished(conn, spread, finished=9 * DAY, retired=noon + timedelta(days=1))
        add_dependents(conn, spread)
    assert homes(engine, spread) == [f"flowq.{name}", "flowq.job_history_default"]
    pruner = Pruner(engine, "flowq", retention=3 * DAY, dead_retention=14 * DAY)
    assert pruner.run_once() == 4  # `pruned`'s two rows, `spread`'s two
    assert name not in partitions(engine)
    assert homes(engine, pruned) == [] and homes(engine, spread) == []
    assert set(dependents(engine, pruned).values()) == {0}
    assert set(dependents(engine, spread).values()) == {0}
    assert set(dependents(engine, live).values()) == {1}
    here = f"flowq.{partition_name(day)}"
    assert homes(engine, live) == [here, "flowq.jobs"]  # re-homed into today's partition
    assert homes(engine, dead) == [here]  # inside the dead retention
    assert homes(engine, later) == [here, here]
    with engine.connect() as conn:
        assert conn.execute(sa.text(
            "SELECT count(*) FROM flowq.job_history WHERE finished_at = :t"),
            {"t": noon}).scalar_one() == 3  # re-homed rows are unchanged but for retired_at
    assert pruner.run_once() == 0


def test_a_days_sweep_goes_on_across_passes_and_a_busy_drop_waits_for_the_next(
        engine: sa.Engine) -> None:
    old = today(engine) - timedelta(days=5)
    noon = datetime(old.year, old.month, old.day, 12, tzinfo=timezone.utc)
    name = make_day(engine, old)
    with engine.begin() as conn:
        runs = [add_finished(conn, finished=noon, retired=noon) for _ in range(5)]
        for run_id in runs:
            add_dependents(conn, run_id)
    pruner = Pruner(engine, "flowq", retention=DAY, limit=2, max_batches=1)
    for _ in range(3):  # five runs, two per batch, one batch per pass
        assert pruner.run_once() == 0 and pruner.behind
        assert name in partitions(engine)
    with engine.connect() as reader:  # a reader holds the parent: the DETACH gives up
        reader.execute(sa.text("SELECT count(*) FROM flowq.job_history"))
        assert pruner.run_once() == 0
        reader.rollback()
    assert name in partitions(engine)
    assert pruner.run_once() == 5
    assert name not in partitions(engine)
    assert all(set(dependents(engine, r).values()) == {0} for r in runs)


def test_a_pruned_dead_run_goes_whole_with_its_sweep_so_no_retry_finds_it_before_the_drop(
        engine: sa.Engine) -> None:
    """A dead run past its dead retention is pruned by its day's sweep, rows in the day
    included: left for the DROP (a pass or more later), it was still listed dead, and a
    `runs retry` in between made it live while the DROP then took its first steps and its
    key was already gone. A succeeded run of the same day is left for the DROP."""
    old = today(engine) - timedelta(days=20)
    name = make_day(engine, old)
    noon = datetime(old.year, old.month, old.day, 12, tzinfo=timezone.utc)
    with engine.begin() as conn:
        dead = add_finished(conn, finished=noon, retired=noon)
        add_finished(conn, dead, status="dead", finished=noon, retired=noon)
        add_dependents(conn, dead)
        done = add_finished(conn, finished=noon, retired=noon)
    pruner = Pruner(engine, "flowq", retention=3 * DAY, dead_retention=14 * DAY)
    with engine.connect() as reader:  # a reader holds the parent: the DETACH gives up
        reader.execute(sa.text("SELECT count(*) FROM flowq.job_history"))
        assert pruner.run_once() == 2  # the dead run's two rows, one by one
        reader.rollback()
    assert name in partitions(engine) and homes(engine, done) == [f"flowq.{name}"]
    assert homes(engine, dead) == [] and set(dependents(engine, dead).values()) == {0}
    with pytest.raises(RunNotFoundError):
        retry_run(engine, dead)
    assert pruner.run_once() == 1  # the DROP: the succeeded run's row
    assert name not in partitions(engine)


def waiting_for_a_lock(engine: sa.Engine) -> bool:
    # A transaction of its own each time: a transaction reads pg_stat_activity once.
    with engine.connect() as conn:
        return bool(conn.execute(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'")).scalar())


def _sweeping(engine: sa.Engine, day: date, then: Callable[[], Any]) -> dict[str, Any]:
    """Hold a sweep of `day` open (its lock and its re-homing, as `sweep_day` runs them),
    run `then()` on a thread until it waits, then commit the sweep; `then`'s outcome."""
    lower, upper = day_bounds(day)
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = then()
        except Exception as exc:  # the test reports it
            out["error"] = exc

    with engine.connect() as sweeper, sweeper.begin():
        assert sweeper.execute(Q.try_maintenance_lock,
                               {"name": f"flowq.{PRUNER_LOCK}"}).scalar()
        assert sweeper.execute(Q.prune_partition, {
            "lower": lower, "upper": upper, "after": 0, "retention": 3 * DAY,
            "dead_retention": 14 * DAY, "limit": 100}).one().rehomed
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        wait_until(lambda: not thread.is_alive() or waiting_for_a_lock(engine), timeout=10,
                   message="the operator's action to wait for the sweep")
    thread.join(30)
    assert "error" not in out, repr(out["error"])
    return out


def test_retry_and_cancel_wait_for_a_sweep_that_moves_their_rows(engine: sa.Engine) -> None:
    """A sweep re-homes a kept run's rows (a cross-partition UPDATE); a row lock waiting on
    such a row cannot follow it to its new partition (SQLSTATE 40001, 'already moved to
    another partition'): `runs retry` of a dead run and `runs cancel` of a live one, whose
    rows sit in an expired day, wait for the sweep to end instead and then do their work."""
    old = today(engine) - timedelta(days=5)
    make_day(engine, old)
    with engine.connect() as conn:
        ensure_partitions(conn, "flowq")
    noon = datetime(old.year, old.month, old.day, 12, tzinfo=timezone.utc)
    with engine.begin() as conn:
        dead = add_finished(conn, finished=noon, retired=noon)
        add_finished(conn, dead, status="dead", finished=noon, retired=noon)
        live = add_finished(conn, finished=noon, retired=noon)
        conn.execute(sa.text("INSERT INTO flowq.jobs (run_id, task, step, step_index, status, "
                             "run_at) VALUES (:r, 't', 'u', 1, 'waiting', now() + "
                             "interval '1 day')"), {"r": live})
    assert _sweeping(engine, old, lambda: retry_run(engine, dead))["result"].run.status \
        == "pending"
    assert len(homes(engine, dead)) == 2
    # The sweep re-homed the dead run's rows above: this one finds the live run's.
    make_day(engine, old - timedelta(days=1))
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE flowq.job_history SET retired_at = :at WHERE run_id = :r"),
                     {"at": noon - timedelta(days=1), "r": live})
    cancelled = _sweeping(engine, old - timedelta(days=1), lambda: cancel_run(engine, live))
    assert cancelled["result"].run.status == "cancelled"
    assert get_run(engine, live).status == "cancelled"


def test_the_keys_of_pruned_runs_are_deleted_so_the_key_starts_a_new_run(
        engine: sa.Engine) -> None:
    with engine.begin() as conn:
        first = flowq.enqueue(conn, "t", queue="q", idempotency_key="k")
        kept = flowq.enqueue(conn, "t", queue="q", idempotency_key="kept")
        conn.execute(sa.text("UPDATE flowq.jobs SET status = 'succeeded', finished_at = now() "
                             "- make_interval(secs => :ago) WHERE run_id = :r"),
                     {"ago": 10 * DAY, "r": first.id})
        conn.execute(sa.text("UPDATE flowq.jobs SET status = 'succeeded', finished_at = now() "
                             "WHERE run_id = :r"), {"r": kept.id})
    with engine.begin() as conn:
        assert not flowq.enqueue(conn, "t", queue="q", idempotency_key="k").created
    assert Pruner(engine, "flowq", retention=3 * DAY).run_once() == 1
    with engine.connect() as conn:
        keys = dict(conn.execute(sa.text("SELECT key, run_id FROM flowq.run_keys")).all())
    assert keys == {"kept": kept.id}
    with engine.begin() as conn:
        again = flowq.enqueue(conn, "t", queue="q", idempotency_key="k")
        assert again.created and again.id != first.id
        assert not flowq.enqueue(conn, "t", queue="q", idempotency_key="kept").created


def test_finished_rows_left_in_jobs_are_moved_or_pruned(engine: sa.Engine) -> None:
    """Rows that ended while a worker of the release before 0018 was registered (or before
    the migration) stay in `jobs`: the old ones are pruned there by the rule row by row, the
    others moved once no such worker is left."""
    with engine.begin() as conn:  # no capabilities: the release before
        conn.execute(sa.text(
            "INSERT INTO flowq.workers (name, host, pid, queues, tasks, concurrency, version) "
            "VALUES ('old', 'h', 1, '{default}', '{t}', 1, '0.9')"))
        ids = list(conn.execute(sa.text("""
            INSERT INTO flowq.jobs (task, step, status, finished_at, idempotency_key, result)
            VALUES ('t', 't', 'succeeded', now() - interval '10 days', NULL, NULL),
                   ('t', 't', 'succeeded', now() - interval '1 hour', 'moved-key', '{"a": 1}'),
                   ('t', 't', 'dead', now() - interval '2 days', NULL, NULL),
                   ('t', 't', 'cancelled', now() - interval '1 minute', NULL, NULL),
                   ('t', 't', 'pending', NULL, NULL, NULL)
            RETURNING id""")).scalars())
        before = {r.id: r._asdict() for r in conn.execute(sa.text(
            "SELECT * FROM flowq.jobs WHERE id = ANY(:ids)"), {"ids": ids[1:4]})}

    def live() -> list[int]:
        with engine.connect() as conn:
            return list(conn.execute(sa.text("SELECT id FROM flowq.jobs ORDER BY id")).scalars())

    pruner = Pruner(engine, "flowq", retention=3 * DAY, limit=2)
    assert pruner.run_once() == 1  # the row that ended 10 days ago
    assert live() == ids[1:]  # the old worker reads `jobs` only: nothing moves
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM flowq.workers"))
    assert pruner.run_once() == 0
    with engine.connect() as conn:
        moved = {r.id: r._asdict() for r in conn.execute(sa.text(
            "SELECT * FROM flowq.job_history"))}
        key = conn.execute(sa.text("SELECT run_id FROM flowq.run_keys WHERE key = 'moved-key'"
                                   )).scalar_one()
    assert live() == [ids[4]]
    assert set(moved) == set(ids[1:4])  # in two batches of two
    for id_, row in moved.items():
        assert row.pop("retired_at") is not None and row == before[id_]
    assert key == before[ids[1]]["run_id"]
    assert pruner.run_once() == 0


def test_a_sweep_reads_only_its_day_and_the_run_indexes(engine: sa.Engine) -> None:
    """The sweep's runs come from its day's partition alone (pruned by the bounds), in run_id
    order through that partition's index: a batch costs its runs, not the day's size."""
    old = today(engine) - timedelta(days=5)
    name = make_day(engine, old)
    with engine.connect() as conn:
        ensure_partitions(conn, "flowq")
    noon = datetime(old.year, old.month, old.day, 12, tzinfo=timezone.utc)
    with engine.begin() as conn:
        for _ in range(50):
            add_finished(conn, finished=noon, retired=noon)
        conn.execute(sa.text("ANALYZE flowq.job_history"))
        lower = datetime(old.year, old.month, old.day, tzinfo=timezone.utc)
        plan = "\n".join(conn.execute(sa.text(f"EXPLAIN {Q.prune_partition.text}"), {
            "lower": lower, "upper": lower + timedelta(days=1), "after": 0, "limit": 10,
            "retention": DAY, "dead_retention": DAY}).scalars())
    runs = plan.split("CTE kept")[0]
    assert f"using {name}_run_id_idx on {name}" in runs
    assert runs.count("job_history_") == 2  # that index on that partition, no other
    assert "Seq Scan" not in runs


def test_a_starting_worker_makes_its_days_before_its_first_completion(
        app: flowq.FlowQ, engine: sa.Engine, db_url: str) -> None:
    @app.task()
    def noop(ctx: flowq.Context) -> None: ...

    assert partitions(engine) == ["job_history_default"]  # a fresh database
    with engine.begin() as conn:
        run = flowq.enqueue(conn, noop)
    with running_worker(app, db_url, prune_interval=3600.0):
        wait_until(lambda: homes(engine, run.id) != ["flowq.jobs"], timeout=20,
                   message="the job to finish")
    day = today(engine)
    assert homes(engine, run.id) == [f"flowq.{partition_name(day)}"]  # not DEFAULT
    assert partitions(engine)[:3] == [partition_name(day + timedelta(days=n)) for n in range(3)]
