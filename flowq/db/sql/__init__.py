"""Every SQL statement flowq sends, split by table, named verb_noun, one templating style.

Each module holds the statements of one table (or of one concern on it) as a set extending
`fragments.Statements`; `Queries` is all of them for one schema, and `queries(schema)` its
one instance per process (each statement compiles once, on first use):

- `claims`: the claim and every write after it (heartbeat, retry, end, release, reap),
  fenced on (id, lease); `completions`: a success's (complete, with what it spawns);
  `jobs`: enqueue and the reads of job rows outside a claim;
- `queues`, `permits`, `signals`, `workers`, `uniques`, `schedules`, `checkpoints`,
  `children`, `waiters` (`flowq.run_waiters`): the table of that name;
- `runs`: the rows of one run (inspection, cancel, retry, filters, redrive); `deadlines`:
  cancelling the runs whose deadline passed (the reaper's); `batches`: `session.batch()`;
- `admin`: the database itself (schema check, locks, clocks, health);
- `dashboard`: the dashboard's bounded reads (activity over time, running jobs, search);
- `history`: retention (whole runs by rows, whole days by partition) and the day
  partitions of `flowq.job_history`.

Every write after the claim is fenced: it only touches a row that is still `running` under
the lease the worker claimed it with. A lease comes from a sequence on every claim and is
never reused, so a worker presumed dead that comes back can change nothing, however often
the job was claimed, released or retried since. All times are the database's `now()`.

Statements are sent through a `flowq.db.runner.Runner`; `flowq.db.store` wraps the ones the
worker sends in typed verbs that build every parameter and read rows by column name.
"""

from __future__ import annotations

from functools import cache

from flowq.db.sql.admin import AdminStatements
from flowq.db.sql.batches import BatchStatements
from flowq.db.sql.checkpoints import CheckpointStatements
from flowq.db.sql.children import ChildStatements
from flowq.db.sql.claims import ClaimStatements
from flowq.db.sql.completions import CompletionStatements
from flowq.db.sql.dashboard import DashboardStatements
from flowq.db.sql.deadlines import DeadlineStatements
from flowq.db.sql.history import HistoryStatements
from flowq.db.sql.jobs import JobStatements
from flowq.db.sql.permits import PermitStatements
from flowq.db.sql.queues import QueueStatements
from flowq.db.sql.runs import RunStatements
from flowq.db.sql.schedules import ScheduleStatements
from flowq.db.sql.signals import SignalStatements
from flowq.db.sql.uniques import UniqueStatements
from flowq.db.sql.waiters import WaiterStatements
from flowq.db.sql.workers import WorkerStatements

__all__ = ["Queries", "queries"]


class Queries(ClaimStatements, CompletionStatements, JobStatements, QueueStatements, PermitStatements,
              SignalStatements, WorkerStatements, RunStatements, UniqueStatements,
              ScheduleStatements, AdminStatements, DashboardStatements,
              CheckpointStatements, DeadlineStatements, BatchStatements, ChildStatements,
              WaiterStatements, HistoryStatements):
    """The statements for one flowq schema, every table's."""


@cache
def queries(schema: str) -> Queries:
    """The statements of `schema`, built once per process (each compiles once, on first use)."""
    return Queries(schema)
