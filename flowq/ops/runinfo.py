"""A run as read from its rows: `RunInfo` with its `StepInfo`s and graph, and its status.

A run has no row of its own (see `flowq.db.schema`): it is the set of `flowq.jobs` rows that
share a `run_id`, one per step reached so far (one per item for a mapped step). Its status
is derived from them (`run_status`) by the one rule `flowq.db.runstatus` holds, which the
statements listing runs, children and batches render in SQL: `cancelled` if any step is
`cancelled` or has `cancel_requested` (a running step that was asked to stop still
finishes; `RunInfo.finished_at` stays empty until it has); else `running`, `pending` or
`waiting` while any step is (in that order); else `dead` if any step is dead, else
`succeeded`.

A run started by another's step (`ctx.start_child`, see `flowq.children`) names its
`parent` (that run, step and map instance), and a run lists the `children` its steps started
(the first `CHILDREN_SHOWN`, each with its derived status).

A succeeded run's `result` is its leaves' results: the single leaf's result, or a dict by
step name when there are several (a mapped leaf gives the list of its instances' results).
The leaves are known from the pipeline's definition when it is imported in this process;
otherwise the steps with the highest index are taken as the leaves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from typing import Any, Final, Protocol

import sqlalchemy as sa

from flowq.db import runstatus
from flowq.db.schema import Status
from flowq.db.store import Store
from flowq.db.store.runs import RunJob
from flowq.define.app import find_definition
from flowq.errors import RunNotFoundError

__all__ = [
    "CHECKPOINTS_SHOWN",
    "CHILDREN_SHOWN",
    "AttemptInfo",
    "CheckpointInfo",
    "NamesSchema",
    "RunInfo",
    "RunLink",
    "RunSummary",
    "StepGroup",
    "StepInfo",
    "attempts_of",
    "jsonable",
    "read_run",
    "read_runs",
    "run_status",
]

CHECKPOINTS_SHOWN: Final = 1000  # of a run, by `runs show` and the dashboard (the first)
CHILDREN_SHOWN: Final = 1000  # of a run, by `runs show` and the dashboard (the first)


@dataclass(frozen=True)
class AttemptInfo:
    """One attempt of a step: when it started and ended, on which worker, and its error.

    The earlier failed attempts come from the row's `attempt_log` (revision 0008; the latest
    `flowq.db.sql.fragments.ATTEMPT_LOG_LENGTH`, errors cut); the latest attempt is the row
    itself, whose worker is not kept once it succeeded (`worker` None)."""

    attempt: int
    started_at: datetime | None
    finished_at: datetime | None
    worker: str | None
    error: str | None


@dataclass(frozen=True)
class StepInfo:
    """One step of a run, as stored in its `flowq.jobs` row.

    `locked_at`, `heartbeat_at` and `locked_by` describe the claim of a running step; they are
    cleared when the attempt ends. `heartbeat_at` is the claim's time while its worker beats
    its registry entry instead (`flowq.worker.heartbeat`). `step` is '' for a first step enqueued by name from a
    producer that did not know the pipeline (the worker resolves it to the first step).
    `last_error` is the error of the step's latest failed attempt; `last_error_earlier` is
    True when the step succeeded after it (the error of an earlier attempt, which a success
    keeps in the row, is not why the step ended).
    """

    job_id: int
    step: str
    index: int
    queue: str
    status: Status
    attempts: int
    max_attempts: int
    cancel_requested: bool
    run_at: datetime
    created_at: datetime
    locked_at: datetime | None
    heartbeat_at: datetime | None
    locked_by: str | None
    finished_at: datetime | None
    last_error: str | None
    args: Any
    result: Any
    map_index: int | None = None  # the item position of a map instance
    last_error_earlier: bool = False  # see the class docstring
    # When the latest attempt started (revision 0008), and every attempt (`attempts_of`).
    started_at: datetime | None = None
    history: tuple[AttemptInfo, ...] = ()
    # The latest `ctx.progress` the worker wrote (revision 0012): {"done", "total",
    # "message", "at"}, or None when the handler reported none.
    progress: dict[str, Any] | None = None


@dataclass(frozen=True)
class CheckpointInfo:
    """One recorded checkpoint of a step (`flowq.checkpoints`, see `flowq.durable`): its name
    (`flowq.sleep.N` for a durable sleep, `flowq.snoozes` for the step's snooze count), its
    position in the attempt that recorded it, and its stored result."""

    step: str
    map_index: int | None
    name: str
    position: int
    result: Any
    created_at: datetime


@dataclass(frozen=True)
class RunLink:
    """A run's parent or one of its children (`flowq.children`): the other run's id, the
    parent's step and map instance that started the child, the checkpoint that did
    (`flowq.child.N`), when, and, for a child, its derived status (None: its rows are
    gone, or for the parent, not read)."""

    run_id: int
    step: str
    map_index: int | None
    name: str
    created_at: datetime
    status: Status | None = None


@dataclass(frozen=True)
class StepGroup:
    """One step of a run's graph: its row, or all its map instances, aggregated."""

    step: str
    index: int
    parents: tuple[str, ...] | None  # None: the definition is not imported here
    status: Status
    instances: int | None  # None: not mapped
    counts: dict[str, int]  # rows by status
    attempts: int  # all attempts of its rows


@dataclass(frozen=True)
class RunInfo:
    """A run: its steps so far and the status derived from them (see the module docstring)."""

    run_id: int
    task: str
    status: Status
    cancel_requested: bool
    idempotency_key: str | None
    created_at: datetime
    finished_at: datetime | None
    result: Any  # the leaves' results once the run succeeded, else None
    steps: tuple[StepInfo, ...]
    graph: tuple[StepGroup, ...] = ()
    # What its steps recorded inside their handlers, by step and position (the first
    # `CHECKPOINTS_SHOWN`).
    checkpoints: tuple[CheckpointInfo, ...] = ()
    forked_from: int | None = None  # the run this one was forked from (`flowq.ops.fork`)
    deadline: datetime | None = None  # the run's `deadline=` (None: none), on each of its rows
    # The definition the run started under (revision 0014, `flowq.define.shape`): its
    # fingerprint, and the pipeline version a worker recorded it as (None: unrecorded).
    fingerprint: str | None = None
    version: int | None = None
    # The run whose step started this one, and the runs this one's steps started (the
    # first `CHILDREN_SHOWN`).
    parent: RunLink | None = None
    children: tuple[RunLink, ...] = ()

    @property
    def current_step(self) -> StepInfo:
        """The latest step reached (the highest index, the latest row)."""
        return self.steps[-1]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: these keys are stable (`flowq runs show --json` prints them)."""
        out: dict[str, Any] = jsonable(asdict(self))
        return out


@dataclass(frozen=True)
class RunSummary:
    """One line of `list_runs`: a run without its steps' details."""

    run_id: int
    task: str
    status: Status
    step: str
    step_index: int
    idempotency_key: str | None
    created_at: datetime
    finished_at: datetime | None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = jsonable(asdict(self))
        return out


def jsonable(value: Any) -> Any:
    """`value` with its datetimes as ISO 8601 text, for the `to_dict()` of the results."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def _step(row: RunJob) -> StepInfo:
    return StepInfo(
        job_id=row.id, step=row.step, index=row.step_index, queue=row.queue, status=row.status,
        attempts=row.attempts, max_attempts=row.max_attempts,
        cancel_requested=row.cancel_requested, run_at=row.run_at, created_at=row.created_at,
        locked_at=row.locked_at, heartbeat_at=row.heartbeat_at, locked_by=row.locked_by,
        finished_at=row.finished_at, last_error=row.last_error, args=row.args,
        result=row.result, map_index=row.map_index,
        last_error_earlier=row.last_error is not None and row.status == "succeeded",
        started_at=row.started_at, history=attempts_of(row),
        progress=row.progress if isinstance(row.progress, dict) else None)


def _time(text: Any) -> datetime | None:
    return datetime.fromisoformat(text) if isinstance(text, str) else None


def attempts_of(row: Any) -> tuple[AttemptInfo, ...]:
    """Every attempt of a job row known to flowq, oldest first: the entries of its
    `attempt_log`, then its running or succeeded attempt (a failed one is logged already)."""
    out = [AttemptInfo(attempt=int(e.get("attempt") or 0), started_at=_time(e.get("started_at")),
                       finished_at=_time(e.get("finished_at")),
                       worker=e.get("worker") if isinstance(e.get("worker"), str) else None,
                       error=e.get("error") if isinstance(e.get("error"), str) else None)
           for e in (row.attempt_log or ()) if isinstance(e, dict)]
    if row.status == "running":
        out.append(AttemptInfo(row.attempts, row.locked_at, None, row.locked_by, None))
    elif row.status == "succeeded" and row.attempts > 0:
        out.append(AttemptInfo(row.attempts, row.started_at, row.finished_at, None, None))
    return tuple(out)


def run_status(steps: Sequence[StepInfo]) -> Status:
    """A run's status from its rows (`flowq.db.runstatus` says why it is sound)."""
    return runstatus.run_status((s.status, s.cancel_requested) for s in steps)


_ORDER: Final = ("running", "pending", "waiting", "dead", "cancelled", "succeeded")


def _graph(steps: Sequence[StepInfo], definition: Any) -> tuple[StepGroup, ...]:
    groups: dict[str, list[StepInfo]] = {}
    for s in steps:
        groups.setdefault(s.step, []).append(s)
    out = []
    for name, rows in sorted(groups.items(), key=lambda kv: (kv[1][0].index, kv[0])):
        counts: dict[str, int] = {}
        for r in rows:
            counts[r.status] = counts.get(r.status, 0) + 1
        mapped = any(r.map_index is not None for r in rows)
        step = definition.step_named(name) if definition is not None and name else None
        status = next(st for st in _ORDER if st in counts)
        out.append(StepGroup(step=name, index=rows[0].index,
                             parents=None if step is None else tuple(step.parents),
                             status=status, instances=len(rows) if mapped else None,
                             counts=counts, attempts=sum(r.attempts for r in rows)))
    return tuple(out)


def _result(steps: Sequence[StepInfo], definition: Any) -> Any:
    """The leaves' results (see the module docstring)."""
    if definition is not None and definition.steps:
        leaves = [s.name for s in definition.leaves]
    else:
        top = max(s.index for s in steps)
        leaves = sorted({s.step for s in steps if s.index == top})
    results: dict[str, Any] = {}
    for name in leaves:
        rows = [s for s in steps if s.step == name]
        if rows and all(r.map_index is not None for r in rows):
            results[name] = [r.result for r in sorted(rows, key=lambda r: r.map_index or 0)]
        else:
            results[name] = rows[0].result if rows else []
    if len(results) == 1:
        return next(iter(results.values()))
    return results


def _run_of(run_id: int, rows: list[RunJob], schema: str) -> RunInfo:
    if not rows:
        raise RunNotFoundError(f"no run {run_id} exists (it may have been pruned, or the id "
                               "is a job id rather than a run id)")
    steps = tuple(_step(r) for r in rows)
    cancel_requested = any(s.cancel_requested for s in steps)
    status = run_status(steps)
    done = not any(s.status in ("pending", "running", "waiting") for s in steps)
    finished = [s.finished_at for s in steps if s.finished_at is not None]
    task = rows[0].task
    definition = find_definition(task, schema)
    if definition is not None and not {s.step for s in steps} <= (
            {st.name for st in definition.steps} | {""}):
        definition = None  # another app's pipeline of that name (or a deploy renamed steps)
    return RunInfo(
        run_id=run_id, task=task, status=status,
        cancel_requested=cancel_requested, idempotency_key=rows[0].idempotency_key,
        created_at=min(s.created_at for s in steps),
        finished_at=max(finished) if done and finished else None,
        result=_result(steps, definition) if status == "succeeded" else None, steps=steps,
        graph=_graph(steps, definition),
        forked_from=next((r.forked_from for r in rows if r.forked_from is not None), None),
        deadline=max((r.deadline for r in rows if r.deadline is not None), default=None),
        fingerprint=rows[0].fingerprint, version=rows[0].version)


class NamesSchema(Protocol):
    """Anything naming a flowq schema: a `flowq.db.store.Store`, or the schema's statements."""

    @property
    def schema(self) -> str: ...


def _store(conn: sa.Connection, where: str | NamesSchema) -> Store:
    return Store.of(conn, where if isinstance(where, str) else where.schema)


def read_run(conn: sa.Connection, where: str | NamesSchema, run_id: int) -> RunInfo:
    """The run `run_id` on `conn`, in the flowq schema `where` names; RunNotFoundError if no
    row of it exists."""
    store = _store(conn, where)
    run = _run_of(run_id, store.run_jobs(run_id), store.schema)
    parent: RunLink | None = None
    children: list[RunLink] = []
    for r in store.run_family(run_id, CHILDREN_SHOWN):
        link = RunLink(run_id=r.run_id, step=r.step, map_index=r.map_index, name=r.name,
                       created_at=r.created_at, status=r.status)
        if r.kind == "parent":
            parent = link
        else:
            children.append(link)
    return replace(run, checkpoints=_checkpoints(store, run_id), parent=parent,
                   children=tuple(children))


def read_runs(conn: sa.Connection, where: str | NamesSchema,
              run_ids: Sequence[int]) -> dict[int, RunInfo]:
    """The runs `run_ids` that exist on `conn`, by id, read in one statement (one snapshot),
    without their checkpoints or links: what a parent waiting on its children reads."""
    store = _store(conn, where)
    rows: dict[int, list[RunJob]] = {}
    for r in store.runs_jobs(run_ids):
        rows.setdefault(r.run_id, []).append(r)
    return {run_id: _run_of(run_id, found, store.schema) for run_id, found in rows.items()}


def _checkpoints(store: Store, run_id: int) -> tuple[CheckpointInfo, ...]:
    return tuple(CheckpointInfo(step=r.step, map_index=r.map_index, name=r.name,
                                position=r.position, result=r.result,
                                created_at=r.created_at)
                 for r in store.run_checkpoints(run_id, CHECKPOINTS_SHOWN))
