"""The verbs of runs and their history: inspection, listing, cancel, retry, fork, redrive."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from flowq.db.rows import column, read
from flowq.db.store.base import Verbs

__all__ = ["DueTime", "MatchedJob", "RunVerbs", "RunningRow"]


class RunVerbs(Verbs):
    """Runs as operators read and act on them."""

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
