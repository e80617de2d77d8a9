"""Preparing an enqueue: every check of the caller's values, without touching the database.

`prepare_enqueue(task, args, **options)` and `prepare_enqueue_many(task, args_list, ...)`
resolve the task (an object, or a name looked up in the live apps), check the options
(`flowq.define.options.EnqueueOptions`: the due time within `MIN_RUN_AT`..`MAX_RUN_AT`, the
deadline, the priority, the keys) and the arguments (JSON only; bound against every step the
run starts with when the definition is known, `Pipeline.check_start_arguments`), and hand
the checked values to the store's enqueue verbs (`flowq.db.store.enqueue`), which choose the
statement, build its parameters and return a `PreparedCall`. A bad call raises a `flowq`
error before any SQL is sent, so the caller's transaction stays usable.

Shared: the sync path (`flowq.enqueueing.sync`) and the async one (`flowq.enqueueing.aio`)
only execute what is prepared here, and `PreparedCall.statements` says, for both, which
statements follow one that returned no row (a keyed enqueue that lost a race, a unique
enqueue whose snapshot was too old).

An `idempotency_key` names the run: a second enqueue with the same key returns the existing
run (`created=False`), whatever its arguments or state, without locking it (`ON CONFLICT DO
NOTHING`, then a read). `unique=True` (a key of the task and its arguments) or `unique_key=`
returns the run of the task active under that key (any step pending, waiting or running),
if any, and otherwise starts a new one holding the key (the store's `insert_job_unique`
says why that is race-free).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from flowq.db.store.enqueue import (
    KEY_RACE_ATTEMPTS,
    UNIQUE_RACE_ATTEMPTS,
    Enqueued,
    NewRun,
    PreparedCall,
    Root,
    builder,
)
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
from flowq.errors import ConfigurationError, InvalidArgumentsError, UnknownTaskError
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

# Enqueued, PreparedCall and the race bounds are the store's; named here, where callers of
# the enqueue (and `flowq.Enqueued`) have always found them.
__all__ = ["KEY_RACE_ATTEMPTS", "MAX_KEY_BYTES", "MAX_RUN_AT", "MIN_RUN_AT",
           "UNIQUE_RACE_ATTEMPTS", "Enqueued", "PreparedCall", "prepare_enqueue",
           "prepare_enqueue_many", "prepare_start_at"]

# In UTF-8 bytes: a btree entry must stay well under PostgreSQL's ~2.7 kB limit, or the INSERT
# would fail inside the caller's transaction instead of being refused up front.
MAX_KEY_BYTES = 1000


def _due(run_at: datetime | None, delay: float | timedelta | None
         ) -> tuple[datetime | None, timedelta]:
    """(run_at, delay) of the due time; a due time the database could not hold (or
    psycopg not read back) is refused here (`flowq.define.options`' rules), since at the
    server it would abort the caller's transaction, or leave a row that no worker can read.
    A negative delay is due at once (run_at lies in the past), as long as it is in range."""
    if run_at is not None and delay is not None:
        raise InvalidArgumentsError("pass either run_at or delay, not both")
    if run_at is not None:
        return as_time(run_at, "run_at"), timedelta(0)
    if delay is None:
        return None, timedelta(0)
    return None, as_interval(delay, "delay")


def _deadline(deadline: object, default: timedelta | None, run_at: datetime | None,
              delay: timedelta) -> tuple[datetime | None, timedelta | None]:
    """(deadline_at, deadline_in) of the run's deadline (`deadline_at`, or `deadline_in` from the
    database's now(); both None: no deadline), `default` (the definition's) when `deadline`
    is None. A deadline at or before the run's due time would cancel it before it starts."""
    given = deadline is not None
    if deadline is None:
        if default is None:
            return None, None
        deadline = default
    checked = check_deadline(deadline)
    # Compared on this machine's clock, as both would land on the database's.
    now = datetime.now(timezone.utc)
    due_at = run_at if run_at is not None else now + delay
    ends_at = checked if isinstance(checked, datetime) else now + checked
    if ends_at <= due_at:
        raise InvalidArgumentsError(
            f"deadline {deadline!r}{'' if given else ' (the default of its definition)'} is "
            f"not after the run's due time ({due_at.isoformat()}): the run would be cancelled "
            "before it could start")
    if isinstance(checked, datetime):
        return checked, None
    return None, checked


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
                   ) -> tuple[str, Pipeline | None, str, NewRun]:
    """Validate everything but the arguments; (name, definition, schema, the run)."""
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
    run_at, due_delay = _due(run_at, delay)
    queue = validate_queue(queue if queue is not None else default_queue)
    deadline_at, deadline_in = _deadline(
        deadline, definition.deadline if definition is not None else None, run_at, due_delay)
    # The definition the run starts under (fingerprint None: enqueued by name, unknown here).
    return name, definition, schema, NewRun(
        name, step_name, queue, priority, max_attempts,
        definition.key_concurrency if definition is not None else None,
        definition.fingerprint if definition is not None else None,
        run_at, due_delay, deadline_at, deadline_in)


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


