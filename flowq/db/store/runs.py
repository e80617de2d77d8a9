"""The verbs of runs and their history: inspection, listing, cancel, retry, fork, redrive.

A run is the rows of one `run_id` (`flowq.db.schema`), live and finished (`steps`). Reads
give back `RunJob` (a row as `flowq.ops.runinfo` reads it) and `RunLine` (a run in a list);
the filters of a page of runs are a `RunWindow` (already checked and resolved to times by
`flowq.ops.filters`). The locks are taken in the order `flowq.db.sql.runs` states (finished
rows, then live ones, each in id order): call them until the set stops growing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from flowq.db.rows import column, read
from flowq.db.schema import Status
from flowq.db.store.base import Verbs

__all__ = ["CancelledJob", "DeadError", "DueTime", "MatchedJob", "RunJob", "RunLine", "RunVerbs", "RunWindow", "RunningRow"]


@dataclass(frozen=True)
class RunJob:
    """One row of a run, every column `flowq.ops.runinfo` reads, with the pipeline version
    its definition's fingerprint was recorded under (None: unrecorded)."""

    id: int
    run_id: int
    task: str
    step: str
    step_index: int
    queue: str
    status: Status
    priority: int
    attempts: int
    max_attempts: int
    args: Any
    result: Any
    last_error: str | None
    idempotency_key: str | None
    cancel_requested: bool
    run_at: datetime
    locked_at: datetime | None
    heartbeat_at: datetime | None
    locked_by: str | None
    created_at: datetime
    finished_at: datetime | None
    map_index: int | None
    started_at: datetime | None
    attempt_log: Any
    progress: Any
    forked_from: int | None
    deadline: datetime | None
    fingerprint: str | None
    version: int | None


@dataclass(frozen=True)
class RunLine:
    """A run in a page of runs: its latest step, its derived status, its first row's
    creation and its latest row's end."""

    run_id: int
    task: str
    step: str
    step_index: int
    status: Status
    idempotency_key: str | None
    created_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True)
class RunWindow:
    """Which runs a page holds (None: any): of `task`, started under one of `fingerprints`,
    with a step on `queue`, created in [`since`, `until`)."""

    task: str | None = None
    queue: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    fingerprints: list[str] | None = None

    def params(self) -> dict[str, Any]:
        return {"task": self.task, "queue": self.queue, "since": self.since,
                "until": self.until, "fingerprints": self.fingerprints}


@dataclass(frozen=True)
class CancelledJob:
    """A row a cancellation changed: `cancelled` outright, or `running` and asked to stop."""

    id: int
    run_id: int
    status: str


@dataclass(frozen=True)
class DeadError:
    """A dead run's first dead step and that step's error."""

    run_id: int
    step: str
    map_index: int | None
    last_error: str | None


