"""The registry: `FlowQ` holds the tasks and pipelines a worker can run and producers enqueue.

A task is a pipeline of one step, so there is one model underneath: `Pipeline` is an ordered
list of `Step`s, each a handler with its own retry policy, timeout and queue. Names are
stable identifiers stored in rows: a task's name is its function's `__name__` unless `name=`
is given; a step's name is its function's `__name__` unless `name=` is given.

Definitions fail loudly at import time: duplicate names, a handler without a `ctx` first
parameter, a handler parameter named like an enqueue option, an invalid queue name.

Definitions also enqueue themselves: `add.enqueue(session, a=1)`, with options through
`add.options(queue=..., priority=..., idempotency_key=..., run_at=..., delay=..., schema=...,
unique=..., unique_key=...)`
and an async twin `await add.aenqueue(async_session, a=1)`. On a `Task[P, R]` these are typed
by the handler's parameters after `ctx` (`P`), so a type checker refuses a misspelt or
mistyped argument; a `Pipeline`'s are untyped (its steps are added one by one). They are thin:
the validation and SQL are `flowq.session`'s (`prepare_enqueue`, `execute`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Concatenate, Final, Generic, ParamSpec, TypeVar, overload

from flowq.db.schema import DEFAULT_SCHEMA, validate_schema_name
from flowq.errors import ConfigurationError, InvalidArgumentsError, InvalidQueueError
from flowq.queues import QueueConfig, Rate
from flowq.retry import Retry
from flowq.storable import MAX_DELAY

if TYPE_CHECKING:
    # flowq.session and flowq.context import this module; flowq.aio must stay unimported
    # until it is used (see `EnqueueOptions`).
    from flowq.aio import AsyncTarget
    from flowq.context import Context
    from flowq.schedules import Schedule
    from flowq.session import Enqueued, PreparedCall, Target

__all__ = [
    "DEFAULT_QUEUE",
    "RESERVED_OPTIONS",
    "EnqueueOptions",
    "FlowQ",
    "Pipeline",
    "Step",
    "Task",
    "find_definition",
    "validate_queue",
]

DEFAULT_QUEUE: Final = "default"
# `schema` too: enqueue takes it as the flowq schema, so a handler parameter of that name
# could never be given a value.
RESERVED_OPTIONS: Final = frozenset({"idempotency_key", "queue", "priority", "run_at", "delay",
                                     "schema", "unique", "unique_key"})
_QUEUE_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,63}$")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:\-]{0,199}$")

# A waiting step's default timeout: a week, so a forgotten signal ends the run (by its
# retry policy) instead of leaving it waiting forever.
DEFAULT_WAIT_TIMEOUT: Final = timedelta(days=7)

P = ParamSpec("P")
R = TypeVar("R")
D = TypeVar("D", bound="Pipeline")

_APPS: weakref.WeakSet[FlowQ] = weakref.WeakSet()


# How many distinct argument-name sets a step remembers as fitting (a **kwargs handler could
# see unboundedly many).
MAX_REMEMBERED_NAME_SETS = 256


def validate_queue(queue: object) -> str:
    """Return `queue` if it is a plain queue name, else raise InvalidQueueError."""
    if not isinstance(queue, str) or not _QUEUE_RE.match(queue):
        raise InvalidQueueError(
            f"queue name {queue!r} is not valid: use 1-63 letters, digits, '_', '-', '.' or ':'."
        )
    return queue


def _validate_name(kind: str, name: object) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigurationError(
            f"{kind} name {name!r} is not valid: start with a letter or '_', then letters, "
            "digits, '_', '-', '.' or ':' (at most 200)."
        )
    return name


@dataclass(frozen=True, eq=False)
class Step(Generic[P, R]):
    """One handler of a pipeline, with its own policy. Calling it calls the handler."""

    name: str
    fn: Callable[..., Any]
    retry: Retry
    timeout: float | None
    queue: str
    index: int
    signature: inspect.Signature = field(repr=False)
    is_async: bool = False
    # Workflows (see docs/workflows.md): the names of the steps this one waits for (none: a
    # root, started with the run), the signal it waits for and how long (seconds), and how
    # long after its parents finished it starts (seconds).
    parents: tuple[str, ...] = ()
    retry_given: bool = False  # False: the default policy (which does not retry SignalTimeout)
    wait_for: str | None = None
    wait_timeout: float | None = None
    delay: float = 0.0
    # Argument-name sets known to bind: arguments are always keywords, so whether they bind
    # depends on the names alone, and binding (~5 us) is most of checking a small call.
    _fitting_names: set[tuple[str, ...]] = field(default_factory=set, init=False, repr=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def check_arguments(self, args: dict[str, Any], what: str = "arguments") -> None:
        """Raise InvalidArgumentsError unless `args` bind to the handler after `ctx`."""
        names = tuple(args)
        if names in self._fitting_names:
            return
        try:
            self.signature.bind(None, **args)
            if len(self._fitting_names) < MAX_REMEMBERED_NAME_SETS:
                self._fitting_names.add(names)
        except TypeError as exc:
            raise InvalidArgumentsError(
                f"{what} do not fit step {self.name!r} {self.signature}: "
                f"{self._misfit(args, exc)}"
            ) from None

    def _misfit(self, args: dict[str, Any], exc: TypeError) -> str:
        # bind() names only its first complaint (often a missing argument), so name every
        # misspelt argument first, they are usually the cause; then whatever else is wrong
        # once they are left out, and never the same complaint twice.
        params = list(self.signature.parameters.values())[1:]
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return str(exc)
        unknown = sorted(set(args) - {p.name for p in params})
        if not unknown:
            return str(exc)
        problems = [f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}"]
        try:
            self.signature.bind(None, **{k: v for k, v in args.items() if k not in unknown})
        except TypeError as rest:
            problems.append(str(rest))
        return "; ".join(problems)


def _seconds(what: str, value: object, *, minimum: float) -> float:
    """`value` (seconds or a timedelta) as seconds, refused unless finite and in range."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ConfigurationError(f"{what} must be seconds or a timedelta, got {value!r}")
    if not (math.isfinite(seconds) and minimum <= seconds <= MAX_DELAY):
        raise ConfigurationError(
            f"{what} must be between {minimum:g} seconds and {MAX_DELAY / 86400:g} days, "
            f"got {value!r}")
    return seconds


