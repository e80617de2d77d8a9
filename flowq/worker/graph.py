"""The workflow graph rules: what a step's success stores and what it does to the run's graph.

- `succeeded(pipeline, step, job, result)`: the `Succeeded` outcome of a result, with what it
  spawns (`Spawn`): a chain's next step, created with the result as its arguments; its share
  in a join (a step of several parents, or any child of a map instance), counted down; or,
  for `flowq.each(...)`, one instance of the mapped child per item and their share in the
  joins after it. A result flowq cannot store, or one that does not fit the next step, raises
  `InvalidResultError`; a map the graph does not allow raises `WorkflowError`. Both are
  permanent: the attempt judges them `dead`, since running the handler again would repeat
  its side effects and return the same.
- `spawn_roots(pipeline, job)`: a run enqueued by name, without the definition, is one row for its
  first step (''); when the pipeline `starts_many` (its rule, shared with enqueue), that row
  starts them all instead: it succeeds at once and spawns every root.

Pure: no I/O, no clock. `flowq.worker.attempt` calls these for the worker and the test kit.
"""

from __future__ import annotations

import json
from typing import Any, Final

from flowq.db.rows import ClaimedJob
from flowq.define.pipeline import Pipeline
from flowq.define.step import Step
from flowq.define.workflows import Each
from flowq.errors import InvalidArgumentsError, WorkflowError
from flowq.jsonargs import JSONError, dumps_checked
from flowq.storable import safe_str
from flowq.worker.model import Spawn, Succeeded

__all__ = ["SHARDED_MAP_ITEMS", "InvalidResultError", "result_text", "spawn_roots", "succeeded"]

# A map of this many items or more may count its instances in shards (`flowq.db.schema.
# join_shards`): below it, the instances completing at once are too few to queue on the
# join's one row for long, and the shard rows would cost more than they save.
SHARDED_MAP_ITEMS: Final = 64


class InvalidResultError(Exception):
    """The handler's result cannot be stored or does not fit the next step."""


def spawn_roots(pipeline: Pipeline, job: ClaimedJob) -> Succeeded | None:
    """The success of a run's start row that spawns its roots, or None for an ordinary row.
    Raises ValueError or InvalidArgumentsError when the stored arguments fit no root."""
    if job.step or not pipeline.starts_many:
        return None
    pipeline.check_start_arguments(dict(json.loads(job.args)),
                                   what=f"stored arguments of job {job.id}")
    return Succeeded("null", tuple(Spawn(r, pipeline.name, args=job.args)
                                   for r in pipeline.roots))


def result_text(step: Step[Any, Any], result: Any) -> str:
    """`result` as the JSON text stored on the row; InvalidResultError if flowq cannot store
    it."""
    try:
        return dumps_checked(result, "the result")
    except JSONError as exc:
        raise InvalidResultError(
            f"step {step.name!r} returned a value flowq cannot store (not retried: it would "
            f"run again and return the same): {exc}") from None


def succeeded(pipeline: Pipeline, step: Step[Any, Any], job: ClaimedJob,
              result: Any) -> Succeeded:
    """The success `result` makes, with what it spawns (see the module)."""
    if isinstance(result, Each):
        return Succeeded(result.json, _mapped(pipeline, step, job, result))
    text = result_text(step, result)
    return Succeeded(text, _successors(pipeline, step, job, result, text))


def _successors(pipeline: Pipeline, step: Step[Any, Any], job: ClaimedJob, result: Any,
                text: str) -> tuple[Spawn, ...]:
    """What a success does to each child: create it (its only parent, a plain step), or
    count towards it (a join, or any child of a map instance)."""
    spawn: list[Spawn] = []
    for child in pipeline.children(step):
        if job.map_index is not None:
            spawn.append(Spawn(child, pipeline.name, parents=len(child.parents), delta=-1))
            continue
        if len(child.parents) > 1:
            spawn.append(Spawn(child, pipeline.name, parents=len(child.parents), delta=-1,
                               parent=step.name, input=text))
            continue
        if result is not None and not isinstance(result, dict):
            raise InvalidResultError(
                f"step {step.name!r} returned a {type(result).__name__}, but a step "
                f"followed by {child.name!r} must return a dict (its keyword arguments) "
                "or None")
        try:
            child.check_input(dict(result or {}), what=f"the result of step {step.name!r}")
        except InvalidArgumentsError as exc:
            raise InvalidResultError(safe_str(exc)) from None
        spawn.append(Spawn(child, pipeline.name, args=text if result else "{}"))
    return tuple(spawn)


def _mapped(pipeline: Pipeline, step: Step[Any, Any], job: ClaimedJob,
            items: Each) -> tuple[Spawn, ...]:
    """The instances of the mapped child, and the joins after it: each counts n units."""
    children = pipeline.children(step)
    if job.map_index is not None:
        raise WorkflowError(f"step {step.name!r} is itself a map instance: an instance "
                            "cannot map again (map over a list of lists in one step)")
    if len(children) != 1:
        raise WorkflowError(
            f"step {step.name!r} returned flowq.each(...), which runs its child step once "
            f"per item, but it has {len(children)} child steps (it needs exactly one)")
    child = children[0]
    if len(child.parents) != 1:
        raise WorkflowError(
            f"step {child.name!r} is mapped over the items of {step.name!r}, so it can have "
            f"no other parent (it has {', '.join(child.parents)})")
    if child.wait_for is not None:
        raise WorkflowError(f"step {child.name!r} waits for a signal, so it cannot be "
                            "mapped (a signal is delivered to one step of a run)")
    for i, item in enumerate(items.items):
        try:
            child.check_arguments(item, what=f"item {i} of flowq.each()")
        except InvalidArgumentsError as exc:
            raise WorkflowError(safe_str(exc)) from None
    n = len(items.items)
    spawn = [Spawn(child, pipeline.name, args=t, map_index=i)
             for i, t in enumerate(items.texts)]
    mapped = child.name if n >= SHARDED_MAP_ITEMS else None
    spawn += [Spawn(g, pipeline.name, parents=len(g.parents), delta=n - 1, mapped=mapped,
                    items=n)
              for g in pipeline.children(child)]
    return tuple(spawn)
