"""The rows flowq's statements return and take, as frozen dataclasses, read by column name.

`read(cls, rows)` builds one `cls` per row from the columns whose names are its fields (a
column it has no field for, such as a `pg_notify(...)` the statement sends on the side, is
ignored; a field without a column takes its default, and a required one missing is an
error naming it). So no reader depends on the order of a statement's columns, and a
statement may reorder or add columns freely.

- `ClaimedJob`: a row a worker claimed, with `lease`, the fence every later write checks;
  `Claim` is its (id, lease).
- `Completion`, `Successor`, `Spawned`: what a success writes (a claim and its result; a
  step it creates; in a workflow, with a signal and a share in a join), written by
  `flowq.db.store` by the names of the columns the statements declare.
- `Beat`, `Completed`, `Retry`, `Reaped`: what the fenced writes give back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, fields
from datetime import datetime
from operator import itemgetter
from typing import Any, TypeVar

from flowq.db.runner import Rows

__all__ = ["Beat", "Claim", "ClaimKey", "ClaimedJob", "Completed", "Completion", "Expired", "Fired",
           "Reaped", "Retry", "Spawned", "StoredCheckpoint", "Successor", "column", "read", "read_one"]

T = TypeVar("T")

Claim = tuple[int, int]
"""(job id, lease): what identifies one attempt, and what every write after the claim checks."""
ClaimKey = tuple[int, datetime, int]
"""(priority, run_at, id): where a job sorts in the claim's order (`jobs_pending_idx`)."""


@dataclass(frozen=True)
class ClaimedJob:
    """A row this worker claimed; `lease` is the fence every later write is checked against.

    Read from a claim's row by column name (`read`); the field order is only that of a
    positional construction in tests, never the statement's."""

    id: int
    lease: int
    run_id: int
    task: str
    step: str
    step_index: int
    queue: str
    priority: int
    attempts: int
    max_attempts: int
    args: str
    cancel_requested: bool
    age: float
    map_index: int | None = None  # the item position of a map instance
    joined: bool = False  # created by a join: mapped parents' results are collected to run it
    scheduled_at: datetime | None = None  # the tick a periodic schedule enqueued this run for
    pickup_delay: float = 0.0  # seconds from its due time (run_at) to this claim
    trace_context: str | None = None  # W3C trace context (JSON text) it was enqueued under
    enqueued_at: datetime | None = None  # its row's created_at (`ctx.enqueued_at`)
    claimed_at: datetime | None = None  # this claim's database time (`ctx.started_at`)
    fingerprint: str | None = None  # of the definition its run started under (revision 0014)
    run_at: datetime | None = None  # when it was due: with priority and id, its claim order

    @property
    def claim(self) -> Claim:
        return (self.id, self.lease)

    @property
    def order(self) -> ClaimKey | None:
        """Where it sorted in the claim's order (None: built without its run_at)."""
        return None if self.run_at is None else (self.priority, self.run_at, self.id)


@dataclass(frozen=True)
class Completion:
    """A claim to mark succeeded, with its result (JSON text)."""

    id: int
    lease: int
    result: str


@dataclass(frozen=True)
class Successor:
    """A step a success creates at once (a chain's next step, one instance of a map), named
    by the claim it follows, (id, lease): only the claim that landed creates it, once."""

    id: int
    lease: int
    task: str
    step: str
    step_index: int
    queue: str
    max_attempts: int
    args: str  # JSON text
    map_index: int | None
    delay: float  # seconds from the completion to its run_at


@dataclass(frozen=True)
class Spawned(Successor):
    """A `Successor` in a workflow: the signal it waits for (and how long), and its share in
    a join (`parents` > 0: add `delta` to the join's counter and bring `input`, the result
    of static parent `source`; a map of `items` instances of step `mapped` may count them in
    shards instead, see `flowq.db.schema.join_shards`)."""

    signal: str | None = None
    wait: float | None = None
    parents: int = 0
    delta: int = 0
    source: str | None = None
    input: str | None = None
    mapped: str | None = None
    items: int = 0


@dataclass(frozen=True)
class Beat:
    """A heartbeat that landed: the claim is still ours; whether its run was cancelled."""

    id: int
    cancel_requested: bool


@dataclass(frozen=True)
class Completed:
    """A success that landed; whether its run was cancelled meanwhile (no successor then)."""

    id: int
    cancel_requested: bool


@dataclass(frozen=True)
class Retry:
    """A failed attempt sent back: its new status (`pending`, or `cancelled` if its run was
    cancelled meanwhile) and when it runs next."""

    status: str
    run_at: datetime


@dataclass(frozen=True)
class StoredCheckpoint:
    """A recorded checkpoint of a step (`flowq.checkpoints`): its name, its position in the
    attempt that recorded it, its result (JSON text)."""

    name: str
    position: int
    result: str


@dataclass(frozen=True)
class Reaped:
    """A job whose worker stopped heartbeating, requeued, buried or cancelled."""

    id: int
    run_id: int
    task: str
    step: str
    queue: str
    status: str
    attempts: int


@dataclass(frozen=True)
class Expired:
    """A row of a run whose deadline passed: `cancelled`, or still `running` and asked to stop."""

    id: int
    run_id: int
    task: str
    step: str
    status: str
    deadline: datetime


@dataclass(frozen=True)
class Fired:
    """A batch whose runs have all finished: its callback was enqueued (run `callback_run_id`)."""

    id: int
    callback_run_id: int
    runs: int
    succeeded: int
    dead: int
    cancelled: int


# A reader per (class, column list): computed once, since the hot path reads every claim
# through it. When the columns hold the class's leading fields (the rest have defaults), the
# reader is positional, `cls(*itemgetter(...)(row))` (a claim of 128 rows costs microseconds,
# not the tens a keyword dict per row would); otherwise it passes the fields by name.
_readers: dict[tuple[type[Any], tuple[str, ...]], Callable[[Sequence[Any]], Any]] = {}


def _reader(cls: type[T], columns: tuple[str, ...]) -> Callable[[Sequence[Any]], T]:
    """The function building one `cls` from a row of `columns` (see `read`)."""
    hit = _readers.get((cls, columns))
    if hit is not None:
        return hit
    at = {name: i for i, name in enumerate(columns)}
    missing = [f.name for f in fields(cls) if f.name not in at  # type: ignore[arg-type]
               and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ValueError(f"{cls.__name__} needs the column(s) {', '.join(missing)}; the "
                         f"statement returned {', '.join(columns) or 'none'}")
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    present = [n for n in names if n in at]
    reader: Callable[[Sequence[Any]], T]
    if present == names[:len(present)] and len(present) > 1:
        get = itemgetter(*(at[n] for n in present))

        def reader(row: Sequence[Any]) -> T:
            return cls(*get(row))
    else:
        layout = tuple((n, at[n]) for n in present)

        def reader(row: Sequence[Any]) -> T:
            return cls(**{name: row[i] for name, i in layout})
    _readers[(cls, columns)] = reader
    return reader


def read(cls: type[T], rows: Rows) -> list[T]:
    """One `cls` per row, its fields taken from the columns of the same names."""
    if not rows:
        return []
    reader = _reader(cls, rows.columns)
    return [reader(row) for row in rows]


def read_one(cls: type[T], rows: Rows) -> T | None:
    """The first row as a `cls`, or None when there is none."""
    found = read(cls, Rows(rows.columns, rows[:1]))
    return found[0] if found else None


def column(rows: Rows, name: str) -> Sequence[Any]:
    """The values of column `name`, one per row."""
    if not rows:
        return []
    i = rows.columns.index(name)
    return [row[i] for row in rows]
