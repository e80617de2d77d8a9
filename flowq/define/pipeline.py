"""Pipelines and tasks: what a run is made of, in the order its steps run.

A task is a pipeline of one step, so there is one model underneath: a `Pipeline` is a list
of `Step`s that form a graph (a chain by default; `parents=` joins, `wait_for=` waits for a
signal, `delay=` starts later), and a `Task` is one with a single step, typed by its
handler's parameters after `ctx` (`P`). Which steps a run starts with is decided here, once
(`Pipeline.starts_many`, `Pipeline.check_start_arguments`), for enqueue and the worker.

A pipeline has a `version` (1 unless `FlowQ.pipeline(name, version=N)`) and a stable
`fingerprint` of its `shape` (`flowq.define.shape`), recorded on every run it starts.

Definitions also enqueue themselves: `add.enqueue(session, a=1)`, with options through
`add.options(**EnqueueOptions)` and an async twin `await add.aenqueue(async_session, a=1)`.
They are typed by `P`, the first step's parameters after `ctx`, so a type checker refuses a
misspelt, missing or mistyped argument: a `Task[P, R]` is typed by its handler, and a
pipeline created from its first step (`@app.pipeline()` above that step's function) is a
`Pipeline[P]`. A pipeline created by name (`app.pipeline("name")`) gets its steps only
after it exists, so it is a `Pipeline[...]`: any arguments type-check, and are checked at
run time like every enqueue. With several roots a run's arguments go to every root; the
type is the first step's (`check_start_arguments` still refuses, at enqueue, what another
root cannot take). They are thin: the validation and SQL are `flowq.enqueue`'s, imported
when first called (the one run-time import of a definition module from the layer above
it). What a step is declared to return is checked against the step after it when that step
is added (`flowq.define.typecheck`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final, Generic, ParamSpec, TypeVar

from flowq.define.graph import StepIndex, check_inputs, parents_of, wait_of
from flowq.define.options import EnqueueOptions
from flowq.define.retry import Retry
from flowq.define.shape import fingerprint_of, shape_of
from flowq.define.step import MAX_STEP_INDEX, Step, StepContext, as_seconds, make_step
from flowq.define.typecheck import check_step_types
from flowq.errors import ConfigurationError, InvalidArgumentsError
from flowq.jsonargs import JSONError, dumps_checked
from flowq.names import validate_name, validate_priority, validate_queue

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11 on

    from flowq.define.app import FlowQ
    from flowq.enqueueing.aio import AsyncTarget
    from flowq.enqueueing.prepare import Enqueued, PreparedCall
    from flowq.enqueueing.sync import Target

__all__ = ["DEFAULT_WAIT_TIMEOUT", "Pipeline", "Task", "WithOptions", "as_keywords"]

if TYPE_CHECKING:
    # A bare `Pipeline` means `Pipeline[...]` (any arguments), not an error under --strict:
    # a ParamSpec default (PEP 696) is in typing_extensions, which type checkers read here;
    # at run time the plain ParamSpec does, so flowq needs no typing_extensions of its own.
    from typing_extensions import ParamSpec as ParamSpecWithDefault
    from typing_extensions import TypeVar as TypeVarWithDefault

    P = ParamSpecWithDefault("P", default=...)
    T = TypeVarWithDefault("T", default=Any)  # a task's return type; `Task` is `Task[..., Any]`
else:
    P = ParamSpec("P")
    T = TypeVar("T")
Q = ParamSpec("Q")
R = TypeVar("R")

# A waiting step's default timeout: a week, so a forgotten signal ends the run (by its
# retry policy) instead of leaving it waiting forever.
DEFAULT_WAIT_TIMEOUT: Final = timedelta(days=7)


def as_keywords(definition: Pipeline, args: tuple[Any, ...],
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
class WithOptions(Generic[P]):
    """A task or pipeline with enqueue options, from `definition.options(...)`; enqueue it with
    `.enqueue(session_or_connection, ...)` or `await .aenqueue(async_session, ...)`.

    Typed by the first step's parameters after `ctx` (`P`), like the definition it comes
    from. The options mean what they mean to `flowq.enqueue`, and are checked there, when enqueueing.
    """

    definition: Pipeline[...]
    options: EnqueueOptions

    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PreparedCall[Enqueued]:
        # Imported here, the one run-time import of the definitions from the layer above
        # (tests/unit/test_imports.py allows exactly it): enqueue imports the definitions.
        from flowq.enqueueing.prepare import prepare_enqueue

        return prepare_enqueue(self.definition, as_keywords(self.definition, args, kwargs),
                               **self.options)

    def enqueue(self, target: Target, /, *args: P.args, **kwargs: P.kwargs) -> Enqueued:
        """Enqueue a run in the transaction of `target` (a Session or Connection); see
        `flowq.enqueue`. Positional arguments are named after the handler's parameters."""
        from flowq.enqueueing.sync import execute

        return execute(target, self._prepare(args, kwargs))

    async def aenqueue(self, target: AsyncTarget, /, *args: P.args,
                       **kwargs: P.kwargs) -> Enqueued:
        """Enqueue a run in the transaction of an AsyncSession or AsyncConnection."""
        call = self._prepare(args, kwargs)
        # Imported on first use: `import flowq` must not import SQLAlchemy's asyncio
        # extension (SQLAlchemy 2.1 no longer installs the greenlet it needs).
        from flowq.enqueueing.aio import execute

        return await execute(target, call)


