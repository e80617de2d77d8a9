"""Signals sent in the caller's transaction: validated here, executed by `flowq.enqueueing.sync`.

`prepare_signal(run_id, name, payload)` checks a signal without touching the database; the
`PreparedSignal` the store's enqueue verbs build of it (`flowq.db.store.enqueue`) yields its
statements in turn (like an enqueue's `PreparedCall`),
so the sync (`flowq.signal`, `session.signal`) and async (`flowq.enqueueing.aio.signal`) paths
send the same statements: read the run's state, record the signal, and wake the waiting step
if it has been reached. Delivered if and only if the caller's transaction commits; see
`flowq.define.workflows` for what a signal means to a run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flowq.db.store.enqueue import PreparedSignal, Signalled, builder
from flowq.define.app import find_definition
from flowq.errors import ConfigurationError, SignalError
from flowq.jsonargs import JSONError, dumps_checked
from flowq.names import DEFAULT_SCHEMA, check_id, validate_name

# Signalled and PreparedSignal are the store's; named here, where `flowq.Signalled` is found.
__all__ = ["PreparedSignal", "Signalled", "prepare_signal"]


def _waited_for(name: str, schema: str) -> Callable[[str], None]:
    """The check that a step of the signalled run's task waits for `name` (a task this
    process does not define is not checked)."""

    def check(task: str) -> None:
        definition = find_definition(task, schema)
        if definition is not None and not any(s.wait_for == name for s in definition.steps):
            waited = sorted(s.wait_for for s in definition.steps if s.wait_for)
            raise SignalError(
                f"no step of {task!r} waits for signal {name!r}"
                + (f" (it waits for {', '.join(map(repr, waited))})" if waited else
                   " (none of its steps waits for a signal)"))

    return check


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
    return builder(schema).signal_call(run_id, name, text, _waited_for(name, schema))
