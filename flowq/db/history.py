"""The day partitions of `flowq.job_history`, and retention that drops whole days.

Finished rows retire into `job_history` (revision 0018), partitioned by range on
`retired_at`: one partition per UTC day, `job_history_YYYYMMDD` (`schema.HISTORY_PARTITION`),
beside the migration's DEFAULT partition, which takes whatever no day takes. Deleting a day's
rows one by one is what made retention expensive at 10,000,000 rows (heap and index churn,
vacuum behind it); dropping the day's table costs a catalog change. So:

- `ensure_partitions(conn, schema, days_ahead=DAYS_AHEAD)` (default 2) creates the partitions
  of today and the next `days_ahead` days that are missing: `CREATE TABLE ... (LIKE
  job_history)`, then `ATTACH PARTITION` (SHARE UPDATE EXCLUSIVE on the parent, so completions
  go on; ACCESS EXCLUSIVE on the DEFAULT partition while it is scanned for rows of that day).
  A day whose rows already sit in the DEFAULT partition (looked for first with a plain read,
  so no pass takes DEFAULT's exclusive lock for nothing; else a check_violation), or whose
  lock is not granted within `LOCK_TIMEOUT` (default 500 ms), or whose DDL runs past `DDL_TIMEOUT`
  (default 5 s: the scan of a large DEFAULT partition), is skipped and tried again at the
  next call. Never an error that stops a pass.
- A day whose whole range is older than the retention is swept (`sweep_day`, a batch of runs
  at a time): the rows of runs that are kept (`flowq.db.sql.history.keeps`: a live step, a
  step that ended within the retention, a dead one within the dead retention) are re-homed
  (`retired_at = now()`, which moves them to today's partition), every other run is pruned
  whole (its rows elsewhere, what hangs off it). Then `drop_day` detaches and drops the
  table (ACCESS EXCLUSIVE on the parent, under `LOCK_TIMEOUT`; not granted: tried again).
- `prune_runs` keeps the rule row by row for what no day took (the DEFAULT partition, and
  finished rows still in `jobs`), a batch of `limit` runs at a time.
- `move_finished` moves the finished rows an earlier release left in `jobs` to history.
- `hold_retention(conn, schema)` keeps every retention pass out of the caller's transaction
  (the pruner's lock, shared): `runs retry`, `runs cancel` and a redrive lock and move a
  run's rows, which a sweep may be moving to another partition (a row lock cannot follow
  a row there: SQLSTATE 40001) or deleting. A pruned run with a dead step, the one kind
  a retry brings back, is deleted whole by its sweep, rows in the day included, so no
  retry finds it between the sweep and the DROP.

So a finished run is kept at least `retention` and, in a day partition, at most a day more;
a kept run's rows are rewritten once per `retention` while it is kept (a dead run, until its
dead retention passes). Each call here is one transaction (one per day for
`ensure_partitions`) under the pruner's advisory lock (`PRUNER_LOCK`), taken with `try`:
a call that does not get it does nothing and returns None (another pruner is at work).
`conn` is a connection outside any transaction. `flowq.worker.pruner.Pruner` makes the pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from typing import Final

import sqlalchemy as sa

from flowq.db.schema import HISTORY_PARTITION
from flowq.db.sql import queries

__all__ = ["DAYS_AHEAD", "DDL_TIMEOUT", "IN_DEFAULT", "LOCK_TIMEOUT", "PRUNER_LOCK", "Partitioned", "Swept",
           "day_bounds", "drop_day", "ensure_partitions", "expired_days", "hold_retention",
           "move_finished", "prune_runs", "sweep_day"]

DAYS_AHEAD: Final = 2
# A DDL statement waiting for its lock stands ahead of every writer and reader that queues
# after it; it gives up soon, and the day is tried at the next pass.
LOCK_TIMEOUT: Final = "500ms"
DDL_TIMEOUT: Final = "5s"
# The advisory lock every retention transaction takes: `<schema>.pruner`.
PRUNER_LOCK: Final = "pruner"

# The errors that mean "not now": a check_violation (the day's rows are in DEFAULT), a lock
# not granted, a statement cancelled by its timeout.
_NOT_NOW: Final = frozenset({"23514", "55P03", "57014"})
_DAY_NAME: Final = len(HISTORY_PARTITION) + 8
# Why a day was skipped when its rows are in the DEFAULT partition (found before any DDL).
IN_DEFAULT: Final = "rows of the day are in the DEFAULT partition"


@dataclass(frozen=True)
class Partitioned:
    """What `ensure_partitions` did: the days it created, and those it skipped (day ->
    the server's first line) to try again at the next call."""

    created: tuple[date, ...] = ()
    skipped: dict[date, str] = field(default_factory=dict)  # not now: rows in DEFAULT, a lock
    refused: dict[date, str] = field(default_factory=dict)  # any other refusal (say so)
    busy: bool = False  # another pruner held the lock: the rest was not tried


@dataclass(frozen=True)
class Swept:
    """One batch of a day's sweep: the last run id it took (None: the day is swept), the
    rows it deleted (outside the day, and a pruned dead run's in it: rows the DROP will not
    count), and the rows of kept runs it re-homed."""

    last_run_id: int | None
    deleted: int
    rehomed: int


def day_bounds(day: date) -> tuple[datetime, datetime]:
    """The range of `retired_at` a day's partition takes: [day 00:00 UTC, next day's)."""
    lower = datetime(day.year, day.month, day.day, tzinfo=timezone.utc)
    return lower, lower + timedelta(days=1)


@contextmanager
def _locked(conn: sa.Connection, schema: str) -> Iterator[bool]:
    """A transaction on `conn` holding the pruner's lock (yields False: another has it)."""
    with conn.begin():
        yield bool(conn.execute(queries(schema).try_maintenance_lock,
                                {"name": f"{schema}.{PRUNER_LOCK}"}).scalar())


def hold_retention(conn: sa.Connection, schema: str) -> None:
    """Keep retention passes out until `conn`'s transaction ends: waits for a pass under
    way (one statement, bounded by the maintenance statement timeout); a pass that starts
    meanwhile does nothing. Call it before locking any row of a run."""
    conn.execute(queries(schema).lock_maintenance_shared, {"name": f"{schema}.{PRUNER_LOCK}"})


def _sqlstate(exc: sa.exc.DBAPIError) -> str | None:
    return getattr(exc.orig, "sqlstate", None)


def _partitions(conn: sa.Connection, schema: str) -> tuple[datetime, set[date]]:
    """The database's clock and the days that have a partition."""
    with conn.begin():
        row = conn.execute(queries(schema).list_partitions).one()
    days = set()
    for name in row.names:
        digits = name[len(HISTORY_PARTITION):]
        if len(name) == _DAY_NAME and digits.isdigit():
            days.add(datetime.strptime(digits, "%Y%m%d").date())
    return row.now, days


def ensure_partitions(conn: sa.Connection, schema: str,
                      days_ahead: int = DAYS_AHEAD) -> Partitioned:
    """Create the partitions of today (UTC, the database's clock) and of the next
    `days_ahead` days that are missing, one transaction each; a day that cannot be attached
    now is skipped (see the module docstring). Errors other than a server's refusal (a lost
    connection) propagate."""
    q = queries(schema)
    now, have = _partitions(conn, schema)
    today = now.astimezone(timezone.utc).date()
    created: list[date] = []
    skipped: dict[date, str] = {}
    refused: dict[date, str] = {}
    for day in (today + timedelta(days=n) for n in range(days_ahead + 1)):
        if day in have:
            continue
        try:
            with _locked(conn, schema) as locked:
                if not locked:
                    return Partitioned(tuple(created), skipped, refused, busy=True)
                conn.execute(q.set_ddl_timeouts, {"lock_timeout": LOCK_TIMEOUT,
                                                  "statement_timeout": DDL_TIMEOUT})
                lower, upper = day_bounds(day)
                if conn.execute(q.exists_default_rows,
                                {"lower": lower, "upper": upper}).scalar():
                    skipped[day] = IN_DEFAULT
                    continue
                conn.execute(q.create_partition(day))
                conn.execute(q.attach_partition(day))
        except sa.exc.DBAPIError as exc:
            state = _sqlstate(exc)
            if state is None:
                raise  # not the server saying no: the connection itself failed
            (skipped if state in _NOT_NOW else refused)[day] = str(exc.orig).partition("\n")[0]
            continue
        created.append(day)
    return Partitioned(tuple(created), skipped, refused)


def expired_days(conn: sa.Connection, schema: str, retention: float) -> list[date]:
    """The days with a partition whose whole range ended more than `retention` seconds ago,
    oldest first."""
    now, have = _partitions(conn, schema)
    cutoff = now - timedelta(seconds=retention)
    return sorted(day for day in have if day_bounds(day)[1] <= cutoff)


def sweep_day(conn: sa.Connection, schema: str, day: date, *, after: int, retention: float,
              dead_retention: float, limit: int) -> Swept | None:
    """One batch of `day`'s sweep: the next `limit` runs after run id `after` (see
    `flowq.db.sql.history.HistoryStatements.prune_partition`); None if the lock is busy."""
    lower, upper = day_bounds(day)
    with _locked(conn, schema) as locked:
        if not locked:
            return None
        row = conn.execute(queries(schema).prune_partition, {
            "lower": lower, "upper": upper, "after": after, "retention": retention,
            "dead_retention": dead_retention, "limit": limit}).one()
    return Swept(row.last_run_id, int(row.deleted), int(row.rehomed))


def drop_day(conn: sa.Connection, schema: str, day: date) -> int | None:
    """Detach and drop `day`'s partition, swept before; returns the rows it held, -1 if
    its lock was not granted in time (tried again at the next pass), None if another
    pruner holds the pruner's lock."""
    q = queries(schema)
    lower, upper = day_bounds(day)
    try:
        with _locked(conn, schema) as locked:
            if not locked:
                return None
            # Counted before the parent's lock is asked for: the day is frozen.
            rows = int(conn.execute(q.select_day_rows,
                                    {"lower": lower, "upper": upper}).scalar_one())
            conn.execute(q.set_ddl_timeouts, {"lock_timeout": LOCK_TIMEOUT,
                                              "statement_timeout": DDL_TIMEOUT})
            conn.execute(q.detach_partition(day))
            conn.execute(q.drop_partition(day))
    except sa.exc.DBAPIError as exc:
        if _sqlstate(exc) not in _NOT_NOW:
            raise
        return -1
    return rows


def prune_runs(conn: sa.Connection, schema: str, *, retention: float, dead_retention: float,
               limit: int) -> int | None:
    """One batch of the rule row by row (`prune_jobs`): rows deleted; None if the lock is
    busy."""
    with _locked(conn, schema) as locked:
        if not locked:
            return None
        return int(conn.execute(queries(schema).prune_jobs, {
            "retention": retention, "dead_retention": dead_retention,
            "limit": limit}).scalar_one())


def move_finished(conn: sa.Connection, schema: str, limit: int) -> int | None:
    """Move up to `limit` finished rows left in `jobs` to history (`move_finished_jobs`),
    after one probe that there are any; rows moved, None if the lock is busy."""
    q = queries(schema)
    with _locked(conn, schema) as locked:
        if not locked:
            return None
        if not conn.execute(q.exists_finished_jobs).scalar():
            return 0
        return int(conn.execute(q.move_finished_jobs, {"limit": limit}).scalar_one())
