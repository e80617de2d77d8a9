"""Workflows beyond chains: map a step over a list, and signals sent in your transaction.

A pipeline is a DAG of steps (`@pipeline.step(parents=[...])`, see
`flowq.define.pipeline`); what a step returns or waits for at run time is declared here:

- `each(items)`: a step returns it to run its one child step once per item, in parallel,
  each instance with the item as its keyword arguments and its own retries and lease. The
  step after the mapped one (a join) receives the list of the instances' results, in item
  order, as the keyword named after the mapped step. At most `MAX_MAP_ITEMS` items.
- `signal(target, run_id, name, payload)`: deliver `payload` (JSON) to the step of run
  `run_id` that waits for `name` (`@pipeline.step(wait_for=name)`), in the transaction of
  `target` (a Session or Connection): it is delivered if and only if that transaction
  commits. Sent before the step is reached, it is kept and handed over when it is. Sent
  twice: an identical payload is ignored (`created=False`), another one is refused with
  `SignalError`. The async twin is `flowq.enqueueing.aio.signal`; `flowq.Session` has `.signal(...)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from flowq.errors import WorkflowError
from flowq.jsonargs import JSONError, dumps_checked

__all__ = ["MAX_MAP_BYTES", "MAX_MAP_ITEMS", "Each", "each"]

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
