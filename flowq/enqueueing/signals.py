"""Signals sent in the caller's transaction: validated here, executed by `flowq.enqueueing.sync`.

`prepare_signal(run_id, name, payload)` checks a signal without touching the database; the
`PreparedSignal` it returns yields its statements in turn (like an enqueue's `PreparedCall`),
so the sync (`flowq.signal`, `session.signal`) and async (`flowq.enqueueing.aio.signal`) paths
send the same statements: read the run's state, record the signal, and wake the waiting step
if it has been reached. Delivered if and only if the caller's transaction commits; see
`flowq.define.workflows` for what a signal means to a run.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

from flowq.db.schema import notify_channel
from flowq.db.sql import queries
from flowq.define.app import find_definition
from flowq.errors import ConfigurationError, RunNotFoundError, RunStateError, SignalError
from flowq.jsonargs import JSONError, dumps_checked
from flowq.names import DEFAULT_SCHEMA, check_id, validate_name

__all__ = ["PreparedSignal", "Signalled", "prepare_signal"]


@dataclass(frozen=True)
class Signalled:
    """What `signal` returns: `created=False` when the same payload had already been sent."""

    run_id: int
    name: str
    created: bool
    delivered: bool  # the waiting step was reached and is now runnable


@dataclass(frozen=True)
class PreparedSignal:
    """A validated signal, ready to run on a sync or async connection (like an enqueue's
    `PreparedCall`: `statements()` yields each statement and is sent its first row)."""

    params: dict[str, Any]
    schema: str
    direct: bool = False

    @property
    def statement(self) -> Any:
        return queries(self.schema).select_run_state

    def statements(self) -> Generator[Any, Sequence[Any] | None, Signalled]:
        q = queries(self.schema)
        run_id, name = self.params["run_id"], self.params["name"]
        state = yield q.select_run_state
        task, rows, active, cancelled = state if state is not None else (None, 0, 0, False)
        if not rows:
            raise RunNotFoundError(f"no run {run_id} exists to signal (it may have been pruned,"
                                   " or the id is a job id rather than a run id)")
        if cancelled:
            raise RunStateError(f"run {run_id} was cancelled: signal {name!r} cannot be "
                                "delivered")
        if not active:
            raise RunStateError(f"run {run_id} has finished: signal {name!r} cannot be "
                                "delivered")
        definition = find_definition(str(task), self.schema)
        if definition is not None and not any(s.wait_for == name for s in definition.steps):
            waited = sorted(s.wait_for for s in definition.steps if s.wait_for)
            raise SignalError(
                f"no step of {task!r} waits for signal {name!r}"
                + (f" (it waits for {', '.join(map(repr, waited))})" if waited else
                   " (none of its steps waits for a signal)"))
        sent = yield q.send_signal
        if sent is None:
            same = yield q.compare_signal
            if same is not None and same[0]:
                return Signalled(run_id, name, created=False, delivered=False)
            raise SignalError(f"signal {name!r} was already sent to run {run_id} with another "
                              "payload: a signal is delivered once")
        step = sent[0]
        if step is None:  # not reached yet: the step takes the payload when it is
            return Signalled(run_id, name, created=True, delivered=False)
        self.params["step"] = step
        woken = yield q.wake_signalled_step
        return Signalled(run_id, name, created=True, delivered=woken is not None)


def prepare_signal(run_id: int, name: str, payload: Any = None, *,
                   schema: str | None = None) -> PreparedSignal:
    """Validate a signal completely, without touching the database."""
    run_id = check_id(run_id)
    try:
        validate_name("signal", name)
    except ConfigurationError as exc:
        raise SignalError(str(exc)) from None
    try:
        text = dumps_checked(payload, f"the payload of signal {name!r}")
    except JSONError as exc:
        raise SignalError(str(exc)) from None
    schema = DEFAULT_SCHEMA if schema is None else schema
    return PreparedSignal({"run_id": run_id, "name": name, "payload": text, "step": None,
                           "channel": notify_channel(schema)}, schema)
