"""Checkpoints inside a step: the attempt's `Ledger` and the snooze count.

A `Ledger` is one attempt's view of what its step recorded in `flowq.checkpoints` (read once,
on first use): `ctx.checkpoint` is its `checkpoint`, the durable sleeps
(`flowq.durable.sleeps`) and child runs (`flowq.durable.children`) record through it, and the
attempt asks it how often the step snoozed (`Snooze`).

- `checkpoint(name, fn, args, kwargs)`: a recorded name returns its stored result without
  calling `fn`; else `fn` runs, its result is checked by the rule that checks a step's output
  (`flowq.jsonargs.dumps_checked`) and recorded, fenced on the claim, in one transaction of
  a session of its own. A `fn` taking a keyword `session` gets that session: its writes
  commit with the record, or neither does (a worker that lost its claim commits neither). The
  value returned is the stored JSON read back, so a first run and a replay see the same.
- `snoozes()`: how many times the step snoozed (`flowq.snoozes`, written with each snooze).

Names are the user's (hostile): text of 1-`MAX_NAME_CHARS` characters without NUL or lone
surrogates, not starting with `flowq.` (flowq's own records), used once per attempt: a name
seen again in one attempt is a `CheckpointError` naming both positions. A position is the
order of the call in its attempt (sleeps count); a replay returns a stored name wherever it
comes, so a handler must call its checkpoints in the same order up to the last recorded one
(see docs/durable.md). Without a claim (`flowq.testing.run_step`, `make_context`) the ledger
lives in memory: checkpoints run once per context, sleeps return at once.

A fork (`flowq.runs.fork`) finds the forked step's records through `forkable`: every
checkpoint, sleep (`SLEEP_PREFIX`) and child start (`CHILD_PREFIX`) of the source run's
step, in position order, but not the snooze count (a fork's step starts a new count).

Options and their defaults: `MAX_SNOOZES = 1000` snoozes per step over its life (the next
one ends it `dead`); `MAX_NAME_CHARS = 200`.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any, Final, Literal

from flowq.db.rows import Claim, StoredCheckpoint
from flowq.db.runner import runner
from flowq.db.store import Store
from flowq.durable.session import StepSession, commit_step_session
from flowq.errors import CheckpointError, ContextError
from flowq.jsonargs import JSONError, dumps_checked
from flowq.names import DEFAULT_SCHEMA

__all__ = ["CHILD_PREFIX", "MAX_NAME_CHARS", "MAX_SNOOZES", "RESERVED_PREFIX", "SLEEP_PREFIX",
           "ClaimLost", "Ledger", "RecordKind", "check_name", "forkable", "record_kind"]

MAX_SNOOZES: Final = 1000
MAX_NAME_CHARS: Final = 200
RESERVED_PREFIX: Final = "flowq."
SNOOZES: Final = "flowq.snoozes"
SLEEP_PREFIX: Final = "flowq.sleep."  # a durable sleep's deadline: flowq.sleep.N
CHILD_PREFIX: Final = "flowq.child."  # a child run's start (flowq.durable.children)

RecordKind = Literal["checkpoint", "sleep", "child"]


class ClaimLost(BaseException):
    """This attempt lost its claim on the job (its worker was presumed dead and the job reaped,
    or the run was cancelled): the checkpoint and its session's writes were rolled back, and
    the handler stops here."""

    def __init__(self, name: str) -> None:
        super().__init__(f"checkpoint {name!r} not recorded: this attempt no longer holds its "
                         "claim on the job (reaped or cancelled); its writes were rolled back")


def check_name(name: object) -> str:
    """`name` if flowq can keep it as a checkpoint's name, else CheckpointError."""
    if not isinstance(name, str):
        raise CheckpointError(f"a checkpoint name must be a str, got {type(name).__name__}")
    if not 1 <= len(name) <= MAX_NAME_CHARS:
        raise CheckpointError(f"a checkpoint name must be 1-{MAX_NAME_CHARS} characters, got "
                              f"{len(name)}")
    if "\x00" in name:
        raise CheckpointError("a checkpoint name cannot contain a NUL character")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise CheckpointError("a checkpoint name cannot contain a lone surrogate") from None
    if name.startswith(RESERVED_PREFIX):
        raise CheckpointError(f"checkpoint names starting with {RESERVED_PREFIX!r} are "
                              f"flowq's own: rename {name[:60]!r}")
    return name


