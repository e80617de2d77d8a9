"""What a handler receives as `ctx`: who it is (job, run, step, attempt) and `ctx.session`.

`ctx.session` is a SQLAlchemy Session opened lazily on first use. Its writes commit in the
same transaction that records the step's success, so they happen exactly once per run even
when a step is re-run after a crash: a worker that lost its claim rolls them back. flowq owns
that commit; a handler calling `commit()` gets an error. A handler that never touches
`ctx.session` holds no transaction while it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Connection, event

from flowq.enqueueing.sync import Session
from flowq.errors import CancelRun, FlowqError

__all__ = ["Context", "StepSession"]


class StepSession(Session):
    """The Session behind `ctx.session`: flowq commits it together with the step's completion."""

    _flowq_may_commit = False
    # The server process of its open transaction (set when it begins): an attempt abandoned
    # at its timeout has its transaction ended through it, releasing its row locks at once.
    backend_pid: int | None = None

    def commit(self) -> None:
        if not self._flowq_may_commit:
            raise FlowqError(
                "ctx.session is committed by flowq together with the step's completion: "
                "do not call commit() in a handler (use flush() to get generated ids)."
            )
        super().commit()

    def _flowq_commit(self) -> None:
        self._flowq_may_commit = True
        try:
            super().commit()
        finally:
            self._flowq_may_commit = False


@dataclass
class Context:
    """The handler's view of the job it runs."""

    job_id: int
    run_id: int
    task: str
    step: str
    attempt: int
    queue: str
    _session_factory: Callable[[], StepSession] | None = field(default=None, repr=False)
    _session: StepSession | None = field(default=None, repr=False)
    map_index: int | None = None  # the item position, in an instance of a mapped step
    _scheduled_at: datetime | None = field(default=None, repr=False)
    _cancelled: bool = field(default=False, repr=False)

    @property
    def cancelled(self) -> bool:
        """True once the run was cancelled while this step runs (the worker learns it within
        a heartbeat interval). Stop early with `raise_if_cancelled()`; a handler that finishes
        anyway has its success recorded, but no later step runs."""
        return self._cancelled

    def raise_if_cancelled(self) -> None:
        """Raise `flowq.CancelRun` if the run was cancelled: the step ends `cancelled`."""
        if self._cancelled:
            raise CancelRun("the run was cancelled while this step ran")

    @property
    def scheduled_at(self) -> datetime | None:
        """The tick a periodic schedule enqueued this run for (an aware datetime in UTC), in
        the steps the run starts with; None for a run that was not scheduled (see
        `flowq.schedules`)."""
        if self._scheduled_at is None:
            return None
        return self._scheduled_at.astimezone(timezone.utc)

    @property
    def idempotency_key(self) -> str:
        """Stable across every attempt of this step of this run, distinct across steps, runs
        and map instances: pass it to payment and mail APIs so a re-run step is not charged or
        sent twice."""
        if self.map_index is not None:
            return f"flowq:{self.run_id}:{self.step}:{self.map_index}"
        return f"flowq:{self.run_id}:{self.step}"

    @property
    def session(self) -> StepSession:
        """A Session whose writes commit atomically with this step's success (opened lazily)."""
        if self._session is None:
            if self._session_factory is None:
                raise FlowqError("this context has no database session (not run by a worker)")
            self._session = self._session_factory()
        return self._session

    @property
    def session_used(self) -> bool:
        return self._session is not None

    def __getstate__(self) -> dict[str, Any]:  # pragma: no cover - contexts are not pickled
        raise TypeError("a flowq Context cannot be pickled")


@event.listens_for(StepSession, "after_begin")
def _remember_backend(session: StepSession, transaction: Any, connection: Connection) -> None:
    info = getattr(connection.connection.dbapi_connection, "info", None)
    pid = getattr(info, "backend_pid", None)
    session.backend_pid = pid if isinstance(pid, int) else None


@event.listens_for(StepSession, "after_transaction_end")
def _forget_backend(session: StepSession, transaction: Any) -> None:
    if transaction.parent is None:  # the outermost transaction: its connection goes back
        session.backend_pid = None
