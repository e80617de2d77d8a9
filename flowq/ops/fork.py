"""Fork a run from a step: a new run that starts at that step with the old run's recorded
inputs, and runs from there with today's code.

`fork(bind, run_id, from_step=..., args=None)` reads the source run (which it never changes)
and enqueues a new run of the same pipeline whose one first row is `from_step`, through the
enqueue's own statement (`flowq.enqueueing.prepare.prepare_start_at`). Its input is what
the steps before it recorded: the source's row of `from_step` kept its arguments (its
parents' outputs, with a signal's payload if it got one); for a step the source never
reached, the outputs of its succeeded parents (one parent: its result is the keywords;
several: a keyword per parent); a mapped parent's outputs are its instances' results in item
order. `args=` replaces that input (a JSON object, checked against the step's handler).
The new run's first row records `forked_from` (`RunInfo.forked_from`; `flowq runs show`).

Refused with a clear sentence (`InvalidArgumentsError`, `RunStateError`): a pipeline not
defined in this process (the fork runs today's code), an unknown step, an instance of a
map (fork from the step that maps), a source run still active, a step whose inputs were
never recorded, and a step after which some step also waits for a step before it (it
would never run in the fork).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flowq.db.store import Store
from flowq.define.app import did_you_mean, find_definition
from flowq.define.pipeline import Pipeline
from flowq.define.step import Step
from flowq.enqueueing.prepare import prepare_start_at
from flowq.enqueueing.sync import execute
from flowq.errors import InvalidArgumentsError, RunStateError
from flowq.names import DEFAULT_SCHEMA, check_id
from flowq.ops import binds
from flowq.ops.binds import Bind
from flowq.ops.results import run_finished
from flowq.ops.runinfo import RunInfo, StepInfo, read_run

__all__ = ["Forked", "fork"]


@dataclass(frozen=True)
class Forked:
    """What `fork` started: the new run's id, the source run and the step it starts at."""

    run_id: int
    source_run_id: int
    from_step: str
    args: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "forked_from": self.source_run_id,
                "from_step": self.from_step, "args": self.args}


def _definition(run: RunInfo, schema: str) -> Pipeline:
    definition = find_definition(run.task, schema)
    if definition is None:
        raise InvalidArgumentsError(
            f"run {run.run_id} is of {run.task!r}, which no app of this process defines: a "
            "fork runs today's code, so import the module that defines it (flowq runs fork "
            "--app MODULE:APP)")
    return definition


def _step(definition: Pipeline, name: object) -> Step[Any, Any]:
    if not isinstance(name, str):
        raise InvalidArgumentsError(f"from_step is a step's name, got {name!r}")
    step = definition.step_named(name)
    if step is None:
        names = [s.name for s in definition.steps]
        hint = did_you_mean(name, names)
        raise InvalidArgumentsError(
            f"{definition.name!r} has no step {name!r}" + (f": {hint}" if hint else "")
            + f" (its steps: {', '.join(names[:20])}{', ...' if len(names) > 20 else ''})")
    return step


def _check_reachable(definition: Pipeline, start: Step[Any, Any]) -> None:
    """Every step after `start` must wait only for `start` and steps after it."""
    after = {start.name}
    for s in definition.steps:  # definition order lists parents before children
        if any(p in after for p in s.parents):
            after.add(s.name)
    for s in definition.steps:
        if s.name in after and s is not start:
            before = [p for p in s.parents if p not in after]
            if before:
                raise InvalidArgumentsError(
                    f"cannot fork from {start.name!r}: step {s.name!r} after it also waits "
                    f"for {', '.join(map(repr, before))}, which would not run in the fork, "
                    f"so {s.name!r} never would either; fork from a step before "
                    f"{', '.join(map(repr, before))}")


