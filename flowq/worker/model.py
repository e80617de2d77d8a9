"""The values that flow through the worker: the outcome of running a claimed job.

The claimed job itself is a row: `flowq.db.rows.ClaimedJob`, with its `Claim` (id, lease).

An outcome is decided where the attempt runs (`flowq.worker.attempt`, which knows the step,
its retry policy and the exception) and only written (`flowq.worker.writes`, through the
completer or the test kit), so every value in it is already storable:
texts without NUL or lone surrogates and capped in length, delays finite and in range.

- `Succeeded`: the result (JSON text) and, in a pipeline, what it spawns: the steps it
  creates, and its share in the joins it counts towards (`Spawn`).
- `Failed`: the error text; `retry_in` seconds until the next attempt, or None for `dead`.
- `Retried`: the handler raised `RetryStep` and has attempts left; or (`handed_over`) the
  job is left to another live worker that serves a definition able to run it.
- `Cancelled`: the handler raised `CancelRun`.
- `Suspended`: the handler slept durably (`ctx.sleep`) or raised `Snooze`: back to pending
  until `until` (else `delay` seconds from now), its attempt given back; a snooze carries
  the step's new snooze count (`snoozes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from flowq.define.step import Step

__all__ = ["Cancelled", "Failed", "Outcome", "Retried", "Spawn", "Succeeded", "Suspended"]

@dataclass(frozen=True)
class Spawn:
    """What a success does to one child step, in the transaction that records it.

    `parents == 0`: create the step now (a chain's next step, or one instance of a mapped
    step, `map_index` set), with `args`. `parents > 0`: the child is a join of that many
    parent units; add `delta` to its counter (-1: one unit succeeded; n - 1: a mapped parent
    became n instances) and bring `input`, the result of static parent `parent`. The success
    that brings the counter to zero creates the step, with the static inputs as arguments.
    A map of many items also names its mapped step (`mapped`) and their number (`items`):
    its instances may then count in shards (`flowq.db.schema.join_shards`).
    """

    step: Step[Any, Any]
    task: str
    args: str = "{}"
    map_index: int | None = None
    parents: int = 0
    delta: int = 0
    parent: str | None = None
    input: str | None = None
    mapped: str | None = None
    items: int = 0

    @property
    def simple(self) -> bool:
        """Created at once and runnable: no join counter, no signal to meet."""
        return self.parents == 0 and self.step.wait_for is None


@dataclass(frozen=True)
class Succeeded:
    result: str  # JSON text
    spawn: tuple[Spawn, ...] = ()


@dataclass(frozen=True)
class Failed:
    text: str  # `Type: message` then the traceback, as stored in last_error
    retry_in: float | None  # seconds until the next attempt; None: the job ends `dead`
    summary: str = ""  # the first line, for the log


@dataclass(frozen=True)
class Retried:
    delay: float
    reason: str
    # Left to another worker whose definition can run it (`attempt.resolve`): the attempt
    # is given back, and `reason` is the row's note as it stands.
    handed_over: bool = False


@dataclass(frozen=True)
class Cancelled:
    reason: str


@dataclass(frozen=True)
class Suspended:
    until: datetime | None  # a sleep's recorded deadline; None: `delay` seconds from now
    delay: float
    reason: str
    snoozes: int | None = None  # a snooze: the step's count, this one included
    step: str = ""  # the step's name (the key of its snooze count)


Outcome = Succeeded | Failed | Retried | Cancelled | Suspended
