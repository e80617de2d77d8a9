"""Workflows beyond chains: map a step over a list, and signals sent in your transaction.

A pipeline is a DAG of steps (`@pipeline.step(parents=[...])`, see `flowq.app`); what is
decided at run time lives here:

- `each(items)`: a step returns it to run its one child step once per item, in parallel,
  each instance with the item as its keyword arguments and its own retries and lease. The
  step after the mapped one (a join) receives the list of the instances' results, in item
  order, as the keyword named after the mapped step. At most `MAX_MAP_ITEMS` items.
- `signal(target, run_id, name, payload)`: deliver `payload` (JSON) to the step of run
  `run_id` that waits for `name` (`@pipeline.step(wait_for=name)`), in the transaction of
  `target` (a Session or Connection): it is delivered if and only if that transaction
  commits. Sent before the step is reached, it is kept and handed over when it is. Sent
  twice: an identical payload is ignored (`created=False`), another one is refused with
  `SignalError`. The async twin is `flowq.aio.signal`; `flowq.Session` has `.signal(...)`.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from flowq.app import Step, find_definition
from flowq.errors import RunNotFoundError, RunStateError, SignalError, WorkflowError
from flowq.jsonargs import JSONError, dumps_checked
from flowq.queries import queries
from flowq.schema import DEFAULT_SCHEMA, notify_channel

__all__ = ["MAX_MAP_BYTES", "MAX_MAP_ITEMS", "Each", "PreparedSignal", "Signalled", "each",
           "prepare_signal", "with_signal"]

# The most items one `each()` may map over: every instance is a row inserted by the
# transaction that completes the mapping step, and its result is read back by the join.
MAX_MAP_ITEMS: Final = 100_000
# And at most this much JSON in all: the items travel in one statement (a PostgreSQL array
# parameter is limited to 1 GB) and are stored as the mapping step's result.
MAX_MAP_BYTES: Final = 256 * 1024 * 1024


@dataclass(frozen=True)
class Each:
    """What `each(items)` returns: the items, and each one's JSON text (checked once)."""

    items: tuple[dict[str, Any], ...]
    texts: tuple[str, ...]

    @property
    def json(self) -> str:
        """The items as one JSON array: the mapping step's stored result."""
        return "[" + ", ".join(self.texts) + "]"


def each(items: Iterable[Mapping[str, Any]]) -> Each:
    """Map the returning step's child over `items` (dicts of keyword arguments), in parallel.

    Raises WorkflowError (the step then ends `dead`, as retrying would fail the same way)
    unless `items` is a list (or other iterable, not a string or a mapping) of at most
    `MAX_MAP_ITEMS` dicts with string keys whose values are JSON, `MAX_MAP_BYTES` in all.
    """
    if isinstance(items, str | bytes | Mapping) or not isinstance(items, Iterable):
        raise WorkflowError(
            f"flowq.each() takes a list of dicts (one per instance), got {type(items).__name__}")
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    size = 0
    for i, item in enumerate(items):
        if i >= MAX_MAP_ITEMS:
            raise WorkflowError(
                f"flowq.each() maps at most {MAX_MAP_ITEMS:,} items: split the work (or map "
                "over batches of items)")
        if not isinstance(item, Mapping):
            raise WorkflowError(
                f"item {i} of flowq.each() is a {type(item).__name__}, not a dict of keyword "
                "arguments")
        item = dict(item)
        try:
            texts.append(dumps_checked(item, f"item {i} of flowq.each()"))
        except JSONError as exc:
            raise WorkflowError(str(exc)) from None
        size += len(texts[-1])
        if size > MAX_MAP_BYTES:
            raise WorkflowError(
                f"the items of flowq.each() exceed {MAX_MAP_BYTES // 2**20} MiB of JSON: pass "
                "references (ids, keys) rather than the data itself")
        out.append(item)
    return Each(tuple(out), tuple(texts))


def with_signal(step: Step[Any, Any], args: dict[str, Any], payload: Any = None
                ) -> dict[str, Any]:
    """`args` as `step` receives them: a step that waits for a signal gets its payload as the
    argument named by `wait_for`. Checked before the signal came (at enqueue, or when a
    predecessor succeeds), the payload is `None`: its slot counts as given. `args` itself
    when the step waits for none."""
    if step.wait_for is None:
        return args
    return {**args, step.wait_for: payload}


@dataclass(frozen=True)
class Signalled:
    """What `signal` returns: `created=False` when the same payload had already been sent."""

    run_id: int
    name: str
    created: bool
    delivered: bool  # the waiting step was reached and is now runnable


@dataclass(frozen=True)
class PreparedSignal:
    """A validated signal, ready to run on a sync or async connection (like an enqueue's
    `PreparedCall`: `statements()` yields each statement and is sent its first row)."""

    params: dict[str, Any]
    schema: str
    direct: bool = False

    @property
    def statement(self) -> Any:
        return queries(self.schema).select_run_state

    def statements(self) -> Generator[Any, Sequence[Any] | None, Signalled]:
        q = queries(self.schema)
        run_id, name = self.params["run_id"], self.params["name"]
        state = yield q.select_run_state
        task, rows, active, cancelled = state if state is not None else (None, 0, 0, False)
        if not rows:
            raise RunNotFoundError(f"no run {run_id} exists to signal (it may have been pruned,"
                                   " or the id is a job id rather than a run id)")
        if cancelled:
            raise RunStateError(f"run {run_id} was cancelled: signal {name!r} cannot be "
                                "delivered")
        if not active:
            raise RunStateError(f"run {run_id} has finished: signal {name!r} cannot be "
                                "delivered")
        definition = find_definition(str(task), self.schema)
        if definition is not None and not any(s.wait_for == name for s in definition.steps):
            waited = sorted(s.wait_for for s in definition.steps if s.wait_for)
            raise SignalError(
                f"no step of {task!r} waits for signal {name!r}"
                + (f" (it waits for {', '.join(map(repr, waited))})" if waited else
                   " (none of its steps waits for a signal)"))
        sent = yield q.send_signal
        if sent is None:
            same = yield q.compare_signal
            if same is not None and same[0]:
                return Signalled(run_id, name, created=False, delivered=False)
            raise SignalError(f"signal {name!r} was already sent to run {run_id} with another "
                              "payload: a signal is delivered once")
        step = sent[0]
        if step is None:  # not reached yet: the step takes the payload when it is
            return Signalled(run_id, name, created=True, delivered=False)
        self.params["step"] = step
        woken = yield q.wake_signalled_step
        return Signalled(run_id, name, created=True, delivered=woken is not None)


def prepare_signal(run_id: int, name: str, payload: Any = None, *,
                   schema: str | None = None) -> PreparedSignal:
    """Validate a signal completely, without touching the database."""
    from flowq.app import _validate_name
    from flowq.errors import ConfigurationError
    from flowq.runs import _check_id

    run_id = _check_id(run_id)
    try:
        _validate_name("signal", name)
    except ConfigurationError as exc:
        raise SignalError(str(exc)) from None
    try:
        text = dumps_checked(payload, f"the payload of signal {name!r}")
    except JSONError as exc:
        raise SignalError(str(exc)) from None
    schema = DEFAULT_SCHEMA if schema is None else schema
    return PreparedSignal({"run_id": run_id, "name": name, "payload": text, "step": None,
                           "channel": notify_channel(schema)}, schema)
