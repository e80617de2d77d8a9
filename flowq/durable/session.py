"""The Session behind `ctx.session`: `StepSession`, which flowq commits with the step.

Its writes commit in the same transaction that records the step's success (or a checkpoint),
so a worker that lost its claim rolls them back. flowq owns that commit
(`commit_step_session`, called by the worker, the checkpoints and the test kit); a handler
calling `commit()` gets an error. The server process of its open transaction is kept in
`backend_pid`, so an attempt abandoned at its timeout can have that transaction ended.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, event

from flowq.enqueueing.sync import Session
from flowq.errors import ContextError

__all__ = ["StepSession", "commit_step_session"]


class StepSession(Session):
    """The Session behind `ctx.session`: flowq commits it together with the step's completion."""

    _flowq_may_commit = False
    # The server process of its open transaction (set when it begins): an attempt abandoned
    # at its timeout has its transaction ended through it, releasing its row locks at once.
    backend_pid: int | None = None

    def commit(self) -> None:
        if not self._flowq_may_commit:
            raise ContextError(
                "ctx.session is committed by flowq together with the step's completion: "
                "do not call commit() in a handler (use flush() to get generated ids)."
            )
        super().commit()


def commit_step_session(session: StepSession) -> None:
    """Commit a handler's `ctx.session`, which refuses `commit()` from the handler itself: what
    the completion of a step does once its success is written in that session's transaction."""
    session._flowq_may_commit = True
    try:
        session.commit()
    finally:
        session._flowq_may_commit = False


@event.listens_for(StepSession, "after_begin")
def _remember_backend(session: StepSession, transaction: Any, connection: Connection) -> None:
    info = getattr(connection.connection.dbapi_connection, "info", None)
    pid = getattr(info, "backend_pid", None)
    session.backend_pid = pid if isinstance(pid, int) else None


@event.listens_for(StepSession, "after_transaction_end")
def _forget_backend(session: StepSession, transaction: Any) -> None:
    if transaction.parent is None:  # the outermost transaction: its connection goes back
        session.backend_pid = None
