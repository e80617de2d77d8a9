"""Runs: inspect a run and its steps, wait for it, cancel it, retry what died.

This is the runs API (`flowq runs` and the dashboard are thin layers over it). What a run is
as read from its rows, and how its status is derived, is `flowq.ops.runinfo`; the filters
of `list_runs` and `retry_runs`, `flowq.ops.filters`.

`cancel_run` ends pending and waiting steps `cancelled` and flags running ones with
`cancel_requested`: their handlers finish (and their `ctx.session` writes commit) but they
create no successor and count towards no join. It does the same to the run's unfinished
child runs (`ctx.start_child`, see `flowq.children`), theirs, and so on, in the same
transaction (down to `flowq.children.MAX_DEPTH` levels). Cancelling a run that is already cancelled
changes nothing; cancelling a succeeded or dead run raises `RunStateError`.

`retry_run` resumes a `dead` run: every dead step (and dead map instance) goes back to
`pending`, due now, with its attempts reset to 0 so its retry policy starts afresh (a step
whose signal never came waits for it again, for its timeout); its `last_error` is kept until
the next attempt ends, and nothing that succeeded runs again. Retrying a run that is not
dead raises `RunStateError`. `retry_runs` does the same to every dead run matching filters,
in batches (see there).

Both take row locks on the whole run first, so they never race a completing step. Every
function takes an Engine (one transaction of its own) or a Connection (joins its open
transaction, which the caller commits; else commits its own). `wait_run` (and the async
`await_run`) wait until a run has finished, woken by a notification (`flowq.ops.results`,
which also has `get_result`); `fork` starts a new run from a step of an old one
(`flowq.ops.fork`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

import sqlalchemy as sa

from flowq.db.history import hold_retention
from flowq.db.schema import STATUSES, Status
from flowq.db.store import Store
from flowq.db.store.runs import RunWindow
from flowq.errors import InvalidArgumentsError, RunStateError
from flowq.names import DEFAULT_SCHEMA, check_id
from flowq.ops import binds
from flowq.ops.binds import Bind
from flowq.ops.filters import When, check_count, parse_when, run_filters
from flowq.ops.fork import ForkCheckpoint, Forked, ForkPlan, fork, plan_fork
from flowq.ops.results import await_run, get_result, wait_run
from flowq.ops.runinfo import (
    RunInfo,
    RunSummary,
    StepGroup,
    StepInfo,
    read_run,
    run_status,
)

__all__ = [
    "CancelResult",
    "DeadStep",
    "ForkCheckpoint",
    "ForkPlan",
    "Forked",
    "KnownNames",
    "RetryResult",
    "RunInfo",
    "RunSummary",
    "StepGroup",
    "StepInfo",
    "UnservedJobs",
    "When",
    "await_run",
    "cancel_run",
    "dead_steps",
    "find_run",
    "fork",
    "get_result",
    "get_run",
    "known_names",
    "list_runs",
    "parse_when",
    "plan_fork",
    "retry_run",
    "retry_runs",
    "run_status",
    "unserved_jobs",
    "wait_run",
]

DEFAULT_LIST_LIMIT: Final = 50
# How many runs `retry_runs` retries per transaction.
DEFAULT_RETRY_BATCH: Final = 500
# A worker heartbeats its registry entry every --heartbeat-interval (5 s by default): one
# silent for a minute is gone.
UNSERVED_STALE_AFTER: Final = 60.0
# Each pass locks what the previous one saw plus what completions created meanwhile: the set
# settles in a few passes; the cap only guards against a bug turning this into a loop.
_MAX_LOCK_PASSES: Final = 100


@dataclass(frozen=True)
class CancelResult:
    """What `cancel_run` changed: job ids cancelled outright, and running ones asked to stop."""

    run: RunInfo
    cancelled: tuple[int, ...]
    cancel_requested: tuple[int, ...]
    # The descendant runs (children, grandchildren, ...) that had a step cancelled or
    # flagged with the run.
    child_runs: tuple[int, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.cancelled or self.cancel_requested or self.child_runs)

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run.run_id, "cancelled_job_ids": list(self.cancelled),
                "cancel_requested_job_ids": list(self.cancel_requested),
                "cancelled_child_run_ids": list(self.child_runs),
                "run": self.run.to_dict()}


@dataclass(frozen=True)
class RetryResult:
    """What `retry_run` changed: the dead steps that run again (`job_id` and `step` are the
    first of them)."""

    run: RunInfo
    job_id: int
    step: str
    job_ids: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run.run_id, "retried_job_id": self.job_id,
                "retried_step": self.step, "retried_job_ids": list(self.job_ids),
                "run": self.run.to_dict()}


def get_run(bind: Bind, run_id: int, schema: str = DEFAULT_SCHEMA) -> RunInfo:
    """The run `run_id` with all its steps; RunNotFoundError if no row of it exists."""
    run_id = check_id(run_id)
    return binds.read(bind, lambda conn: read_run(conn, schema, run_id))


def find_run(bind: Bind, key: str, schema: str = DEFAULT_SCHEMA) -> int | None:
    """The run id of the run holding idempotency key `key`, or None."""
    if not isinstance(key, str):
        raise InvalidArgumentsError(f"an idempotency key is text, got {key!r}")
    return binds.read(bind, lambda conn: Store.of(conn, schema).find_run(key))


@dataclass(frozen=True)
class DeadStep:
    """The first dead step of a dead run, and why it died."""

    run_id: int
    step: str
    map_index: int | None
    last_error: str | None


def dead_steps(bind: Bind, run_ids: Sequence[int],
               schema: str = DEFAULT_SCHEMA) -> dict[int, DeadStep]:
    """For each of `run_ids` that has a dead step, its first one (the dead-letter view)."""
    ids = [check_id(i) for i in run_ids]
    if not ids:
        return {}
    return binds.read(bind, lambda conn: {
        r.run_id: DeadStep(r.run_id, r.step, r.map_index, r.last_error)
        for r in Store.of(conn, schema).dead_errors(ids)})


def list_runs(bind: Bind, *, status: Status | None = None, task: str | None = None,
              queue: str | None = None, since: When | None = None, until: When | None = None,
              before: int | None = None, limit: int = DEFAULT_LIST_LIMIT,
              schema: str = DEFAULT_SCHEMA, version: int | None = None) -> list[RunSummary]:
    """The newest `limit` runs, newest first, below run id `before` if given (the next page
    starts below the last run id of this one), optionally only those with derived `status`,
    of `task`, with a step on `queue`, created in [`since`, `until`), started on pipeline
    version `version` (by the fingerprints `flowq.definitions` records for it; a run of
    unrecorded definition matches no version) (see the module docstring). Cost:
    `flowq.db.sql.runs` (a page walks the run id index from the cursor until it has `limit`
    matches)."""
    if status is not None and status not in STATUSES:
        raise InvalidArgumentsError(f"status must be one of {', '.join(STATUSES)}, "
                                    f"got {status!r}")
    if before is not None:
        before = check_count("before (a run id)", before, 1)
    filters = run_filters(task, queue, since, until, version)
    limit = max(0, int(limit))

    def read(conn: sa.Connection) -> list[RunSummary]:
        store = Store.of(conn, schema)
        rows = store.list_runs(filters.window(store), status=status, before=before,
                               limit=limit)
        return [RunSummary(run_id=r.run_id, task=r.task, status=r.status, step=r.step,
                           step_index=r.step_index, idempotency_key=r.idempotency_key,
                           created_at=r.created_at, finished_at=r.finished_at) for r in rows]

    return binds.read(bind, read)


# How many of the latest runs `known_names` reads the task names of (a page of the run id
# index: cheap at any table size).
KNOWN_NAMES_RUNS: Final = 500


@dataclass(frozen=True)
class KnownNames:
    """Task and queue names a database knows of, for a "did you mean" (not a full list)."""

    tasks: list[str]
    queues: list[str]


def known_names(bind: Bind, *, schema: str = DEFAULT_SCHEMA) -> KnownNames:
    """The task names of the latest `KNOWN_NAMES_RUNS` runs and of the apps imported here,
    and the queues that have jobs or a declaration (`flowq.ops.queues.list_queues`): what a
    filter that matched nothing is compared against. Bounded: no scan of the jobs table."""
    from flowq.define.app import defined_names
    from flowq.ops.queues import list_queues

    def read(conn: sa.Connection) -> KnownNames:
        runs = list_runs(conn, limit=KNOWN_NAMES_RUNS, schema=schema)
        tasks = {r.task for r in runs} | set(defined_names(schema))
        return KnownNames(sorted(tasks), [q.name for q in list_queues(conn, schema=schema)])

    return binds.read(bind, read)


@dataclass(frozen=True)
class UnservedJobs:
    """Due jobs of one task on one queue that no live worker serves (none listens on the
    queue with the task in its app): they wait until one starts."""

    queue: str
    task: str
    jobs: int
    oldest_due_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def unserved_jobs(bind: Bind, *, schema: str = DEFAULT_SCHEMA,
                  stale_after: float = UNSERVED_STALE_AFTER,
                  limit: int = 20) -> list[UnservedJobs]:
    """Due jobs no live worker serves, by (queue, task), largest groups first. A worker is
    live while its registry heartbeat (`flowq.workers`) is younger than `stale_after`."""
    def read(conn: sa.Connection) -> list[UnservedJobs]:
        rows = Store.of(conn, schema).unserved_jobs(stale_after, limit)
        return [UnservedJobs(r.queue, r.task, r.n, r.oldest_s) for r in rows]

    return binds.read(bind, read)


# -- control ----------------------------------------------------------------------------------


def _lock(conn: sa.Connection, store: Store, run_id: int) -> RunInfo:
    """Lock every row of the run, then read it: no step of it can complete until we commit,
    and no retention pass moves or deletes its rows (`flowq.db.history.hold_retention`)."""
    hold_retention(conn, store.schema)
    # Never done after one pass, even one that locked nothing: a pass that waited for a
    # completion finds its row deleted (moved to history by a statement newer than the
    # pass's snapshot), so it can come back empty while the run goes on.
    seen: set[int] | None = None
    for _ in range(_MAX_LOCK_PASSES):
        ids = store.lock_run(run_id)
        if ids == seen:
            break
        seen = ids
    return read_run(conn, store, run_id)


def cancel_run(bind: Bind, run_id: int, schema: str = DEFAULT_SCHEMA, *,
               reason: str = "cancelled by flowq.ops.runs.cancel_run") -> CancelResult:
    """Cancel the run: pending steps become `cancelled` (with `reason` as their last_error),
    a running step is flagged so that it creates no successor when it finishes.

    Its unfinished descendants (child runs, recursively) are cancelled with it, their
    steps' last_error naming the run. A run already cancelled is left alone, but for
    descendants started since (a child a step started before it saw the cancel). A dead
    run stays dead (retry it, or leave it) and only its unfinished descendants are
    cancelled: a parent that died leaves its children running, for a retry that waits for
    them again. A succeeded run, or a dead one with nothing unfinished below it, raises
    RunStateError.
    """
    from flowq.durable.children import MAX_DEPTH

    run_id = check_id(run_id)
    with binds.transaction(bind) as conn:
        store = Store.of(conn, schema)
        run = _lock(conn, store, run_id)
        ended = RunStateError(f"run {run_id} already ended {run.status}: there is nothing "
                              "to cancel" + (" (retry it, or leave it)"
                                             if run.status == "dead" else ""))
        if run.status == "succeeded":
            raise ended
        rows = [] if run.status == "dead" else store.cancel_runs([run_id], reason)
        # After the run's rows are locked: a child started before commits its link first
        # (the link locks the parent's row, flowq.db.sql.children), one started after
        # sees the cancel and starts nothing.
        below = store.descendants(run_id, MAX_DEPTH)
        children: set[int] = set()
        if below:
            _lock_runs(conn, store, below)
            children = {r.run_id for r in store.cancel_runs(
                below, f"{reason} (with its parent run {run_id})")}
        if run.status == "dead" and not children:
            raise ended  # nothing was written: the transaction rolls back
        after = read_run(conn, store, run_id)
    return CancelResult(
        run=after,
        cancelled=tuple(sorted(r.id for r in rows if r.status == "cancelled")),
        cancel_requested=tuple(sorted(r.id for r in rows if r.status == "running")),
        child_runs=tuple(sorted(children)))


def retry_run(bind: Bind, run_id: int, schema: str = DEFAULT_SCHEMA) -> RetryResult:
    """Resume a dead run: every dead step (and dead map instance) runs again, due now, with a
    fresh attempt budget; what succeeded is kept and never re-run. RunStateError unless the
    run is dead."""
    run_id = check_id(run_id)
    with binds.transaction(bind) as conn:
        store = Store.of(conn, schema)
        run = _lock(conn, store, run_id)
        if run.status != "dead":
            raise RunStateError(f"run {run_id} is {run.status}, not dead: only a dead run can "
                                "be retried")
        ids = store.retry_dead(run_id)
        after = read_run(conn, store, run_id)
    first = next(s for s in after.steps if s.job_id == ids[0])
    return RetryResult(run=after, job_id=first.job_id, step=first.step, job_ids=tuple(ids))


def _lock_runs(conn: sa.Connection, store: Store, run_ids: list[int]) -> None:
    """`_lock` for many runs: every row of each, in id order, until the set stops growing."""
    hold_retention(conn, store.schema)
    seen: set[int] | None = None  # as in `_lock`: two passes at least
    for _ in range(_MAX_LOCK_PASSES):
        ids = store.lock_runs(run_ids)
        if ids == seen:
            break
        seen = ids


def retry_runs(bind: Bind, *, status: str = "dead", task: str | None = None,
               queue: str | None = None, since: When | None = None, until: When | None = None,
               limit: int | None = None, batch_size: int = DEFAULT_RETRY_BATCH,
               schema: str = DEFAULT_SCHEMA,
               on_batch: Callable[[int], None] | None = None) -> int:
    """Retry every dead run matching the filters (see the module docstring; at most `limit`
    runs), as `retry_run` does each one; return how many runs were retried (0 when none
    matches: not an error). `on_batch(total)` is called after each committed batch with
    the runs retried so far (a long redrive's progress).

    In batches of `batch_size` runs, oldest first, each in a transaction of its own (on an
    Engine, or a Connection outside a transaction; a Connection's open transaction is
    joined instead, and the caller commits it all). A batch picks its runs without locks,
    locks every row of them (as `retry_run` does), and retries those still dead; a run
    that changed meanwhile (retried, cancelled, pruned) is skipped. Each batch starts after
    the previous one's last run id, so the whole redrive walks the runs once, and a run
    that dies again while it goes on is not retried twice. Durations ago (`since="1h"`)
    are measured once, at the start."""
    if status != "dead":
        raise InvalidArgumentsError(f"only dead runs can be retried: status must be 'dead', "
                                    f"got {status!r}")
    if limit is not None:
        limit = check_count("limit", limit, 1)
    batch_size = check_count("batch_size", batch_size, 1)
    filters = run_filters(task, queue, since, until)
    window: RunWindow | None = None
    after: int | None = None
    total = 0
    while limit is None or total < limit:
        size = batch_size if limit is None else min(batch_size, limit - total)
        with binds.transaction(bind) as conn:
            store = Store.of(conn, schema)
            if window is None:
                window = filters.window(store)  # a duration ago is measured once
            picked = store.dead_runs(window, after=after, limit=size)
            if picked:
                _lock_runs(conn, store, picked)
                total += store.retry_dead_runs(picked)
        if on_batch is not None and picked:
            on_batch(total)
        if len(picked) < size:
            break
        after = picked[-1]
    return total