class Pipeline(Generic[P]):
    """An ordered chain of steps run as one run; each step's dict result feeds the next.

    Steps run in definition order. Enqueue a pipeline exactly like a task; its first step's
    signature validates the arguments, and types them (`P`) when the pipeline was created
    from that step (see the module).
    """

    def __init__(self, app: FlowQ, name: str, *, queue: str | None = None,
                 priority: int = 0, version: int = 1) -> None:
        self.app = app
        self.name = validate_name("pipeline", name)
        # Versions of one name live side by side (`FlowQ.pipeline(name, version=N)`): new
        # runs start on the newest, a run continues on the one it started under.
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= 2**31 - 1:
            raise ConfigurationError(
                f"version of pipeline {self.name!r} must be an integer of at least 1, "
                f"got {version!r}")
        self.version = version
        self._shape: tuple[int, dict[str, Any], str] | None = None
        self.queue = validate_queue(queue or app.default_queue)
        try:  # refused when declared, not at the first enqueue
            self.priority = validate_priority(priority)
        except InvalidArgumentsError as exc:
            raise ConfigurationError(f"{self.name!r}: {exc}") from None
        self.steps: list[Step[Any, Any]] = []
        self._index = StepIndex()
        # Per-key concurrency (tasks only, see `FlowQ.task`): the argument naming the key, or
        # a function of the arguments; and how many jobs of one key may run at once.
        self.concurrency_key: str | Callable[..., Any] | None = None
        self.key_concurrency: int | None = None
        # The default run deadline from each enqueue (`FlowQ.task(deadline=...)`; None: none).
        self.deadline: timedelta | None = None

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
        try:
            return dumps_checked(value, f"the concurrency key of {self.name!r}")
        except JSONError as exc:
            raise InvalidArgumentsError(str(exc)) from None

    def step(self, *, name: str | None = None, retry: Retry | None = None,
             timeout: float | None = None, queue: str | None = None,
             parents: Sequence[Step[Any, Any] | str] | None = None,
             wait_for: str | None = None, wait_timeout: float | timedelta | None = None,
             delay: float | timedelta | None = None
             ) -> Callable[[Callable[Q, R]], Step[Q, R]]:
        """Register the decorated function as a step of this pipeline.

        Without `parents=` it follows the step defined before it (a chain); `parents=[a, b]`
        makes it wait for both (a join: it receives each parent's result as a keyword named
        after that parent); `parents=[]` makes it a root, started with the run. `wait_for=`
        names a signal it waits for (its payload arrives as a keyword of that name), at most
        `wait_timeout` (default 7 days); `delay=` starts it that long after its parents
        finished. Parents must be defined before their children, so a graph has no cycles.
        A step whose declared return type certainly does not fit what its children take is
        refused here too (`flowq.define.typecheck`).
        """

        def decorate(fn: Callable[Q, R]) -> Step[Q, R]:
            if len(self.steps) > MAX_STEP_INDEX:
                raise ConfigurationError(
                    f"pipeline {self.name!r} already has {MAX_STEP_INDEX + 1:,} steps, the "
                    f"most a pipeline can have (a step's index is stored as a smallint): "
                    "split it into pipelines that start one another, or map one step over "
                    "the items with flowq.each()")
            s = make_step(fn, name=name, retry=retry, timeout=timeout,
                           queue=queue or self.queue, index=len(self.steps))
            if self.step_named(s.name) is not None:
                raise ConfigurationError(
                    f"pipeline {self.name!r} already has a step named {s.name!r}: "
                    "step names must be unique within a pipeline (pass name=...)."
                )
            s = dataclasses.replace(
                s, parents=parents_of(self.name, self.steps, self._indexed(), s.name, parents),
                wait_for=wait_of(self.name, self._indexed(), s.name, wait_for),
                wait_timeout=None if wait_for is None else as_seconds(
                    f"wait_timeout of {s.name!r}", DEFAULT_WAIT_TIMEOUT if wait_timeout is None
                    else wait_timeout, minimum=0.001),
                delay=0.0 if delay is None else as_seconds(f"delay of {s.name!r}", delay,
                                                         minimum=0.0))
            if wait_for is None and wait_timeout is not None:
                raise ConfigurationError(
                    f"step {s.name!r} has a wait_timeout but no wait_for: name the signal")
            if s.wait_for is not None and s.delay:
                raise ConfigurationError(
                    f"step {s.name!r}: wait_for and delay cannot be combined (a waiting step "
                    "starts when its signal arrives)")
            check_inputs(s)
            check_step_types(s, [self._indexed().by_name[p] for p in s.parents],
                             self.step_named)
            self.steps.append(s)  # indexed when next looked up
            return s

        return decorate

    @property
    def first(self) -> Step[Any, Any]:
        if not self.steps:
            raise ConfigurationError(f"pipeline {self.name!r} has no steps")
        return self.steps[0]

    @property
    def roots(self) -> list[Step[Any, Any]]:
        """The steps that start with the run (no parents), in definition order."""
        return list(self._indexed().roots)

    @property
    def starts_many(self) -> bool:
        """Whether a run starts with more than its first step's one row, due at once: it has
        several roots, or a root that waits for a signal or is delayed. Decided here once:
        enqueue then inserts one row per root, and a run enqueued without the definition (one
        row for step '') is started by the worker, which spawns every root instead."""
        roots = self.roots
        return len(roots) > 1 or roots[0].wait_for is not None or bool(roots[0].delay)

    def check_start_arguments(self, args: dict[str, Any], what: str = "arguments") -> None:
        """Raise InvalidArgumentsError unless `args` fit every step a run starts with (with
        a waiting root's signal slot): the first step, or every root if `starts_many`."""
        if self.starts_many:
            for root in self.roots:
                root.check_input(args, what)
        else:
            self.first.check_arguments(args, what)

    def children(self, step: Step[Any, Any]) -> list[Step[Any, Any]]:
        """The steps that list `step` as a parent, in definition order."""
        return list(self._indexed().children.get(step.name, ()))

    @property
    def leaves(self) -> list[Step[Any, Any]]:
        """The steps no other step waits for: the run has succeeded when all of them have."""
        children = self._indexed().children
        return [s for s in self.steps if s.name not in children]

    def step_named(self, name: str) -> Step[Any, Any] | None:
        """The step called `name` (a worker asks once per claimed job: a dict lookup)."""
        return self._indexed().by_name.get(name)

    def _indexed(self) -> StepIndex:
        """The lookups over `steps`, brought up to date with it: steps are only ever
        appended (by `step()`, and a task's one step by `FlowQ.task`)."""
        index = self._index
        if index.count != len(self.steps):
            for s in self.steps[index.count:]:
                index.add(s)
        return index

    @property
    def shape(self) -> dict[str, Any]:
        """What a run's rows depend on: steps, parents, waits, parameters (`flowq.define.shape`)."""
        return self._shaped()[1]

    @property
    def fingerprint(self) -> str:
        """The stable fingerprint of `shape`, recorded on every run started on it."""
        return self._shaped()[2]

    def _shaped(self) -> tuple[int, dict[str, Any], str]:
        # Steps are only appended: the shape is recomputed when their number changed.
        if self._shape is None or self._shape[0] != len(self.steps):
            shape = shape_of(self)
            self._shape = (len(self.steps), shape, fingerprint_of(shape))
        return self._shape

    def options(self, **options: Unpack[EnqueueOptions]) -> WithOptions[P]:
        """This pipeline with enqueue options (see `flowq.enqueue`), to `.enqueue(...)`."""
        return WithOptions(self, options)

    def enqueue(self, target: Target, /, *args: P.args, **kwargs: P.kwargs) -> Enqueued:
        """Enqueue a run in the transaction of `target` (a Session or Connection), with the
        first step's arguments after `ctx`; `.options(...)` for enqueue options."""
        return self.options().enqueue(target, *args, **kwargs)

    async def aenqueue(self, target: AsyncTarget, /, *args: P.args,
                       **kwargs: P.kwargs) -> Enqueued:
        """`enqueue` for an AsyncSession or AsyncConnection."""
        return await self.options().aenqueue(target, *args, **kwargs)

    def __repr__(self) -> str:
        version = f" version={self.version}" if self.version != 1 else ""
        return (f"<{type(self).__name__} {self.name!r}{version} "
                f"steps={[s.name for s in self.steps]}>")


class Task(Pipeline[P], Generic[P, T]):
    """A pipeline of exactly one step; calling it calls the handler directly (handy in tests).

    `P` is the handler's parameters after `ctx`, which are what enqueue takes: `enqueue`,
    `aenqueue` and `options(...).enqueue` are checked against them by a type checker.
    """

    def __call__(self, ctx: StepContext, /, *args: P.args, **kwargs: P.kwargs) -> T:
        result: T = self.steps[0].fn(ctx, *args, **kwargs)
        return result