def _outputs(run: RunInfo, name: str) -> tuple[bool, bool, Any]:
    """(recorded, mapped, output) of step `name` in `run`: its result, or, for the instances
    of a map, their results in item order."""
    rows = [s for s in run.steps if s.step == name]
    if not rows or any(r.status != "succeeded" for r in rows):
        return False, False, None
    if all(r.map_index is not None for r in rows):
        return True, True, [r.result for r in sorted(rows, key=lambda r: r.map_index or 0)]
    return True, False, rows[0].result


def _inputs(run: RunInfo, step: Step[Any, Any]) -> dict[str, Any]:
    """What `step` was (or would have been) called with in `run` (see the module)."""
    rows: list[StepInfo] = [s for s in run.steps if s.step == step.name]
    if any(r.map_index is not None for r in rows):
        raise InvalidArgumentsError(
            f"step {step.name!r} ran as the instances of a map in run {run.run_id}: fork from "
            f"the step that maps ({', '.join(map(repr, step.parents))}), which maps again")
    if not step.parents:
        first = rows[0] if rows else run.steps[0]  # a root: the run's own arguments
        return dict(first.args) if isinstance(first.args, dict) else {}
    if rows:
        args = dict(rows[0].args) if isinstance(rows[0].args, dict) else {}
        for parent in step.parents:
            # A mapped parent's results are not in the row: a join gathers them as it runs.
            recorded, mapped, output = _outputs(run, parent)
            if parent not in args and recorded and mapped:
                args[parent] = output
        return args
    outputs = {p: _outputs(run, p) for p in step.parents}
    missing = [p for p, (recorded, _, _) in outputs.items() if not recorded]
    if missing:
        raise RunStateError(
            f"step {step.name!r} was never reached in run {run.run_id}, and its input "
            f"cannot be rebuilt: {', '.join(map(repr, missing))} did not succeed there; fork "
            f"from {missing[0]!r} instead, or pass args=")
    if len(step.parents) == 1:
        parent = step.parents[0]
        _, mapped, output = outputs[parent]
        if mapped:
            return {parent: output}
        if not isinstance(output, dict):
            raise RunStateError(
                f"step {step.name!r} was never reached in run {run.run_id}, and its parent "
                f"{parent!r} returned {type(output).__name__}, not the keywords of a step: "
                "pass args=")
        return dict(output)
    return {p: output for p, (_, _, output) in outputs.items()}


def fork(bind: Bind, run_id: int, *, from_step: str, args: Mapping[str, Any] | None = None,
         schema: str = DEFAULT_SCHEMA) -> Forked:
    """Start a new run of run `run_id`'s pipeline at `from_step`, reusing the outputs the
    steps before it recorded (or `args`), and running from there with today's code; the old
    run is untouched, and the new one records it as `forked_from`. See the module for what is
    refused. Joins the transaction of a Connection (the caller commits), or commits its own."""
    run_id = check_id(run_id)
    if args is not None and not isinstance(args, Mapping):
        raise InvalidArgumentsError(f"args must be a JSON object of the step's keywords, got "
                                    f"{type(args).__name__}")
    with binds.transaction(bind) as conn:
        store = Store.of(conn, schema)
        run = read_run(conn, store, run_id)
        if not run_finished(run):
            raise RunStateError(
                f"run {run_id} is still {run.status}: fork a run once it has ended (wait "
                f"for it, or cancel it with `flowq runs cancel {run_id}`), so that the "
                "outputs it reuses are final")
        definition = _definition(run, schema)
        step = _step(definition, from_step)
        _check_reachable(definition, step)
        inputs = _inputs(run, step) if args is None else dict(args)
        # Through JSON once: what the new row stores is what the result says it got.
        call = prepare_start_at(definition, step, inputs, schema=schema)
        enqueued = execute(conn, call)
        store.mark_forked(enqueued.id, run_id)
    return Forked(run_id=enqueued.id, source_run_id=run_id, from_step=step.name,
                  args=json.loads(call.params["args"]))