def _make_step(fn: Callable[..., Any], *, name: str | None, retry: Retry | None,
               timeout: float | None, queue: str, index: int) -> Step[Any, Any]:
    if not callable(fn):
        raise ConfigurationError(f"a step handler must be a function, got {fn!r}")
    step_name = _validate_name("step", name or getattr(fn, "__name__", ""))
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if not params or params[0].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                            inspect.Parameter.POSITIONAL_OR_KEYWORD):
        raise ConfigurationError(
            f"handler {step_name!r} must take the context as its first parameter: "
            f"def {step_name}(ctx, ...)"
        )
    clash = RESERVED_OPTIONS.intersection(p.name for p in params[1:])
    if clash:
        raise ConfigurationError(
            f"handler {step_name!r} has a parameter named {sorted(clash)[0]!r}, which is reserved "
            f"for enqueue options ({', '.join(sorted(RESERVED_OPTIONS))}): rename it."
        )
    if timeout is not None and not (isinstance(timeout, int | float) and timeout > 0):
        raise ConfigurationError(f"timeout of {step_name!r} must be a positive number of seconds")
    if retry is not None and not isinstance(retry, Retry):
        raise ConfigurationError(f"retry of {step_name!r} must be a flowq.Retry(...)")
    return Step(name=step_name, fn=fn, retry=retry or Retry(), retry_given=retry is not None,
                timeout=timeout,
                queue=validate_queue(queue), index=index, signature=sig,
                is_async=inspect.iscoroutinefunction(fn))


