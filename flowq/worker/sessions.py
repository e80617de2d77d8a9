"""How the executor ends an attempt's `ctx.session` (a `StepSession` of the session pool):
after its handler, rolled back or closed quietly (`close_quietly`: a dead connection must not
cost the slot); when the attempt is abandoned at its timeout, by terminating its server
process (`end_transaction`), so that its open transaction's row locks do not block the next
attempt of the same step until the stuck handler returns, if ever. `end_backend` is None
behind PgBouncer, where the pid a pooled connection reports is PgBouncer's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from flowq.durable.session import StepSession
from flowq.storable import describe, first_line, safe_str
from flowq.worker.attempt import Attempt
from flowq.worker.logs import WARNING, log_event

__all__ = ["close_quietly", "end_transaction"]


def close_quietly(session: StepSession | None, method: Literal["rollback", "close"]) -> None:
    """Roll back or close a handler's session; a dead connection must not cost the slot."""
    if session is None:
        return
    try:
        getattr(session, method)()
    except Exception as exc:
        log_event(WARNING, f"ctx.session {method} failed", error=first_line(safe_str(exc)))


def end_transaction(attempt: Attempt, end_backend: Callable[[int], None] | None) -> None:
    """End the open transaction of abandoned `attempt`'s `ctx.session`, if it opened one,
    by terminating its server process with `end_backend` (None: left to its handler)."""
    ctx = attempt.ctx
    pid = getattr(ctx.opened_session if ctx is not None else None, "backend_pid", None)
    if not isinstance(pid, int) or end_backend is None:
        return
    try:
        end_backend(pid)
    except Exception as exc:
        log_event(WARNING, "could not end an abandoned attempt's transaction",
                  job_id=attempt.job.id, error=first_line(describe(exc)))
