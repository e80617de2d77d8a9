"""The registry: `FlowQ` holds the tasks and pipelines a worker can run and producers enqueue.

Names are stable identifiers stored in rows: a task's name is its function's `__name__` unless
`name=` is given, a pipeline's is the name it is created with (`app.pipeline("name")`), or
its first step function's `__name__` (`@app.pipeline()` above it); two registrations of one name
in an app are an error at definition time, except versions of a pipeline
(`pipeline(name, version=N)`, each number once): `get(name)` is the newest, on which new runs
start, and `versions(name)` all of them, which runs in flight continue on. Besides the definitions, an app holds the settings
producers and workers share (`schema`, `default_queue`), its queues' declared limits
(`queue()`) and its schedules (`periodic()`).

`find_definition(name, schema)` finds a definition in any live app of a schema, so that an
enqueue by name can still check its arguments; `defined_names(schema)` lists them all, and
`did_you_mean(name, known)` names the close ones, for the errors about a name nobody defines.
"""

from __future__ import annotations

import difflib
import weakref
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar, cast, overload

from flowq.define.options import check_deadline
from flowq.define.pipeline import Pipeline, Task
from flowq.define.queues import QueueConfig, Rate
from flowq.define.retry import Retry
from flowq.define.schedules import Schedule, make_schedule
from flowq.define.step import StepContext, make_step
from flowq.errors import ConfigurationError, InvalidArgumentsError
from flowq.names import DEFAULT_QUEUE, DEFAULT_SCHEMA, validate_queue, validate_schema_name

__all__ = ["FlowQ", "MakesPipeline", "MakesTask", "defined_names", "did_you_mean",
           "find_definition"]

P = ParamSpec("P")
R = TypeVar("R")
C = TypeVar("C", bound=StepContext)
D = TypeVar("D", bound=Pipeline)


class MakesTask(Protocol):
    """What `@app.task(...)` applies to a handler: it takes the context first (annotated
    `flowq.Context`, a type one is, or `object`), and the `Task` is typed by the parameters
    after it."""

    @overload
    def __call__(self, fn: Callable[Concatenate[object, P], R], /) -> Task[P, R]: ...

    @overload
    def __call__(self, fn: Callable[Concatenate[C, P], R], /) -> Task[P, R]: ...


class MakesPipeline(Protocol):
    """What `@app.pipeline(...)` applies to a first step's handler (see `MakesTask`); the
    `Pipeline` is typed by the parameters after the context."""

    @overload
    def __call__(self, fn: Callable[Concatenate[object, P], R], /) -> Pipeline[P]: ...

    @overload
    def __call__(self, fn: Callable[Concatenate[C, P], R], /) -> Pipeline[P]: ...

_APPS: weakref.WeakSet[FlowQ] = weakref.WeakSet()