class RunVerbs(Verbs):
    """Runs as operators read and act on them."""

    # -- reads -------------------------------------------------------------------------------

    def run_jobs(self, run_id: int) -> list[RunJob]:
        """Every row of run `run_id`, in step order, in one snapshot (a success and the
        successors it inserted are seen together or not at all)."""
        return read(RunJob, self.run(self.q.select_run_jobs, {"run_id": run_id}))

    def runs_jobs(self, run_ids: Sequence[int]) -> list[RunJob]:
        """`run_jobs` of several runs, by run, in one statement (one snapshot)."""
        return read(RunJob, self.run(self.q.select_runs_jobs, {"run_ids": list(run_ids)}))

    def list_runs(self, window: RunWindow, *, status: Status | None, before: int | None,
                  limit: int) -> list[RunLine]:
        """The newest `limit` runs in `window` below run id `before` (None: the newest),
        only those of derived `status` if given."""
        return read(RunLine, self.run(self.q.list_runs, {
            **window.params(), "status": status, "before": before, "limit": limit}))

    def dead_runs(self, window: RunWindow, *, after: int | None, limit: int) -> list[int]:
        """The oldest `limit` dead runs in `window` above run id `after`, without locks (a
        batch of a bulk redrive: lock and check them again)."""
        return [int(i) for i in column(self.run(self.q.select_dead_runs, {
            **window.params(), "after": after, "limit": limit}), "run_id")]

    def find_run(self, idempotency_key: str) -> int | None:
        """The run holding `idempotency_key`, or None."""
        ids = column(self.run(self.q.find_run_by_key, {"idempotency_key": idempotency_key}),
                     "run_id")
        return int(ids[0]) if ids else None

    def dead_errors(self, run_ids: Sequence[int]) -> list[DeadError]:
        """For each of `run_ids` with a dead step, its first one and why it died."""
        return read(DeadError, self.run(self.q.select_dead_errors, {"run_ids": list(run_ids)}))

    # -- control -----------------------------------------------------------------------------

    def lock_run(self, run_id: int) -> set[int]:
        """Lock every row of run `run_id` (waiting for an in-flight completion); their ids.
        Repeat until the set stops growing (`flowq.db.sql.runs`)."""
        return {int(i) for i in column(self.run(self.q.lock_run_jobs, {"run_id": run_id}),
                                       "id")}

    def lock_runs(self, run_ids: Sequence[int]) -> set[int]:
        """`lock_run` for several runs, in id order."""
        return {int(i) for i in column(self.run(self.q.lock_runs_jobs,
                                                {"run_ids": list(run_ids)}), "id")}

    def cancel_runs(self, run_ids: Sequence[int], error: str) -> list[CancelledJob]:
        """Cancel the runs `run_ids` (locked first): pending and waiting rows end `cancelled`
        with `error`, running ones are asked to stop."""
        return read(CancelledJob, self.run(self.q.cancel_run_jobs,
                                           {"run_ids": list(run_ids), "error": error}))

    def retry_dead(self, run_id: int) -> list[int]:
        """Send run `run_id`'s dead steps back with a fresh attempt budget, waking their
        queues at commit; their ids, sorted."""
        rows = self.run(self.q.retry_dead_jobs, {"run_id": run_id, "channel": self.channel})
        return sorted(int(i) for i in column(rows, "id"))

    def retry_dead_runs(self, run_ids: Sequence[int]) -> int:
        """`retry_dead` for those of `run_ids` (locked first) still dead; how many runs."""
        return len(self.run(self.q.retry_dead_runs,
                            {"run_ids": list(run_ids), "channel": self.channel}))

    def mark_forked(self, run_id: int, source: int) -> None:
        """Record on new run `run_id`'s first rows that it was forked from run `source`."""
        self.run(self.q.mark_forked_run, {"run_id": run_id, "source": source})

    # -- the dashboard's bounded reads (flowq.dashboard.reads) ---------------------------------

    def running_rows(self, limit: int) -> list[RunningRow]:
        """Up to `limit` running rows, the longest running first, with their worker."""
        return read(RunningRow, self.run(self.q.select_running_jobs, {"limit": limit}))

    def find_jobs_by_args(self, args_json: str, limit: int) -> list[MatchedJob]:
        """Up to `limit` rows, newest first, whose arguments contain `args_json` (no index:
        bound it with a statement timeout too)."""
        return read(MatchedJob, self.run(self.q.find_jobs_by_args,
                                         {"args": args_json, "limit": limit}))

    def due_times(self, run_ids: Sequence[int]) -> list[DueTime]:
        """When the pending steps of each of `run_ids` are due (runs with none left out)."""
        return read(DueTime, self.run(self.q.select_due_times, {"run_ids": list(run_ids)}))

    def known_tasks(self, recent: int, limit: int) -> list[str]:
        """The tasks workers registered and those of the newest `recent` rows, sorted, at
        most `limit`."""
        return list(column(self.run(self.q.select_known_tasks,
                                    {"recent": recent, "limit": limit}), "task"))


@dataclass(frozen=True)
class RunningRow:
    """A running row and the worker holding it (`locked_by`), since `locked_at`."""

    id: int
    run_id: int
    task: str
    step: str
    queue: str
    attempts: int
    max_attempts: int
    locked_by: str | None
    locked_at: datetime | None
    running_s: float


@dataclass(frozen=True)
class MatchedJob:
    """A job row whose arguments matched a search."""

    id: int
    run_id: int
    task: str
    step: str
    queue: str
    status: str
    created_at: datetime


@dataclass(frozen=True)
class DueTime:
    """When a run's pending steps are due: the earliest of their `run_at`."""

    run_id: int
    due_at: datetime