def _as_keywords(definition: Pipeline, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments as the keywords that are stored: positional ones are named after
    the first step's parameters that follow `ctx`. Whether they then fit is for
    `Step.check_arguments` to say (at `prepare_enqueue`), like any other arguments."""
    if not args:
        return kwargs
    params = list(definition.first.signature.parameters.values())[1:]
    names = [p.name for p in params
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    # A positional argument for `*args` has no name to be stored under.
    if len(args) > len(names):
        raise InvalidArgumentsError(
            f"arguments for {definition.name!r} do not fit step {definition.first.name!r} "
            f"{definition.first.signature}: {len(args)} positional arguments, at most "
            f"{len(names)} can be named (arguments are stored as keywords)"
        )
    named = dict(zip(names, args, strict=False))
    twice = sorted(named.keys() & kwargs.keys())
    if twice:
        raise InvalidArgumentsError(
            f"arguments for {definition.name!r}: multiple values for "
            f"{', '.join(map(repr, twice))}"
        )
    named.update(kwargs)
    return named


@dataclass(frozen=True)
class EnqueueOptions(Generic[P]):
    """A task or pipeline with enqueue options, from `definition.options(...)`; enqueue it with
    `.enqueue(session_or_connection, ...)` or `await .aenqueue(async_session, ...)`.

    Typed by the handler's parameters after `ctx` (`P`) when it comes from a `Task`. The
    options mean what they mean to `flowq.enqueue`, and are checked there, when enqueueing.
    """

    definition: Pipeline
    idempotency_key: str | None = None
    queue: str | None = None
    priority: int | None = None
    run_at: datetime | None = None
    delay: float | timedelta | None = None
    schema: str | None = None
    unique: bool = False
    unique_key: str | None = None

    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PreparedCall[Enqueued]:
        # Imported here: flowq.session imports this module.
        from flowq.session import prepare_enqueue

        return prepare_enqueue(self.definition, _as_keywords(self.definition, args, kwargs),
                               idempotency_key=self.idempotency_key, queue=self.queue,
                               priority=self.priority, run_at=self.run_at, delay=self.delay,
                               schema=self.schema, unique=self.unique,
                               unique_key=self.unique_key)

    def enqueue(self, target: Target, /, *args: P.args, **kwargs: P.kwargs) -> Enqueued:
        """Enqueue a run in the transaction of `target` (a Session or Connection); see
        `flowq.enqueue`. Positional arguments are named after the handler's parameters."""
        from flowq.session import execute

        return execute(target, self._prepare(args, kwargs))

    async def aenqueue(self, target: AsyncTarget, /, *args: P.args,
                       **kwargs: P.kwargs) -> Enqueued:
        """Enqueue a run in the transaction of an AsyncSession or AsyncConnection."""
        call = self._prepare(args, kwargs)
        # Imported on first use: `import flowq` must not import SQLAlchemy's asyncio
        # extension (SQLAlchemy 2.1 no longer installs the greenlet it needs).
        from flowq.aio import execute

        return await execute(target, call)


class Pipeline:
    """An ordered chain of steps run as one run; each step's dict result feeds the next.

    Steps run in definition order. Enqueue a pipeline exactly like a task; its first step's
    signature validates the arguments.
    """

    def __init__(self, app: FlowQ, name: str, *, queue: str | None = None,
                 priority: int = 0) -> None:
        self.app = app
        self.name = _validate_name("pipeline", name)
        self.queue = validate_queue(queue or app.default_queue)
        self.priority = int(priority)
        self.steps: list[Step[Any, Any]] = []
        # Per-key concurrency (tasks only, see `FlowQ.task`): the argument naming the key, or
        # a function of the arguments; and how many jobs of one key may run at once.
        self.concurrency_key: str | Callable[..., Any] | None = None
        self.key_concurrency: int | None = None

    def key_of(self, args: dict[str, Any]) -> str | None:
        """The concurrency key of a run with `args`, as JSON text (None: no key). Raises
        InvalidArgumentsError if it is not a JSON scalar."""
        if self.concurrency_key is None:
            return None
        if isinstance(self.concurrency_key, str):
            if self.concurrency_key not in args:
                return None  # the argument has a default, which the handler applies
            value = args[self.concurrency_key]
        else:
            try:
                value = self.concurrency_key(**args)
            except Exception as exc:
                raise InvalidArgumentsError(
                    f"the concurrency_key function of {self.name!r} raised: {exc!r}") from None
        if value is not None and not isinstance(value, str | int | float | bool):
            raise InvalidArgumentsError(
                f"the concurrency key of {self.name!r} must be a JSON scalar (string, number, "
                f"boolean), got {type(value).__name__}")
        from flowq.jsonargs import JSONError, dumps_checked

        try:
            return dumps_checked(value, f"the concurrency key of {self.name!r}")
        except JSONError as exc:
            raise InvalidArgumentsError(str(exc)) from None

    def step(self, *, name: str | None = None, retry: Retry | None = None,
             timeout: float | None = None, queue: str | None = None,
             parents: Sequence[Step[Any, Any] | str] | None = None,
             wait_for: str | None = None, wait_timeout: float | timedelta | None = None,
             delay: float | timedelta | None = None
             ) -> Callable[[Callable[P, R]], Step[P, R]]:
        """Register the decorated function as a step of this pipeline.

        Without `parents=` it follows the step defined before it (a chain); `parents=[a, b]`
        makes it wait for both (a join: it receives each parent's result as a keyword named
        after that parent); `parents=[]` makes it a root, started with the run. `wait_for=`
        names a signal it waits for (its payload arrives as a keyword of that name), at most
        `wait_timeout` (default 7 days); `delay=` starts it that long after its parents
        finished. Parents must be defined before their children, so a graph has no cycles.
        """

        def decorate(fn: Callable[P, R]) -> Step[P, R]:
            s = _make_step(fn, name=name, retry=retry, timeout=timeout,
                           queue=queue or self.queue, index=len(self.steps))
            if any(existing.name == s.name for existing in self.steps):
                raise ConfigurationError(
                    f"pipeline {self.name!r} already has a step named {s.name!r}: "
                    "step names must be unique within a pipeline (pass name=...)."
                )
            s = dataclasses.replace(
                s, parents=self._parents_of(s.name, parents),
                wait_for=self._wait_of(s.name, wait_for),
                wait_timeout=None if wait_for is None else _seconds(
                    f"wait_timeout of {s.name!r}", DEFAULT_WAIT_TIMEOUT if wait_timeout is None
                    else wait_timeout, minimum=0.001),
                delay=0.0 if delay is None else _seconds(f"delay of {s.name!r}", delay,
                                                         minimum=0.0))
            if wait_for is None and wait_timeout is not None:
                raise ConfigurationError(
                    f"step {s.name!r} has a wait_timeout but no wait_for: name the signal")
            if s.wait_for is not None and s.delay:
                raise ConfigurationError(
                    f"step {s.name!r}: wait_for and delay cannot be combined (a waiting step "
                    "starts when its signal arrives)")
            self._check_inputs(s)
            self.steps.append(s)
            return s

        return decorate

    def _parents_of(self, name: str,
                    parents: Sequence[Step[Any, Any] | str] | None) -> tuple[str, ...]:
        if parents is None:  # a chain: the step defined before, if any
            return (self.steps[-1].name,) if self.steps else ()
        if isinstance(parents, str | Step) or not isinstance(parents, Sequence):
            raise ConfigurationError(
                f"parents of {name!r} must be a list of steps, e.g. parents=[fetch, parse]")
        names: list[str] = []
        for p in parents:
            if isinstance(p, Step):
                if not any(p is s for s in self.steps):
                    raise ConfigurationError(
                        f"parent {p.name!r} of step {name!r} is not a step of pipeline "
                        f"{self.name!r} (a parent in another pipeline?)")
                pname = p.name
            elif isinstance(p, str):
                if p == name:
                    raise ConfigurationError(
                        f"step {name!r} cannot be its own parent (that is a cycle)")
                if self.step_named(p) is None:
                    raise ConfigurationError(
                        f"unknown parent {p!r} of step {name!r}: pipeline {self.name!r} has no "
                        "such step yet (define parents before their children: that is also "
                        "what keeps the graph free of cycles)")
                pname = p
            else:
                raise ConfigurationError(
                    f"parents of {name!r} must be steps of {self.name!r}, got {p!r}")
            if pname in names:
                raise ConfigurationError(f"step {name!r} lists parent {pname!r} twice")
            names.append(pname)
        return tuple(names)

    def _wait_of(self, name: str, wait_for: str | None) -> str | None:
        if wait_for is None:
            return None
        signal = _validate_name("signal", wait_for)
        other = next((s for s in self.steps if s.wait_for == signal), None)
        if other is not None:
            raise ConfigurationError(
                f"step {other.name!r} of {self.name!r} already waits for signal {signal!r}: "
                "a signal is delivered to one step of a run")
        return signal

    def _check_inputs(self, s: Step[Any, Any]) -> None:
        """A step with several parents takes each one's result as a keyword named after it,
        and a waiting step its signal's payload: refuse a handler that cannot take them."""
        names = list(s.parents) if len(s.parents) > 1 else []
        if s.wait_for is not None:
            if s.wait_for in names:
                raise ConfigurationError(
                    f"step {s.name!r} waits for signal {s.wait_for!r}, which is also the name "
                    "of one of its parents: rename one")
            names.append(s.wait_for)
        if not names:
            return
        params = list(s.signature.parameters.values())[1:]
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return
        accepted = {p.name for p in params
                    if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        missing = [n for n in names if n not in accepted]
        if missing:
            raise ConfigurationError(
                f"step {s.name!r} {s.signature} cannot take keyword(s) "
                f"{', '.join(map(repr, missing))}: "
                + ("a step with several parents receives each parent's result as a keyword "
                   "named after that parent" if len(s.parents) > 1 else "")
                + ("; " if len(s.parents) > 1 and s.wait_for else "")
                + (f"a step waiting for a signal receives its payload as a keyword named "
                   f"{s.wait_for!r}" if s.wait_for else ""))

    @property
    def first(self) -> Step[Any, Any]:
        if not self.steps:
            raise ConfigurationError(f"pipeline {self.name!r} has no steps")
        return self.steps[0]

    @property
    def roots(self) -> list[Step[Any, Any]]:
        """The steps that start with the run (no parents), in definition order."""
        return [s for s in self.steps if not s.parents]

    def children(self, step: Step[Any, Any]) -> list[Step[Any, Any]]:
        """The steps that list `step` as a parent, in definition order."""
        return [s for s in self.steps if step.name in s.parents]

    @property
    def leaves(self) -> list[Step[Any, Any]]:
        """The steps no other step waits for: the run has succeeded when all of them have."""
        parents = {p for s in self.steps for p in s.parents}
        return [s for s in self.steps if s.name not in parents]

    def step_named(self, name: str) -> Step[Any, Any] | None:
        return next((s for s in self.steps if s.name == name), None)

    def options(self, *, idempotency_key: str | None = None, queue: str | None = None,
                priority: int | None = None, run_at: datetime | None = None,
                delay: float | timedelta | None = None,
                schema: str | None = None, unique: bool = False,
                unique_key: str | None = None) -> EnqueueOptions[...]:
        """This pipeline with enqueue options (see `flowq.enqueue`), to `.enqueue(...)`."""
        return EnqueueOptions(self, idempotency_key=idempotency_key, queue=queue,
                              priority=priority, run_at=run_at, delay=delay, schema=schema,
                              unique=unique, unique_key=unique_key)

    # Untyped: a pipeline's arguments are its first step's, known only once it is added.
    def enqueue(self, target: Target, /, *args: Any, **kwargs: Any) -> Enqueued:
        """Enqueue a run in the transaction of `target`; `flowq.enqueue(target, self, ...)`
        without options (use `.options(...)` for them)."""
        return EnqueueOptions(self).enqueue(target, *args, **kwargs)

    async def aenqueue(self, target: AsyncTarget, /, *args: Any, **kwargs: Any) -> Enqueued:
        """`enqueue` for an AsyncSession or AsyncConnection."""
        return await EnqueueOptions(self).aenqueue(target, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} steps={[s.name for s in self.steps]}>"


class Task(Pipeline, Generic[P, R]):
    """A pipeline of exactly one step; calling it calls the handler directly (handy in tests).

    `P` is the handler's parameters after `ctx`, which are what enqueue takes: `enqueue`,
    `aenqueue` and `options(...).enqueue` are checked against them by a type checker.
    """

    def __call__(self, ctx: Context, /, *args: P.args, **kwargs: P.kwargs) -> R:
        result: R = self.steps[0].fn(ctx, *args, **kwargs)
        return result

    def options(self, *, idempotency_key: str | None = None, queue: str | None = None,
                priority: int | None = None, run_at: datetime | None = None,
                delay: float | timedelta | None = None,
                schema: str | None = None, unique: bool = False,
                unique_key: str | None = None) -> EnqueueOptions[P]:
        """This task with enqueue options (see `flowq.enqueue`), to `.enqueue(...)`."""
        return EnqueueOptions(self, idempotency_key=idempotency_key, queue=queue,
                              priority=priority, run_at=run_at, delay=delay, schema=schema,
                              unique=unique, unique_key=unique_key)

    def enqueue(self, target: Target, /, *args: P.args, **kwargs: P.kwargs) -> Enqueued:
        """Enqueue a run in the transaction of `target` (a Session or Connection), with the
        handler's arguments after `ctx`; `.options(...)` for enqueue options."""
        return self.options().enqueue(target, *args, **kwargs)

    async def aenqueue(self, target: AsyncTarget, /, *args: P.args,
                       **kwargs: P.kwargs) -> Enqueued:
        """`enqueue` for an AsyncSession or AsyncConnection."""
        return await self.options().aenqueue(target, *args, **kwargs)


class FlowQ:
    """The registry of tasks and pipelines, plus the settings producers and workers share.

    `schema` (default "flowq") names the PostgreSQL schema of flowq's tables; `default_queue`
    (default "default") is the queue of tasks that name none.
    """

    def __init__(self, *, schema: str = DEFAULT_SCHEMA, default_queue: str = DEFAULT_QUEUE
                 ) -> None:
        self.schema = validate_schema_name(schema)
        self.default_queue = validate_queue(default_queue)
        self._registry: dict[str, Pipeline] = {}
        self._queues: dict[str, QueueConfig] = {}
        self._schedules: dict[str, Schedule] = {}
        _APPS.add(self)

    def queue(self, name: str, *, concurrency: int | None = None,
              rate_limit: Rate | None = None) -> QueueConfig:
        """Declare queue `name`'s limits, enforced across every worker (see `flowq.queues`):
        at most `concurrency` of its jobs running at once, at most `rate_limit` starts per
        period. Workers write the declaration to the database when they start."""
        config = QueueConfig(validate_queue(name), concurrency, rate_limit)
        if name in self._queues:
            raise ConfigurationError(f"queue {name!r} is already declared in this app")
        self._queues[name] = config
        return config

    @property
    def declared_queues(self) -> list[QueueConfig]:
        """The queues declared with `queue()`, by name."""
        return [self._queues[n] for n in sorted(self._queues)]

    @property
    def keyed_queues(self) -> list[str]:
        """The queues of tasks with a per-key concurrency limit."""
        return sorted({p.steps[0].queue for p in self._registry.values()
                       if p.concurrency_key is not None and p.steps})

    def task(self, *, name: str | None = None, queue: str | None = None, priority: int = 0,
             retry: Retry | None = None,
             timeout: float | None = None,
             concurrency_key: str | Callable[..., Any] | None = None,
             key_concurrency: int | None = None
             ) -> Callable[[Callable[Concatenate[Context, P], R]], Task[P, R]]:
        """Register the decorated function as a task (a pipeline of one step).

        The handler takes the context first; the `Task` is typed by the parameters after it.
        `concurrency_key` (an argument's name, or a function of the arguments returning a
        JSON scalar) with `key_concurrency` (default 1): at most that many jobs with the same
        key run at once in the task's queue, across every worker; other keys are unaffected.
        """

        def decorate(fn: Callable[Concatenate[Context, P], R]) -> Task[P, R]:
            task_name = str(name or getattr(fn, "__name__", ""))
            t: Task[P, R] = Task(self, task_name, queue=queue, priority=priority)
            t.steps.append(_make_step(fn, name=task_name, retry=retry, timeout=timeout,
                                      queue=t.queue, index=0))
            _key_options(t, concurrency_key, key_concurrency)
            self._register(t)
            return t

        return decorate

    def pipeline(self, name: str, *, queue: str | None = None, priority: int = 0) -> Pipeline:
        """Create and register a pipeline; add steps with `@pipeline.step()`."""
        p = Pipeline(self, name, queue=queue, priority=priority)
        self._register(p)
        return p

    @overload
    def periodic(self, target: D, /, *, cron: str | None = None,
                 every: timedelta | float | None = None, name: str | None = None,
                 args: dict[str, Any] | None = None, timezone: str = "UTC",
                 catch_up: bool = False) -> D: ...

    @overload
    def periodic(self, target: None = None, /, *, cron: str | None = None,
                 every: timedelta | float | None = None, name: str | None = None,
                 args: dict[str, Any] | None = None, timezone: str = "UTC",
                 catch_up: bool = False) -> Callable[[D], D]: ...

    def periodic(self, target: D | None = None, /, *, cron: str | None = None,
                 every: timedelta | float | None = None, name: str | None = None,
                 args: dict[str, Any] | None = None, timezone: str = "UTC",
                 catch_up: bool = False) -> D | Callable[[D], D]:
        """Run a task or pipeline periodically: `@app.periodic(cron=...)` above
        `@app.task(...)` (it returns the task itself), or `app.periodic(pipeline, every=...)`.

        Exactly one of `cron` (a cron expression, evaluated in `timezone`, an IANA name) or
        `every` (a timedelta of at least 1 s, ticks aligned to the Unix epoch). `name`
        (default: the task's) is unique per app; `args` are the runs' arguments (JSON, fitting
        the first step). Every worker runs the scheduler; each tick is enqueued once. Missed
        ticks: the latest runs, or all of them with `catch_up=True`. See `flowq.schedules`.
        """

        def register(definition: D) -> D:
            from flowq.schedules import make_schedule

            if not isinstance(definition, Pipeline):
                raise ConfigurationError(
                    "@app.periodic(...) schedules a task or pipeline: put it above "
                    f"@app.task(...), or pass a pipeline; got {definition!r}")
            if definition.app is not self or self._registry.get(definition.name) is not definition:
                raise ConfigurationError(
                    f"{definition.name!r} is not a task or pipeline of this app")
            schedule = make_schedule(definition, cron=cron, every=every, name=name, args=args,
                                     timezone=timezone, catch_up=catch_up)
            if schedule.name in self._schedules:
                raise ConfigurationError(
                    f"a schedule named {schedule.name!r} is already defined in this app "
                    "(pass name=... to tell them apart)")
            if definition.steps:  # a pipeline's steps may come later: checked at worker start
                schedule.check()
            self._schedules[schedule.name] = schedule
            return definition

        return register if target is None else register(target)

    @property
    def schedules(self) -> list[Schedule]:
        """The schedules defined with `periodic()`, by name."""
        return [self._schedules[n] for n in sorted(self._schedules)]

    def _register(self, p: Pipeline) -> None:
        if p.name in self._registry:
            raise ConfigurationError(
                f"a task or pipeline named {p.name!r} is already registered in this app "
                "(pass name=... to tell them apart)."
            )
        self._registry[p.name] = p

    def get(self, name: str) -> Pipeline | None:
        """The task or pipeline registered under `name`, or None."""
        return self._registry.get(name)

    def __iter__(self) -> Iterator[Pipeline]:
        return iter(self._registry.values())

    def __contains__(self, name: object) -> bool:
        return name in self._registry

    @property
    def queues(self) -> list[str]:
        """Every queue a task or step of this app runs on, sorted."""
        return sorted({s.queue for p in self._registry.values() for s in p.steps})

    def check(self) -> None:
        """Raise ConfigurationError if a pipeline has no steps, or a schedule's arguments do
        not fit its pipeline (workers call this at start)."""
        for p in self._registry.values():
            if not p.steps:
                raise ConfigurationError(
                    f"pipeline {p.name!r} has no steps: add one with @{p.name}.step()"
                )
        for schedule in self._schedules.values():
            schedule.check()


def _key_options(t: Pipeline, key: str | Callable[..., Any] | None,
                 limit: int | None) -> None:
    if key is None:
        if limit is not None:
            raise ConfigurationError(
                f"task {t.name!r} has key_concurrency but no concurrency_key: name the "
                "argument (or give a function of the arguments) that keys it")
        return
    if isinstance(key, str):
        params = list(t.steps[0].signature.parameters.values())[1:]
        names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if key not in names:
            raise ConfigurationError(
                f"concurrency_key {key!r} of task {t.name!r} is not one of its arguments "
                f"({', '.join(sorted(names)) or 'it takes none'})")
    elif not callable(key):
        raise ConfigurationError(f"concurrency_key of task {t.name!r} must be an argument "
                                 f"name or a function of the arguments, got {key!r}")
    limit = 1 if limit is None else limit
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 2**31 - 1:
        raise ConfigurationError(
            f"key_concurrency of task {t.name!r} must be an integer of at least 1 (and at most "
            f"{2**31 - 1}), got {limit!r}")
    t.concurrency_key, t.key_concurrency = key, limit


def find_definition(name: str, schema: str) -> Pipeline | None:
    """The definition of `name` in any live app of `schema`, so enqueue-by-name can validate."""
    for app in list(_APPS):
        if app.schema == schema:
            found = app.get(name)
            if found is not None:
                return found
    return None
