"""Where the bench reads job rows, and what each of the two job tables costs the server.

Since revision 0018 a row lives in `flowq.jobs` while it is pending, running or waiting and in
`flowq.job_history` (partitioned by `retired_at`) once it has ended; the view `flowq.steps`
reads both. So the bench counts outcomes, results and finish times in `STEPS` (or `HISTORY`
when only finished rows are meant), waits for live rows in `JOBS` (cheap: the hot table holds
the backlog only, and a finished row never comes back to it), and reports what each table
costs on its own, each named: `JOBS` with its indexes and TOAST, `HISTORY` summed over its
partitions (`pg_partition_tree`, so a day's partition created after the migration counts too;
the partitioned parent and its partitioned indexes have no storage of their own).

- `TableCosts.read(conn)`: both tables' total sizes (bytes) and dead tuples
  (`pg_stat_user_tables`, updated asynchronously: indicative), in one statement.
- `JOBS_SIZE`, `HISTORY_SIZE`, `JOBS_DEAD`, `HISTORY_DEAD`: the same as scalar subqueries, for
  statements that read them beside other figures in one snapshot.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Final

import sqlalchemy as sa

__all__ = ["HISTORY", "HISTORY_DEAD", "HISTORY_PARTITIONS", "HISTORY_SIZE", "JOBS",
           "JOBS_DEAD", "JOBS_SIZE", "STEPS", "TableCosts"]

JOBS: Final = "flowq.jobs"  # live rows: pending, running, waiting
HISTORY: Final = "flowq.job_history"  # finished rows: succeeded, dead, cancelled
STEPS: Final = "flowq.steps"  # both (a view), `retired_at` NULL for a live row

# Every leaf partition of job_history (the DEFAULT one and any day's).
HISTORY_PARTITIONS: Final = (
    f"SELECT relid FROM pg_partition_tree('{HISTORY}'::regclass) WHERE isleaf")

JOBS_SIZE: Final = f"pg_total_relation_size('{JOBS}'::regclass)"
HISTORY_SIZE: Final = (f"(SELECT coalesce(sum(pg_total_relation_size(relid)), 0)::bigint "
                       f"FROM ({HISTORY_PARTITIONS}) p)")
JOBS_DEAD: Final = (f"(SELECT coalesce(n_dead_tup, 0) FROM pg_stat_user_tables "
                    f"WHERE relid = '{JOBS}'::regclass)")
HISTORY_DEAD: Final = (f"(SELECT coalesce(sum(n_dead_tup), 0)::bigint FROM pg_stat_user_tables "
                       f"WHERE relid IN ({HISTORY_PARTITIONS}))")

_COSTS: Final = sa.text(f"SELECT {JOBS_SIZE} AS jobs_size, {HISTORY_SIZE} AS history_size, "
                        f"{JOBS_DEAD} AS jobs_dead, {HISTORY_DEAD} AS history_dead")


@dataclass(frozen=True)
class TableCosts:
    """Size (bytes, with indexes and TOAST) and dead tuples of each job table."""

    jobs_size: int
    history_size: int
    jobs_dead: int
    history_dead: int

    @classmethod
    def read(cls, conn: sa.Connection) -> TableCosts:
        row = conn.execute(_COSTS).one()
        return cls(int(row.jobs_size), int(row.history_size), int(row.jobs_dead or 0),
                   int(row.history_dead or 0))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
