"""A step: one handler of a pipeline, with its own retry policy, timeout and queue.

`make_step(fn, ...)` checks a handler when it is defined, so a mistake fails at import time:
a handler must take the context first (`def handler(ctx, ...)`), may not have a parameter
named like an enqueue option (`flowq.define.options.RESERVED_OPTIONS`), and its name (its
function's `__name__` unless `name=` is given) must be a valid name. `Step.check_arguments`
binds arguments against the handler, for enqueue and for the worker alike; `Step.check_input`
does so with the keyword a waiting step receives its signal's payload under.

`StepContext` is what the definitions know of the context a handler is called with: the
worker's `flowq.Context` is one, and the definitions never import it (it belongs to the
durable wing, which imports them).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final, Generic, ParamSpec, Protocol, TypeVar

from flowq.define.options import RESERVED_OPTIONS
from flowq.define.retry import Retry
from flowq.errors import ConfigurationError, InvalidArgumentsError
from flowq.names import validate_name, validate_queue
from flowq.storable import MAX_DELAY

__all__ = ["MAX_REMEMBERED_NAME_SETS", "MAX_STEP_INDEX", "Step", "StepContext", "as_seconds",
           "make_step"]

P = ParamSpec("P")
R = TypeVar("R")

# How many distinct argument-name sets a step remembers as fitting (a **kwargs handler could
# see unboundedly many).
MAX_REMEMBERED_NAME_SETS: Final = 256
# A step's index (its place in definition order, from 0) is stored in `flowq.jobs.step_index`,
# a smallint: a pipeline has at most MAX_STEP_INDEX + 1 = 32,768 steps.
MAX_STEP_INDEX: Final = 2**15 - 1


class StepContext(Protocol):
    """The context a handler is called with, as the definitions see it (`flowq.Context` is
    one): a handler declared to take a `flowq.Context`, or any type a `flowq.Context` is, is
    accepted by `FlowQ.task` and `FlowQ.pipeline`; one that cannot take it is refused by a
    type checker."""

    @property
    def job_id(self) -> int: ...

    @property
    def run_id(self) -> int: ...

    @property
    def step(self) -> str: ...

    @property
    def attempt(self) -> int: ...


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

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """The handler itself (handy in tests), typed like it: `P` includes `ctx`."""
        result: R = self.fn(*args, **kwargs)
        return result

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

    def with_signal(self, args: dict[str, Any], payload: Any = None) -> dict[str, Any]:
        """`args` as this step receives them: a step that waits for a signal gets its payload
        as the argument named by `wait_for`. Checked before the signal came (at enqueue, or
        when a predecessor succeeds), the payload is `None`: its slot counts as given. `args`
        itself when the step waits for none."""
        if self.wait_for is None:
            return args
        return {**args, self.wait_for: payload}

    def check_input(self, args: dict[str, Any], what: str = "arguments") -> None:
        """`check_arguments` for the keywords this step is called with: `args` and, for a
        step waiting for a signal, its payload under the signal's name (not known yet)."""
        self.check_arguments(self.with_signal(args), what)

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


def as_seconds(what: str, value: object, *, minimum: float) -> float:
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


def make_step(fn: Callable[..., Any], *, name: str | None, retry: Retry | None,
               timeout: float | None, queue: str, index: int) -> Step[Any, Any]:
    if not callable(fn):
        raise ConfigurationError(f"a step handler must be a function, got {fn!r}")
    step_name = validate_name("step", name or getattr(fn, "__name__", ""))
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

