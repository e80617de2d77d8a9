"""The test kit for code that uses flowq, shipped with it (flowq's own tests use it too).

- Assertions (`flowq.testing.assertions`): `assert_enqueued`, `refute_enqueued`,
  `all_enqueued` through a Session, Connection or Engine (a Session or Connection sees its own
  uncommitted jobs), and their asyncio twins `aassert_enqueued`, `arefute_enqueued`,
  `aall_enqueued`.
- Running jobs in the test (`flowq.testing.draining`): `drain(target, app)` runs every due
  job in this thread (the children a step waits for and batch callbacks included), inside
  the test's transaction when given a Session or Connection, and returns a `DrainResult`;
  `adrain` for an AsyncSession or AsyncConnection.
- One handler (`flowq.testing.steps`): `run_step(task_or_step, session=..., **args)`,
  `arun_step`, `make_context`.
- Waiting and looking (`flowq.testing.helpers`): `wait_until`, `run_until_idle` (a real
  threaded worker), `job_rows`.
- pytest fixtures (`flowq.testing.pytest_plugin`, not imported here): `flowq_database_url`,
  `flowq_engine`, `flowq_session`.

See docs/testing.md.
"""

from __future__ import annotations

from flowq.testing.assertions import (
    aall_enqueued,
    aassert_enqueued,
    all_enqueued,
    arefute_enqueued,
    assert_enqueued,
    refute_enqueued,
)
from flowq.testing.draining import DrainResult, adrain, drain
from flowq.testing.helpers import job_rows, run_until_idle, running_worker, wait_until
from flowq.testing.steps import arun_step, make_context, run_step

__all__ = [
    "DrainResult",
    "aall_enqueued",
    "aassert_enqueued",
    "adrain",
    "all_enqueued",
    "arefute_enqueued",
    "arun_step",
    "assert_enqueued",
    "drain",
    "job_rows",
    "make_context",
    "refute_enqueued",
    "run_step",
    "run_until_idle",
    "running_worker",
    "wait_until",
]