class FlowQ:
    """The registry of tasks and pipelines, plus the settings producers and workers share.

    `schema` (default "flowq") names the PostgreSQL schema of flowq's tables; `default_queue`
    (default "default") is the queue of tasks that name none.
    """

    def __init__(self, *, schema: str = DEFAULT_SCHEMA, default_queue: str = DEFAULT_QUEUE
                 ) -> None:
        self.schema = validate_schema_name(schema)
        self.default_queue = validate_queue(default_queue)
        self._registry: dict[str, Pipeline] = {}  # the newest version of each name
        self._versions: dict[str, list[Pipeline]] = {}  # every version, oldest first
        self._queues: dict[str, QueueConfig] = {}
        self._schedules: dict[str, Schedule[Pipeline]] = {}
        _APPS.add(self)

    def queue(self, name: str, *, concurrency: int | None = None,
              rate_limit: Rate | None = None) -> QueueConfig:
        """Declare queue `name`'s limits, enforced across every worker (see `flowq.define.queues`):
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
             key_concurrency: int | None = None,
             deadline: float | timedelta | None = None
             ) -> MakesTask:
        """Register the decorated function as a task (a pipeline of one step).

        The handler takes the context first; the `Task` is typed by the parameters after it.
        `concurrency_key` (an argument's name, or a function of the arguments returning a
        JSON scalar) with `key_concurrency` (default 1): at most that many jobs with the same
        key run at once in the queue the job runs in, across every worker; other keys are unaffected.
        `deadline` (seconds or a timedelta): each run's default `deadline=`, from its enqueue.
        """

        def decorate(fn: Callable[..., Any]) -> Task[..., Any]:
            task_name = str(name or getattr(fn, "__name__", ""))
            t: Task[..., Any] = Task(self, task_name, queue=queue, priority=priority)
            t.steps.append(make_step(fn, name=task_name, retry=retry, timeout=timeout,
                                      queue=t.queue, index=0))
            _key_options(t, concurrency_key, key_concurrency)
            t.deadline = _default_deadline(t.name, deadline)
            self._register(t)
            return t

        # Typed by its overloads (one function cannot be written as both).
        return cast(MakesTask, decorate)

    @overload
    def pipeline(self, name: str, /, *, queue: str | None = None, priority: int = 0,
                 deadline: float | timedelta | None = None, version: int = 1) -> Pipeline: ...

    @overload
    def pipeline(self, *, name: str | None = None, queue: str | None = None,
                 priority: int = 0, retry: Retry | None = None, timeout: float | None = None,
                 deadline: float | timedelta | None = None, version: int = 1
                 ) -> MakesPipeline: ...

    def pipeline(self, *named: str, name: str | None = None, queue: str | None = None,
                 priority: int = 0, retry: Retry | None = None, timeout: float | None = None,
                 deadline: float | timedelta | None = None, version: int = 1
                 ) -> Pipeline | MakesPipeline:
        """Create and register a pipeline; add steps with `@pipeline.step()`.

        `app.pipeline("name")` is a pipeline without steps yet, so a type checker cannot know
        its arguments (`Pipeline[...]`). Above a function, `@app.pipeline()` makes that
        function its first step (with `retry=`, `timeout=`) and names the pipeline after it
        unless `name=` is given; the pipeline is then a `Pipeline[P]`, typed like a task by
        the first step's parameters after `ctx`, so its `enqueue` is checked. `deadline`
        (seconds or a timedelta): each run's default `deadline=`, from its enqueue.

        `version` (default 1): several versions of one name may be defined side by side. New
        runs start on the newest; a run continues on the version it started under for as
        long as the code keeps it (docs/pipelines.md, "Deploying changes").
        """
        # `*named`: the name positional-only, beside a keyword `name` (the decorator's).
        if named:
            if len(named) > 1 or name is not None or retry is not None or timeout is not None:
                raise ConfigurationError(
                    "app.pipeline(name) takes queue= and priority=; retry= and timeout= are "
                    "for a first step: @app.pipeline(name=..., retry=...) above its function")
            p: Pipeline = Pipeline(self, named[0], queue=queue, priority=priority,
                                   version=version)
            p.deadline = _default_deadline(p.name, deadline)
            self._register(p)
            return p

        def decorate(fn: Callable[..., Any]) -> Pipeline[...]:
            typed: Pipeline[...] = Pipeline(self, str(name or getattr(fn, "__name__", "")),
                                          queue=queue, priority=priority, version=version)
            typed.deadline = _default_deadline(typed.name, deadline)
            typed.step(retry=retry, timeout=timeout)(fn)
            self._register(typed)
            return typed

        return cast(MakesPipeline, decorate)

    def versions(self, name: str) -> list[Pipeline]:
        """Every version of the pipeline (or task) `name`, oldest first ([] if none)."""
        return list(self._versions.get(name, ()))

    @property
    def definitions(self) -> list[Pipeline]:
        """Every version of every task and pipeline, by name then version."""
        return [p for n in sorted(self._versions) for p in self._versions[n]]

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
        ticks: the latest runs, or all of them with `catch_up=True`. See `flowq.define.schedules`.
        """

        def register(definition: D) -> D:
            if not isinstance(definition, Pipeline):
                raise ConfigurationError(
                    "@app.periodic(...) schedules a task or pipeline: put it above "
                    f"@app.task(...), or pass a pipeline; got {definition!r}")
            if definition.app is not self or self._registry.get(definition.name) is not definition:
                raise ConfigurationError(
                    f"{definition.name!r} is not a task or pipeline of this app")
            schedule: Schedule[Pipeline] = make_schedule(
                definition, cron=cron, every=every, name=name, args=args,
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
    def schedules(self) -> list[Schedule[Pipeline]]:
        """The schedules defined with `periodic()`, by name."""
        return [self._schedules[n] for n in sorted(self._schedules)]

    def _register(self, p: Pipeline) -> None:
        versions = self._versions.get(p.name, [])
        if any(v.version == p.version for v in versions) or (
                versions and (isinstance(p, Task) or isinstance(versions[0], Task))):
            raise ConfigurationError(
                f"a task or pipeline named {p.name!r} is already registered in this app "
                "(pass name=... to tell them apart, or version=... for a new version of a "
                "pipeline)."
            )
        versions = sorted([*versions, p], key=lambda v: v.version)
        self._versions[p.name] = versions
        self._registry[p.name] = versions[-1]

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
        return sorted({s.queue for p in self.definitions for s in p.steps})

    def check(self) -> None:
        """Raise ConfigurationError if a pipeline has no steps, or a schedule's arguments do
        not fit its pipeline (workers call this at start)."""
        for p in self.definitions:
            if not p.steps:
                raise ConfigurationError(
                    f"pipeline {p.name!r} has no steps: add one with @{p.name}.step()"
                )
        for schedule in self._schedules.values():
            schedule.check()


def _default_deadline(name: str, deadline: object) -> timedelta | None:
    """A definition's default deadline, checked by the enqueue option's rules (a duration:
    an absolute time cannot be every run's)."""
    if deadline is None:
        return None
    try:
        checked = check_deadline(deadline, "deadline", absolute=False)
    except InvalidArgumentsError as exc:
        raise ConfigurationError(f"{name!r}: {exc}") from None
    assert isinstance(checked, timedelta)
    return checked


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


def defined_names(schema: str) -> list[str]:
    """Every task and pipeline name the live apps of `schema` define, sorted."""
    return sorted({p.name for app in list(_APPS) if app.schema == schema for p in app})


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """"did you mean 'x'?" (or "'x' or 'y'") for the names of `known` close to `name` (a
    typo's likely intent, by difflib's ratio), else ''. Names are shown with repr: `name`
    and `known` may come from anyone."""
    close = difflib.get_close_matches(name, sorted(set(known) - {name}), n=3, cutoff=0.6)
    if not close:
        return ""
    return f"did you mean {' or '.join(repr(c) for c in close)}?"


def live_apps(schema: str) -> list[FlowQ]:
    """The live apps of `schema` (those this process imported), e.g. for the dashboard's
    schedules page when it was given none."""
    return [app for app in list(_APPS) if app.schema == schema]
