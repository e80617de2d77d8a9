"""The verbs of a step's durable state: checkpoints, child runs, batches, run waiters."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from flowq.db.rows import column, read, read_one
from flowq.db.runner import Rows
from flowq.db.schema import Status
from flowq.db.store.base import Verbs

__all__ = ["BatchInfo", "ChildLink", "ChildStatus", "DurableVerbs", "FamilyLink", "RunCheckpoint", "WaitedChild"]


@dataclass(frozen=True)
class ChildLink:
    """What linking a child did: `cancelled` (its parent's run is being cancelled: nothing
    linked; None when the parent's job row does not exist, the test kit's synthetic job) and
    how many links it wrote (0 or 1)."""

    cancelled: bool | None
    linked: int


@dataclass(frozen=True)
class ChildStatus:
    """A child of a run: when it was started, its status derived from its rows (None: its
    rows are gone) and whether they have all finished."""

    run_id: int
    created_at: datetime
    status: Status | None
    finished: bool | None


@dataclass(frozen=True)
class FamilyLink:
    """A run's parent (`kind` 'parent': the step and map instance that started the run) or
    one of its children (`kind` 'child', with its derived status; None: its rows are gone)."""

    kind: str
    run_id: int
    step: str
    map_index: int | None
    name: str
    created_at: datetime
    status: Status | None


@dataclass(frozen=True)
class RunCheckpoint:
    """One checkpoint a run's step recorded: its position in the attempt that recorded it,
    and its stored result (decoded JSON)."""

    step: str
    map_index: int | None
    name: str
    position: int
    result: Any
    created_at: datetime


@dataclass(frozen=True)
class _StoredResult:
    """A row of `select_run_checkpoints`, its result still JSON text."""

    step: str
    map_index: int | None
    name: str
    position: int
    result: str
    created_at: datetime


@dataclass(frozen=True)
class WaitedChild:
    """A job and one child run linked to it (the step that waits for it): the job's status
    and whether it is due; the child's run id, status derived from its rows and whether they
    have all finished (all None for a job waiting on no child; status None: rows gone)."""

    job_id: int
    job_status: Status
    due: bool
    run_id: int | None
    status: Status | None
    finished: bool | None


@dataclass(frozen=True)
class BatchInfo:
    """A batch (`session.batch()`): its callback task and queue, how many runs it waits for
    and how many ended each way, and its callback's run once enqueued (`fired_at`; its
    status None while to come, or once its rows are pruned)."""

    id: int
    task: str
    queue: str
    runs: int
    succeeded: int
    dead: int
    cancelled: int
    created_at: datetime
    fired_at: datetime | None
    callback_run_id: int | None
    callback_status: Status | None

    @property
    def finished(self) -> int:
        """How many of its runs have ended."""
        return self.succeeded + self.dead + self.cancelled


class DurableVerbs(Verbs):
    """Checkpoints, children, batches and waiters."""

    def prune_waiters(self, limit: int) -> int:
        """Delete up to `limit` run waiters whose LISTEN connection is gone; how many."""
        return int(self.run(self.q.prune_waiters, {"limit": limit})[0][0])

    def link_child(self, job_id: int, child_run_id: int, run_id: int, step: str,
                   map_index: int | None, name: str) -> ChildLink:
        """Record run `child_run_id` as a child of (`run_id`, `step`, `map_index`), started
        by job `job_id`'s checkpoint `name`, unless that run is being cancelled (see
        `ChildLink`); the job's row stays locked until the transaction ends."""
        link = read_one(ChildLink, self.run(self.q.insert_child, {
            "job_id": job_id, "child_run_id": child_run_id, "run_id": run_id, "step": step,
            "map_index": map_index, "name": name}))
        if link is None:  # the statement always returns its one row
            raise LookupError("linking a child run returned no row")
        return link

    def children_status(self, run_id: int, run_ids: Sequence[int]
                        ) -> tuple[datetime, list[ChildStatus]]:
        """The database's clock, and the status of those of `run_ids` that are children of
        run `run_id` (the others are left out)."""
        rows = self.run(self.q.select_children_status, {"run_id": run_id,
                                                        "run_ids": list(run_ids)})
        now: datetime = column(rows, "now")[0]
        run_id_at = rows.columns.index("run_id")
        found = Rows(rows.columns, [r for r in rows if r[run_id_at] is not None])
        return now, read(ChildStatus, found)

    def wait_on_children(self, job_id: int, run_id: int, run_ids: Sequence[int]) -> None:
        """Make job `job_id` the waiter of those of `run_ids` that are children of run
        `run_id` started by another of its jobs, so that their end wakes it."""
        self.run(self.q.set_children_waiter, {"job_id": job_id, "run_id": run_id,
                                              "run_ids": list(run_ids)})

    def run_checkpoints(self, run_id: int, limit: int) -> list[RunCheckpoint]:
        """The first `limit` checkpoints of run `run_id`, by step, map instance and position."""
        rows = self.run(self.q.select_run_checkpoints, {"run_id": run_id, "limit": limit})
        return [RunCheckpoint(step=c.step, map_index=c.map_index, name=c.name,
                              position=c.position, result=json.loads(c.result),
                              created_at=c.created_at) for c in read(_StoredResult, rows)]

    def run_family(self, run_id: int, limit: int) -> list[FamilyLink]:
        """Run `run_id`'s parent, if it has one, and its first `limit` children (by run id)."""
        return read(FamilyLink, self.run(self.q.select_run_family,
                                         {"run_id": run_id, "limit": limit}))

    def descendants(self, run_id: int, max_depth: int) -> list[int]:
        """The runs below run `run_id` (its children, theirs, ...) down to `max_depth`
        levels, in run id order."""
        rows = self.run(self.q.select_descendants, {"run_id": run_id, "max_depth": max_depth})
        return [int(i) for i in column(rows, "run_id")]

    def copy_checkpoints(self, source_run_id: int, run_id: int, step: str,
                         names: Sequence[str]) -> list[str]:
        """Record the checkpoints `names` of run `source_run_id`'s step `step` (outside a
        map) for run `run_id` too, as they are (a fork reusing them); the names copied."""
        if not names:
            return []
        rows = self.run(self.q.copy_checkpoints, {
            "source_run_id": source_run_id, "run_id": run_id, "step": step,
            "names": list(names)})
        return [str(n) for n in column(rows, "name")]

    def waited_children(self, job_ids: Sequence[int]) -> list[WaitedChild]:
        """For each of `job_ids` still in `flowq.jobs`, the child runs linked to it, one row
        per (job, child) in that order (see `WaitedChild`): the test kit's drain."""
        return read(WaitedChild, self.run(self.q.select_waited_children,
                                          {"job_ids": list(job_ids)}))

    def wake_jobs(self, job_ids: Sequence[int]) -> list[int]:
        """Make those of `job_ids` that are pending and due later due now; their ids."""
        return [int(i) for i in column(self.run(self.q.wake_jobs, {"job_ids": list(job_ids)}),
                                       "id")]

    def pending_queues(self, run_ids: Sequence[int]) -> list[str]:
        """The queues the runs `run_ids` have pending jobs in, by name."""
        return [str(q) for q in column(self.run(self.q.select_pending_queues,
                                                {"run_ids": list(run_ids)}), "queue")]

    def list_batches(self, limit: int, before: int | None = None) -> list[BatchInfo]:
        """Up to `limit` batches, newest first, with ids below `before` (None: the newest)."""
        return read(BatchInfo, self.run(self.q.select_batches,
                                        {"limit": limit, "before": before}))
