"""The verbs of a step's durable state: checkpoints, child runs, batches, run waiters."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from flowq.db.rows import read
from flowq.db.schema import Status
from flowq.db.store.base import Verbs

__all__ = ["DurableVerbs", "FamilyLink", "RunCheckpoint"]


@dataclass(frozen=True)
class FamilyLink:
    """A run's parent (`kind` 'parent') or one of its children (`kind` 'child', with its
    derived status; None when its rows are gone): the step and map instance that started
    the child, the checkpoint that did, when."""

    kind: str
    run_id: int
    step: str
    map_index: int | None
    name: str
    created_at: datetime
    status: Status | None


@dataclass(frozen=True)
class RunCheckpoint:
    """A recorded checkpoint of a run's step, its result as JSON text."""

    step: str
    map_index: int | None
    name: str
    position: int
    result: str
    created_at: datetime


class DurableVerbs(Verbs):
    """Checkpoints, children, batches and waiters."""

    # -- a run's family and checkpoints as `flowq.ops.runinfo` shows them (appended by the
    # runs slice) --------------------------------------------------------------------------

    def run_family(self, run_id: int, limit: int) -> list[FamilyLink]:
        """Run `run_id`'s parent (`kind` 'parent') and its first `limit` children (`kind`
        'child', with their derived status)."""
        return read(FamilyLink, self.run(self.q.select_run_family,
                                      {"run_id": run_id, "limit": limit}))

    def run_checkpoints(self, run_id: int, limit: int) -> list[RunCheckpoint]:
        """Run `run_id`'s first `limit` checkpoints, by step, map instance and position."""
        return read(RunCheckpoint, self.run(self.q.select_run_checkpoints,
                                            {"run_id": run_id, "limit": limit}))
