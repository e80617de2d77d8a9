"""The worker's own parts, borrowed without their threads or connections, so that the test
kit decides outcomes and writes them exactly as a worker would.

`judge(app, session_factory)` is an `Executor` that is never started: its outcome rules
(`_resolve`, `_prepare`, `_outcome_of_result`, `_exception_outcome`, `_failure`) need neither
its threads nor its completer. `writer(schema)` is a `Completer` that is never started: its
`_write_successes` and `_write_other` send the fenced statements through whatever `run`
callable they are given (here, the test's own connection), and never touch its connection.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.sql.elements import TextClause

from flowq.context import StepSession
from flowq.db.rows import ClaimedJob
from flowq.db.sql import queries
from flowq.define.app import FlowQ
from flowq.worker.completer import Completer
from flowq.worker.connection import DedicatedConnection
from flowq.worker.executor import Executor, _Running

__all__ = ["judge", "record", "runner", "writer"]


def _ignore(in_flight: int) -> None:
    pass


def judge(app: FlowQ, session_factory: Callable[[], StepSession]) -> Executor:
    return Executor(app, cast(Completer, None), concurrency=0,
                    session_factory=session_factory, on_slot_free=_ignore)


def writer(schema: str) -> Completer:
    return Completer(cast(DedicatedConnection, None), queries(schema), job_log=False)


def record(executor: Executor, job: ClaimedJob) -> _Running:
    """The executor's record of one attempt of `job`, started now, with no deadline (a
    handler run in the test's own thread cannot be abandoned)."""
    return _Running(job, time.monotonic(), None, executor._resolve(job))


def runner(conn: sa.Connection) -> Callable[[TextClause, Mapping[str, Any]],
                                             list[tuple[Any, ...]]]:
    """The completer's `run` callable over `conn`: one named statement, its rows as tuples."""
    def run(clause: TextClause, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in conn.execute(clause, params)]

    return run
