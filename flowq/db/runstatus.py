"""A run's status, derived from its rows: the one rule, rendered for Python and for SQL.

A run has no row of its own (`flowq.db.schema`): its status is derived from the statuses of
its `flowq.jobs` rows and their `cancel_requested` flags, by `RUN_STATUS_RULE`, read top to
bottom, the first match wins:

- `cancelled` if any row is `cancelled` or has `cancel_requested` (a running step that was
  asked to stop still finishes);
- else `running`, `pending` or `waiting` while any row is (in that order);
- else `dead` if any row is dead, else `succeeded`. Every step a success unblocks is
  created in the very transaction that records the success, so a run whose rows have all
  succeeded has reached all its leaves: no snapshot shows a success without its successors.

`run_status` applies the rule to rows in Python (`flowq.ops.runinfo`); `run_status_sql`
renders it as the aggregate CASE the statements that list runs, children and batches use
(`flowq.db.sql.fragments.RUN_STATUS`). Both are built from the one table, and
tests/integration/test_run_status.py checks they agree on every shape of run.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from flowq.db.schema import Status

__all__ = ["OTHERWISE", "RUN_STATUS_RULE", "run_status", "run_status_sql"]

# (the run's status, the row statuses that give it, whether `cancel_requested` on any row
# gives it too), in order: the first line with a matching row decides.
RUN_STATUS_RULE: Final[tuple[tuple[Status, tuple[Status, ...], bool], ...]] = (
    ("cancelled", ("cancelled",), True),
    ("running", ("running",), False),
    ("pending", ("pending",), False),
    ("waiting", ("waiting",), False),
    ("dead", ("dead",), False),
)
# A run none of whose rows matches a line of the rule (all of them succeeded).
OTHERWISE: Final[Status] = "succeeded"


def run_status(rows: Iterable[tuple[str, bool]]) -> Status:
    """A run's status from its rows' (status, cancel_requested) pairs (see the module)."""
    seen: set[str] = set()
    requested = False
    for status, cancel_requested in rows:
        seen.add(status)
        requested = requested or bool(cancel_requested)
    for result, statuses, by_request in RUN_STATUS_RULE:
        if (by_request and requested) or not seen.isdisjoint(statuses):
            return result
    return OTHERWISE


def run_status_sql(status: str = "status", cancel_requested: str = "cancel_requested") -> str:
    """The rule as an aggregate SQL CASE over a run's rows (columns `status` and
    `cancel_requested`, grouped by run)."""
    whens = []
    for result, statuses, by_request in RUN_STATUS_RULE:
        test = " OR ".join([f"{status} = '{s}'" for s in statuses]
                           + ([cancel_requested] if by_request else []))
        whens.append(f"WHEN bool_or({test}) THEN '{result}'")
    return "CASE " + "\n                      ".join(whens) + f" ELSE '{OTHERWISE}' END"