def record_kind(name: str) -> RecordKind | None:
    """What a step's record `name` is: a checkpoint of the user's, a durable sleep, a child
    run's start; None for flowq's own bookkeeping (the snooze count)."""
    if not name.startswith(RESERVED_PREFIX):
        return "checkpoint"
    if name.startswith(SLEEP_PREFIX):
        return "sleep"
    if name.startswith(CHILD_PREFIX):
        return "child"
    return None


def forkable(stored: Sequence[StoredCheckpoint]) -> list[StoredCheckpoint]:
    """The records of a step a fork of its run can reuse (see the module), by position."""
    return sorted((r for r in stored if record_kind(r.name) is not None),
                  key=lambda r: (r.position, r.name))


def _takes_session(fn: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature takes no session
        return False
    p = parameters.get("session")
    return p is not None and p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                        inspect.Parameter.POSITIONAL_OR_KEYWORD)


class Ledger:
    """The checkpoints of one attempt of one step (see the module). With `claim` None it keeps
    them in memory; else it reads and records them in `schema` through sessions from
    `session_factory`, fenced on `claim`. `skip_sleeps` (the test kit's `skip_waits`) makes a
    sleep's deadline the moment it is recorded: the job is due again at once."""

    def __init__(self, *, run_id: int, step: str, map_index: int | None,
                 claim: Claim | None = None, schema: str = DEFAULT_SCHEMA,
                 session_factory: Callable[[], StepSession] | None = None,
                 skip_sleeps: bool = False) -> None:
        if claim is not None and session_factory is None:
            raise ValueError("a ledger with a claim needs a session factory")
        self.run_id, self.step, self.map_index = run_id, step, map_index
        self.claim, self.schema = claim, schema
        self.session_factory = session_factory
        self.skip_sleeps = skip_sleeps
        self._stored: dict[str, str] | None = None  # name -> result JSON text
        self._db_now: datetime | None = None
        self._loaded = 0.0  # monotonic, when the database's clock was read
        self._used: dict[str, int] = {}
        self._sleeps = 0

    # -- reading ----------------------------------------------------------------------------

    def _load(self) -> dict[str, str]:
        if self._stored is None:
            rows: list[StoredCheckpoint] = []
            if self.claim is not None:
                assert self.session_factory is not None
                with self.session_factory() as session:
                    rows, self._db_now = Store(runner(session), self.schema).checkpoints(
                        self.run_id, self.step, self.map_index)
            self._stored = {r.name: r.result for r in rows}
            self._loaded = time.monotonic()
        return self._stored

    def stored(self, name: str) -> str | None:
        """The stored result (JSON text) of checkpoint `name`, or None if it is not recorded."""
        return self._load().get(name)

    def now(self) -> datetime:
        """The database's clock, as read with the checkpoints (read here if they were not
        yet), advanced by this machine's monotonic clock since (the worker's wall clock is
        never used)."""
        self._load()
        return self._now()

    def next_sleep(self) -> str:
        """The name of this attempt's next durable sleep (`flowq.sleep.N`, counted from 0)."""
        name = f"{SLEEP_PREFIX}{self._sleeps}"
        self._sleeps += 1
        return name

    def _now(self) -> datetime:
        if self._db_now is None:
            return datetime.now(timezone.utc)
        return self._db_now + timedelta(seconds=time.monotonic() - self._loaded)

    def snoozes(self) -> int:
        """How many times the step snoozed so far (over all its attempts)."""
        text = self._load().get(SNOOZES)
        value = json.loads(text) if text is not None else 0
        return value if isinstance(value, int) else 0

    def position(self, name: str) -> int:
        """The next position of this attempt's sequence, taken by `name` (once)."""
        position = len(self._used)
        if name in self._used:
            raise CheckpointError(
                f"checkpoint {name!r} was already used at position {self._used[name]} of this "
                f"attempt, and is used again at position {position}: names must be unique "
                "within a step's attempt (in a loop, name each: f'item-{i}')")
        self._used[name] = position
        return position

    # -- checkpoints ------------------------------------------------------------------------

    def checkpoint(self, name: object, fn: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        """`fn(*args, **kwargs)` once per (run, step, map instance, name); see the module."""
        name = check_name(name)
        if not callable(fn):
            raise CheckpointError(f"checkpoint {name!r} needs a function, got "
                                  f"{type(fn).__name__}")
        position = self.position(name)
        stored = self._load().get(name)
        if stored is not None:
            return json.loads(stored)
        takes_session = _takes_session(fn)
        if takes_session and "session" in kwargs:
            raise CheckpointError(f"checkpoint {name!r}: flowq passes `session` to a function "
                                  "that takes one; do not pass it yourself")
        if self.claim is None:
            return self._in_memory(name, fn, args, kwargs, takes_session)
        if takes_session:
            return json.loads(self.record(name, position, lambda session: fn(
                *args, session=session, **kwargs)))
        result = fn(*args, **kwargs)  # no transaction is open while `fn` runs
        return json.loads(self.record(name, position, lambda session: result))

    def lookup(self, name: object, fn: Callable[..., Any]) -> tuple[bool, Any]:
        """Whether checkpoint `name` is recorded, and its stored result: the first half of a
        checkpoint whose `fn` is awaited (`Context.acheckpoint`), which then records its
        result through `checkpoint`. A recorded one counts as used here."""
        name = check_name(name)
        if _takes_session(fn):
            raise CheckpointError(f"checkpoint {name!r}: an async function cannot take a "
                                  "session (its Session would cross threads); use a plain "
                                  "function for a checkpoint that writes")
        stored = self._load().get(name)
        if stored is None:
            return False, None
        self.position(name)
        return True, json.loads(stored)

    def own_checkpoint(self, name: str, make: Callable[[StepSession | None], Any]) -> Any:
        """A checkpoint of flowq's own (`name` under `RESERVED_PREFIX`, e.g. a child run's
        start, `flowq.children`): `make(session)` runs once per step like a checkpoint's
        `fn`, its session's writes committed with the record, fenced on the claim; a replay
        returns the stored result. In memory (no claim) `make` gets the test's session, or
        None without one."""
        if not name.startswith(RESERVED_PREFIX):
            raise ValueError(f"{name!r} is not a name of flowq's own")
        position = self.position(name)
        stored = self._load().get(name)
        if stored is not None:
            return json.loads(stored)
        if self.claim is None:
            session = None if self.session_factory is None else self.session_factory()
            text = self._checked(name, make(session))
            self._load()[name] = text
            return json.loads(text)
        return json.loads(self.record(name, position, make))

    def record(self, name: str, position: int,
               make: Callable[[StepSession], Any] | None = None, *,
               sleep: float | None = None, until: datetime | None = None) -> str:
        """Record checkpoint `name` at `position` in one transaction of a new session, fenced
        on the claim: `make(session)`'s result, the session's writes committing with the
        record, or neither (`ClaimLost` when the claim is no longer ours); without `make`, a
        durable sleep's deadline (`sleep` seconds from now, or `until`). The stored JSON."""
        assert self.session_factory is not None and self.claim is not None
        with self.session_factory() as session:
            try:
                text = None if make is None else self._checked(name, make(session))
                recorded = Store(runner(session), self.schema).record_checkpoint(
                    self.claim, self.run_id, self.step, self.map_index, name, position,
                    result=text, sleep=sleep, until=until)
                if recorded is None:
                    raise ClaimLost(name)
                commit_step_session(session)
            except BaseException:
                session.rollback()
                raise
        self._load()[name] = recorded
        return recorded

    def _in_memory(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any], takes_session: bool) -> Any:
        """A checkpoint without a claim (the test kit's `run_step`): `fn` runs, once per
        context; a session it takes is the test's (`ctx.session`), whose commit the test
        owns."""
        if takes_session:
            if self.session_factory is None:
                raise ContextError(f"checkpoint {name!r} takes a session, and this context has "
                                 "no database session (pass session= to run_step)")
            kwargs = {**kwargs, "session": self.session_factory()}
        text = self._checked(name, fn(*args, **kwargs))
        self._load()[name] = text
        return json.loads(text)

    @staticmethod
    def _checked(name: str, result: Any) -> str:
        try:
            return dumps_checked(result, f"the result of checkpoint {name!r}")
        except JSONError as exc:
            raise CheckpointError(f"checkpoint {name!r} returned a value flowq cannot store "
                                  f"(not retried: it would return the same): {exc}") from None