def _root(step: Step[Any, Any]) -> Root:
    """What `insert_run` writes of a step the run starts with."""
    return Root(step.name, step.index, step.queue, step.retry.attempt_cap, step.delay,
                step.wait_for, step.wait_timeout)


def prepare_enqueue(task: Pipeline | str, args: Mapping[str, Any],
                    **options: Unpack[EnqueueOptions]) -> PreparedCall[Enqueued]:
    """Validate one enqueue completely, without touching the database."""
    unknown = options.keys() - RESERVED_OPTIONS
    if unknown:  # a caller past the type checker
        raise InvalidArgumentsError(f"unknown enqueue option(s) {sorted(unknown)}")
    queue = options.get("queue")
    idempotency_key = options.get("idempotency_key")
    unique, unique_key = options.get("unique", False), options.get("unique_key")
    name, definition, schema, run = _common_params(
        task, queue=queue, priority=options.get("priority"), run_at=options.get("run_at"),
        delay=options.get("delay"), deadline=options.get("deadline"),
        schema=options.get("schema"))
    key = _check_key(idempotency_key)
    args_json = _args_json(name, definition, args)
    held_key = _unique_key(name, args_json, unique, unique_key)
    concurrency_key = None
    if definition is not None and definition.concurrency_key is not None:
        concurrency_key = definition.key_of(dict(args))
    roots = None
    if definition is not None and definition.starts_many:
        roots = [_root(r) for r in definition.roots]
    return builder(schema).enqueue_call(
        run, args_json, idempotency_key=key, unique_key=held_key,
        concurrency_key=concurrency_key, roots=roots,
        roots_queue=run.queue if queue is not None else None)


def prepare_start_at(definition: Pipeline, step: Step[Any, Any], args: Mapping[str, Any], *,
                     schema: str | None = None) -> PreparedCall[Enqueued]:
    """Validate a run of `definition` that starts at `step` alone, with `args` as that step's
    input (its parents' outputs, checked against its handler): what `flowq.runs.fork` sends.
    The multi-root enqueue's statement (`insert_run`) with `step` as the one root, so the
    row is the one an enqueue writes (a step that waits for a signal starts `waiting`)."""
    name, _, schema, run = _common_params(
        definition, queue=None, priority=None, run_at=None, delay=None, deadline=None,
        schema=schema)
    args = dict(args)
    what = f"arguments for step {step.name!r} of {name!r}"
    if step.wait_for is not None:
        step.check_input(args, what)
    else:
        step.check_arguments(args, what)
    try:
        args_json = dumps_checked(args, "args")
    except JSONError as exc:
        raise InvalidArgumentsError(f"cannot start {name!r} at {step.name!r}: {exc}") from None
    return builder(schema).enqueue_call(run, args_json, roots=[_root(step)])


def prepare_enqueue_many(task: Pipeline | str, args_list: Iterable[Mapping[str, Any]], *,
                         queue: str | None = None, priority: int | None = None,
                         run_at: datetime | None = None, delay: float | timedelta | None = None,
                         deadline: datetime | float | timedelta | None = None,
                         schema: str | None = None) -> PreparedCall[list[int]] | None:
    """Validate a bulk enqueue completely; None when there is nothing to insert."""
    name, definition, schema, run = _common_params(
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
    return builder(schema).enqueue_many_call(run, encoded, keys)
