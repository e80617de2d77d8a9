"""Durable sleeps inside a step: `ctx.sleep(seconds)`, `ctx.sleep_until(when)`, and `Suspend`.

A sleep is a checkpoint of its own in the attempt's `Ledger` (`flowq.sleep.N`, its deadline):
the first time, the deadline is recorded, fenced on the claim, and `Suspend` ends the
handler's call (the job goes back to pending until then, its attempt given back, no slot
held); when the handler runs again and the deadline has passed (the database's clock), the
call returns. A sleep takes a position in the attempt's sequence like any checkpoint. Without
a claim (`flowq.testing.run_step`) a sleep returns at once; with the ledger's `skip_sleeps`
(the test kit's `skip_waits`) its deadline is the moment it is recorded.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

from flowq.define.step import as_seconds
from flowq.durable.checkpoints import Ledger
from flowq.errors import ConfigurationError

__all__ = ["Suspend", "sleep", "sleep_until"]


class Suspend(BaseException):
    """Control flow of a durable sleep: the handler's call ends here, and the job is due
    again at `until` (None: now). Not an error; a handler must not swallow it."""

    def __init__(self, until: datetime | None, reason: str) -> None:
        super().__init__(reason)
        self.until = until
        self.reason = reason


def sleep(ledger: Ledger, seconds: object) -> None:
    """Sleep durably for `seconds` (a number or a timedelta; see the module)."""
    delay = _delay("ctx.sleep(seconds)", seconds)
    _sleep(ledger, None, delay)


def sleep_until(ledger: Ledger, when: object) -> None:
    """Sleep durably until `when`, an aware datetime (one in the past returns at once)."""
    if not isinstance(when, datetime):
        raise ConfigurationError(f"ctx.sleep_until(when) takes an aware datetime, got "
                                 f"{type(when).__name__}")
    if when.tzinfo is None or when.utcoffset() is None:
        raise ConfigurationError("ctx.sleep_until(when) takes an aware datetime (a naive "
                                 "one names no instant): add tzinfo=timezone.utc")
    try:  # the database's clock decides whether `when` has passed
        left = (when - ledger.now()).total_seconds()
    except OverflowError:
        left = float("inf")
    if left <= 0:
        _sleep(ledger, None, 0.0)
    else:
        _delay("ctx.sleep_until(when)", timedelta(seconds=min(left, 1e12)))
        _sleep(ledger, when.astimezone(timezone.utc), left)


def _sleep(ledger: Ledger, until: datetime | None, delay: float) -> None:
    name = ledger.next_sleep()
    position = ledger.position(name)
    stored = ledger.stored(name)
    if stored is not None:
        deadline = _deadline(stored)
        if deadline <= ledger.now():
            return
        raise Suspend(deadline, f"ctx.sleep until {deadline.isoformat()} (resumed early)")
    if delay <= 0 or ledger.claim is None:
        return  # nothing to wait for; in memory (run_step) a sleep returns at once
    if ledger.skip_sleeps:
        until, delay = None, 0.0
    deadline = _deadline(ledger.record(name, position, sleep=delay, until=until))
    raise Suspend(deadline, f"ctx.sleep until {deadline.isoformat()}")


def _delay(what: str, value: object) -> float:
    """`value` as seconds by the rule every delay flowq takes (`as_seconds`)."""
    return as_seconds(what, value, minimum=0.0)


def _deadline(stored: str) -> datetime:
    value = json.loads(stored)
    return datetime.fromisoformat(value["until"]).astimezone(timezone.utc)
