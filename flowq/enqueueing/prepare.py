"""Preparing an enqueue: every check and the statement to send, without touching the database.

`prepare_enqueue(task, args, **options)` and `prepare_enqueue_many(task, args_list, ...)`
resolve the task (an object, or a name looked up in the live apps), check the options
(`flowq.define.options.EnqueueOptions`: the due time within `MIN_RUN_AT`..`MAX_RUN_AT`, the
deadline, the priority, the keys) and the arguments (JSON only; bound against every step the run starts
with when the definition is known, `Pipeline.check_start_arguments`), and return a
`PreparedCall`: the statement, its parameters, and how to read its result. A bad call raises
a `flowq` error before any SQL is sent, so the caller's transaction stays usable.

Pure and shared: the sync path (`flowq.enqueueing.sync`) and the async one
(`flowq.enqueueing.aio`) only execute what is prepared here, and `PreparedCall.statements`
says, for both, which statements follow one that returned no row (a keyed enqueue that lost
a race, a unique enqueue whose snapshot was too old).

An `idempotency_key` names the run: a second enqueue with the same key returns the existing
run (`created=False`), whatever its arguments or state, without locking it (`ON CONFLICT DO
NOTHING`, then a read). `unique=True` (a key of the task and its arguments) or `unique_key=`
returns the run of the task active under that key (any step pending, waiting or running),
if any, and otherwise starts a new one holding the key (`Queries.insert_job_unique` says why
that is race-free).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import sqlalchemy as sa

from flowq.db.schema import notify_channel
from flowq.db.sql import queries
from flowq.define.app import defined_names, did_you_mean, find_definition
from flowq.define.options import (
    MAX_RUN_AT,
    MIN_RUN_AT,
    RESERVED_OPTIONS,
    EnqueueOptions,
    as_interval,
    as_time,
    check_deadline,
)
from flowq.define.pipeline import Pipeline
from flowq.define.retry import DEFAULT_MAX_ATTEMPTS
from flowq.define.step import Step
from flowq.errors import ConfigurationError, FlowqError, InvalidArgumentsError, UnknownTaskError
from flowq.jsonargs import JSONError, dumps_checked
from flowq.names import (
    DEFAULT_QUEUE,
    DEFAULT_SCHEMA,
    validate_name,
    validate_priority,
    validate_queue,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11 on

__all__ = ["KEY_RACE_ATTEMPTS", "MAX_KEY_BYTES", "MAX_RUN_AT", "MIN_RUN_AT",
           "UNIQUE_RACE_ATTEMPTS", "Enqueued", "PreparedCall", "prepare_enqueue",
           "prepare_enqueue_many", "prepare_start_at"]

# In UTF-8 bytes: a btree entry must stay well under PostgreSQL's ~2.7 kB limit, or the INSERT
# would fail inside the caller's transaction instead of being refused up front.
MAX_KEY_BYTES = 1000
# How often a keyed enqueue starts over when the run that beat it to its key was deleted
# before it could be read (see `PreparedCall.statements`).
KEY_RACE_ATTEMPTS = 3
# How often a unique enqueue sends its statement again when a concurrent claim of its key
# committed after its snapshot (each attempt has a newer snapshot: losing again needs that
# run to finish and yet another enqueuer to claim the key in between).
UNIQUE_RACE_ATTEMPTS = 10

T = TypeVar("T")


@dataclass(frozen=True)
class Enqueued:
    """What enqueue returns: the run's `id`, and `created=False` when an idempotency key or a
    unique key matched (`job_id`: that run's first row)."""

    id: int
    created: bool
    job_id: int


@dataclass(frozen=True)
class PreparedCall(Generic[T]):
    """A validated enqueue, ready to run on a sync or async connection; `finish` reads its result."""

    statement: sa.Executable
    params: dict[str, Any]
    schema: str
    finish: Callable[[Sequence[Any]], T]  # reads a result row
    direct: bool = False  # may take the psycopg pipeline path (see the module docstring)
    # A keyed enqueue's read of its key, for when its statement returns no row, and the
    # release of a key that names a run with no rows, for when that read finds none.
    lookup: sa.Executable | None = None
    release: sa.Executable | None = None
    # A unique enqueue: when its statement returns no row, send it again (a new snapshot).
    rerun: bool = False

    def statements(self) -> Generator[sa.Executable, Sequence[Any] | None, T]:
        """The statements to send, in turn: send back each one's first row (None if it had
        none); the generator returns the result. Sync and async execution share it."""
        for _ in range(UNIQUE_RACE_ATTEMPTS if self.rerun else KEY_RACE_ATTEMPTS):
            row = yield self.statement
            if row is None and self.lookup is not None:
                # The keyed statement waited for a concurrent inserter of its key, which
                # committed: that row is newer than the statement's snapshot, so it returned
                # nothing. Under READ COMMITTED a new statement takes a new snapshot, which
                # sees it. (Under REPEATABLE READ the INSERT raised a serialization failure.)
                row = yield self.lookup
                if row is None and self.release is not None:
                    # Or the key's entry names a run with no rows (pruned by an earlier
                    # release): free it, then start over.
                    yield self.release
            if row is not None:
                return self.finish(row)
            if self.lookup is None and not self.rerun:
                raise AssertionError("an enqueue statement returned no row")
            # The winner was deleted before we could read it: the key is free, start over.
            # (Unique: a claim of the key committed after our snapshot, which a new statement
            # sees; see `Queries.insert_job_unique`.)
        if self.rerun:
            raise FlowqError(
                f"could not enqueue with unique key {self.params['unique_key']!r}: "
                f"{UNIQUE_RACE_ATTEMPTS} times in a row a concurrent enqueue claimed it first "
                "(runs of that key start and finish faster than they can be enqueued?)")
        raise FlowqError(
            f"could not enqueue with idempotency_key {self.params['idempotency_key']!r}: "
            f"{KEY_RACE_ATTEMPTS} times a concurrent transaction inserted it, then it was "
            "deleted before it could be read"
        )


def _due_params(run_at: datetime | None, delay: float | timedelta | None) -> dict[str, Any]:
    """The bind parameters of the due time; a due time the database could not hold (or
    psycopg not read back) is refused here (`flowq.define.options`' rules), since at the
    server it would abort the caller's transaction, or leave a row that no worker can read.
    A negative delay is due at once (run_at lies in the past), as long as it is in range."""
    if run_at is not None and delay is not None:
        raise InvalidArgumentsError("pass either run_at or delay, not both")
    if run_at is not None:
        return {"run_at": as_time(run_at, "run_at"), "delay": timedelta(0)}
    if delay is None:
        return {"run_at": None, "delay": timedelta(0)}
    return {"run_at": None, "delay": as_interval(delay, "delay")}


def _deadline_params(deadline: object, default: timedelta | None,
                     due: dict[str, Any]) -> dict[str, Any]:
    """The bind parameters of the run's deadline (`deadline_at`, or `deadline_in` from the
    database's now(); both None: no deadline), `default` (the definition's) when `deadline`
    is None. A deadline at or before the run's due time would cancel it before it starts."""
    given = deadline is not None
    if deadline is None:
        if default is None:
            return {"deadline_at": None, "deadline_in": None}
        deadline = default
    checked = check_deadline(deadline)
    # Compared on this machine's clock, as both would land on the database's.
    now = datetime.now(timezone.utc)
    due_at = due["run_at"] if due["run_at"] is not None else now + due["delay"]
    ends_at = checked if isinstance(checked, datetime) else now + checked
    if ends_at <= due_at:
        raise InvalidArgumentsError(
            f"deadline {deadline!r}{'' if given else ' (the default of its definition)'} is "
            f"not after the run's due time ({due_at.isoformat()}): the run would be cancelled "
            "before it could start")
    if isinstance(checked, datetime):
        return {"deadline_at": checked, "deadline_in": None}
    return {"deadline_at": None, "deadline_in": checked}


def _resolve(task: Pipeline | str, schema: str | None) -> tuple[str, Pipeline | None, str]:
    """(name, definition or None, schema) for what the caller passed as `task`."""
    if isinstance(task, Pipeline):
        # New runs start on the newest version of a versioned pipeline, whichever version's
        # object the producer holds (docs/pipelines.md, "Deploying changes").
        newest = task.app.get(task.name)
        definition = newest if newest is not None and newest.version > task.version else task
        return task.name, definition, task.app.schema if schema is None else schema
    if isinstance(task, str):
        try:
            validate_name("task", task)
        except ConfigurationError as exc:
            raise UnknownTaskError(str(exc)) from None
        schema = DEFAULT_SCHEMA if schema is None else schema
        return task, find_definition(task, schema), schema
    raise UnknownTaskError(
        f"enqueue needs a task or pipeline (or its registered name), got {task!r}"
    )


def _unknown_name(name: str, schema: str) -> str:
    """Why an enqueue by `name` without `queue=` is refused, and what to do. A close name
    that an app of this process defines is likely the intent (a typo), and a queue guessed
    for a typo would hold a job no worker ever runs: the fix offered is the name."""
    known = defined_names(schema)
    hint = did_you_mean(name, known)
    if hint:
        return (f"{name!r} is not a task or pipeline defined in this process: {hint} (a task "
                "that only another service's workers define is enqueued by name with the "
                "queue= they serve)")
    defined = (f"the apps loaded here define {', '.join(map(repr, known[:10]))}"
               f"{', ...' if len(known) > 10 else ''}; " if known else "")
    return (f"{name!r} is not a task or pipeline defined in this process, so flowq cannot know "
            f"which queue its workers serve: {defined}import the module that defines it, or, "
            "for a task only another service's workers define, pass the queue= those workers "
            f"serve (e.g. enqueue({name!r}, queue={DEFAULT_QUEUE!r}, ...); a queue no worker "
            "of that task serves leaves the job pending, which `flowq runs list` warns of)")


def _common_params(task: Pipeline | str, *, queue: str | None, priority: int | None,
                   run_at: datetime | None, delay: float | timedelta | None,
                   deadline: object, schema: str | None
                   ) -> tuple[str, Pipeline | None, str, dict[str, Any]]:
    """Validate everything but the arguments; (name, definition, schema, bind parameters)."""
    name, definition, schema = _resolve(task, schema)
    if definition is not None:
        if not definition.steps:
            raise ConfigurationError(f"pipeline {name!r} has no steps: nothing to enqueue")
        first = definition.first
        step_name, max_attempts = first.name, first.retry.attempt_cap
        default_queue, default_priority = first.queue, definition.priority
    else:
        # Unknown here (the producer need not import handlers): the worker resolves the
        # first step and its policy from its own registry; '' means "the first step". The
        # queue cannot be guessed: a default one that the task's workers do not serve would
        # leave the job pending forever, so the caller names it.
        if queue is None:
            raise UnknownTaskError(_unknown_name(name, schema))
        step_name, max_attempts = "", DEFAULT_MAX_ATTEMPTS
        default_queue, default_priority = DEFAULT_QUEUE, 0
    if priority is None:
        priority = default_priority
    priority = validate_priority(priority)
    due = _due_params(run_at, delay)
    params: dict[str, Any] = {
        "task": name,
        "step": step_name,
        "queue": validate_queue(queue if queue is not None else default_queue),
        "priority": priority,
        "max_attempts": max_attempts,
        "key_limit": definition.key_concurrency if definition is not None else None,
        "concurrency_key": None,
        "channel": notify_channel(schema),
        "trace_context": None,  # set by `execute` when tracing (flowq.tracing)
        # The definition the run starts under (None: enqueued by name, unknown here).
        "fingerprint": definition.fingerprint if definition is not None else None,
        **due,
        **_deadline_params(deadline, definition.deadline if definition is not None else None,
                           due),
    }
    return name, definition, schema, params


def _args_json(name: str, definition: Pipeline | None, args: Mapping[str, Any]) -> str:
    """Check and encode one set of arguments: every step the run starts with receives them."""
    args = args if type(args) is dict else dict(args)
    if definition is not None:
        definition.check_start_arguments(args, what=f"arguments for {name!r}")
    try:
        return dumps_checked(args, "args")
    except JSONError as exc:
        raise InvalidArgumentsError(f"cannot enqueue {name!r}: {exc}") from None


def _check_key(key: object, what: str = "idempotency_key") -> str | None:
    if key is None:
        return None
    if not isinstance(key, str) or not key:
        raise InvalidArgumentsError(f"{what} must be a non-empty string, got {key!r}")
    try:
        dumps_checked(key, what)
    except JSONError as exc:
        raise InvalidArgumentsError(str(exc)) from None
    if len(key.encode("utf-8")) > MAX_KEY_BYTES:
        raise InvalidArgumentsError(
            f"{what} is longer than {MAX_KEY_BYTES} bytes: hash it first"
        )
    return key


def _unique_key(name: str, args_json: str, unique: object, unique_key: object) -> str | None:
    """The key a unique enqueue holds in `flowq.uniques` (None: not unique). Scoped by task
    (a task name has no space): `NAME key KEY` for `unique_key=`, and for `unique=True`
    `NAME args sha256:HEX` of the arguments as canonical JSON (keys sorted, no spaces):
    the same arguments give the same key whatever their order, but an argument left to its
    default differs from one passed with the default's value, and 1 from 1.0."""
    if not isinstance(unique, bool):
        raise InvalidArgumentsError(f"unique must be True or False, got {unique!r}")
    if unique_key is not None:
        if unique:
            raise InvalidArgumentsError(
                "pass unique=True (the task and its arguments make the key) or "
                "unique_key=... (your own key), not both")
        return f"{name} key {_check_key(unique_key, 'unique_key')}"
    if not unique:
        return None
    canonical = json.dumps(json.loads(args_json), sort_keys=True, separators=(",", ":"),
                           ensure_ascii=False)
    return f"{name} args sha256:{hashlib.sha256(canonical.encode('utf-8')).hexdigest()}"


def _enqueued(row: Sequence[Any]) -> Enqueued:
    job_id, run_id, created = row[:3]
    return Enqueued(id=run_id, created=bool(created), job_id=job_id)


def _run_ids(row: Sequence[Any]) -> list[int]:
    return list(row[0])


def prepare_enqueue(task: Pipeline | str, args: Mapping[str, Any],
                    **options: Unpack[EnqueueOptions]) -> PreparedCall[Enqueued]:
    """Validate one enqueue completely, without touching the database."""
    unknown = options.keys() - RESERVED_OPTIONS
    if unknown:  # a caller past the type checker
        raise InvalidArgumentsError(f"unknown enqueue option(s) {sorted(unknown)}")
    queue = options.get("queue")
    idempotency_key = options.get("idempotency_key")
    unique, unique_key = options.get("unique", False), options.get("unique_key")
    name, definition, schema, params = _common_params(
        task, queue=queue, priority=options.get("priority"), run_at=options.get("run_at"),
        delay=options.get("delay"), deadline=options.get("deadline"),
        schema=options.get("schema"))
    key = _check_key(idempotency_key)
    params["args"] = _args_json(name, definition, args)
    held_key = _unique_key(name, params["args"], unique, unique_key)
    if definition is not None and definition.concurrency_key is not None:
        params["concurrency_key"] = definition.key_of(dict(args))
    q = queries(schema)
    if held_key is not None:
        params.update(unique_key=held_key, idempotency_key=key)
    if definition is not None and definition.starts_many:
        roots = definition.roots
        params.update(idempotency_key=key, steps=[r.name for r in roots],
                      step_indexes=[r.index for r in roots], queues=[r.queue for r in roots],
                      max_attempts=[r.retry.attempt_cap for r in roots],
                      delays=[r.delay for r in roots], signals=[r.wait_for for r in roots],
                      waits=[r.wait_timeout for r in roots])
        if queue is not None:  # queue= moves the steps the run starts with
            params["queues"] = [params["queue"]] * len(roots)
        if held_key is not None:
            return PreparedCall(q.insert_run_unique, params, schema, _enqueued, True,
                                rerun=True)
        return PreparedCall(q.insert_run, params, schema, _enqueued, True,
                            lookup=q.find_run_by_key if key is not None else None,
                            release=q.release_orphaned_key if key is not None else None)
    if held_key is not None:
        return PreparedCall(q.insert_job_unique, params, schema, _enqueued, True, rerun=True)
    if key is None:
        # A job with a concurrency key also marks its queue keyed (in the same statement):
        # its limit holds in whatever queue it is enqueued in. The keyless hot path does not.
        statement = q.insert_job if params["concurrency_key"] is None else q.insert_keyed_job
        return PreparedCall(statement, params, schema, _enqueued, True)
    params["idempotency_key"] = key
    return PreparedCall(q.insert_job_by_key, params, schema, _enqueued, True,
                        lookup=q.find_run_by_key, release=q.release_orphaned_key)


def prepare_start_at(definition: Pipeline, step: Step[Any, Any], args: Mapping[str, Any], *,
                     schema: str | None = None) -> PreparedCall[Enqueued]:
    """Validate a run of `definition` that starts at `step` alone, with `args` as that step's
    input (its parents' outputs, checked against its handler): what `flowq.runs.fork` sends.
    The multi-root enqueue's statement (`insert_run`) with `step` as the one root, so the
    row is the one an enqueue writes (a step that waits for a signal starts `waiting`)."""
    name, _, schema, params = _common_params(
        definition, queue=None, priority=None, run_at=None, delay=None, deadline=None,
        schema=schema)
    args = dict(args)
    what = f"arguments for step {step.name!r} of {name!r}"
    if step.wait_for is not None:
        step.check_input(args, what)
    else:
        step.check_arguments(args, what)
    try:
        params["args"] = dumps_checked(args, "args")
    except JSONError as exc:
        raise InvalidArgumentsError(f"cannot start {name!r} at {step.name!r}: {exc}") from None
    params.update(idempotency_key=None, steps=[step.name], step_indexes=[step.index],
                  queues=[step.queue], max_attempts=[step.retry.attempt_cap],
                  delays=[step.delay], signals=[step.wait_for], waits=[step.wait_timeout])
    return PreparedCall(queries(schema).insert_run, params, schema, _enqueued, True)


def prepare_enqueue_many(task: Pipeline | str, args_list: Iterable[Mapping[str, Any]], *,
                         queue: str | None = None, priority: int | None = None,
                         run_at: datetime | None = None, delay: float | timedelta | None = None,
                         deadline: datetime | float | timedelta | None = None,
                         schema: str | None = None) -> PreparedCall[list[int]] | None:
    """Validate a bulk enqueue completely; None when there is nothing to insert."""
    name, definition, schema, params = _common_params(
        task, queue=queue, priority=priority, run_at=run_at, delay=delay, deadline=deadline,
        schema=schema)
    if (definition is not None and definition.starts_many):
        raise InvalidArgumentsError(
            f"enqueue_many inserts one row per run, but a run of {name!r} starts with several "
            "steps (several roots, or a root that waits or is delayed): enqueue its runs one "
            "by one")
    encoded: list[str] = []
    keys: list[str | None] = []
    for i, item in enumerate(args_list):
        if not isinstance(item, Mapping):
            raise InvalidArgumentsError(
                f"item {i} of enqueue_many is {type(item).__name__}, not a mapping of arguments"
            )
        try:
            encoded.append(_args_json(name, definition, item))
            keys.append(None if definition is None else definition.key_of(dict(item)))
        except InvalidArgumentsError as exc:
            raise InvalidArgumentsError(f"item {i}: {exc}") from None
    if not encoded:
        return None
    params["args"] = encoded
    params["concurrency_keys"] = keys
    return PreparedCall(queries(schema).insert_jobs, params, schema, _run_ids)
