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

What the fork repeats. The steps before `from_step` do not run. `from_step` runs again
from the top, but what it recorded in the source run is reused by default: its checkpoints,
durable sleeps and child runs are copied to the new run (`copy_checkpoints`, in the fork's
transaction), so a recorded checkpoint returns its recorded result and its `fn` (a charge,
a mail) does not run, a sleep already slept returns at once, and a child already started is
the same child run (its result is waited for, it is not started again). Running them again
is explicit: `redo_checkpoints=True` copies none; `redo_from="name"` copies those recorded
before checkpoint `name` (by position in the step's sequence) and redoes it and every
record after it. The steps after `from_step` run afresh, checkpoints and all: a fork is a
new run, so `ctx.idempotency_key` is new in every step of it (`flowq:NEW_RUN:STEP`), and an
external call made outside a checkpoint is made again with a key its API has not seen.
`plan_fork` (`flowq runs fork --dry-run`) says all this for one fork and changes nothing.

Refused with a clear sentence (`InvalidArgumentsError`, `RunStateError`): a pipeline not
defined in this process (the fork runs today's code), an unknown step, an instance of a
map (fork from the step that maps), a source run still active, a step whose inputs were
never recorded, a step after which some step also waits for a step before it (it
would never run in the fork), and a `redo_from` that names no checkpoint the step recorded.
`via="cli"` makes the refusals name the CLI's flags (`--args`) instead of the keywords.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final, Literal

import sqlalchemy as sa

from flowq.db.store import Store
from flowq.define.app import did_you_mean, find_definition
from flowq.define.pipeline import Pipeline
from flowq.define.step import Step
from flowq.durable.checkpoints import MAX_NAME_CHARS, RecordKind, forkable, record_kind
from flowq.enqueueing.prepare import Enqueued, PreparedCall, prepare_start_at
from flowq.enqueueing.sync import execute
from flowq.errors import InvalidArgumentsError, RunStateError
from flowq.names import DEFAULT_SCHEMA, check_id
from flowq.ops import binds
from flowq.ops.binds import Bind
from flowq.ops.results import run_finished
from flowq.ops.runinfo import RunInfo, StepInfo, read_run

__all__ = ["ForkCheckpoint", "ForkPlan", "Forked", "fork", "plan_fork"]

# How the refusals name each option, from Python and from `flowq runs fork`.
Via = Literal["python", "cli"]
FLAGS: Final[dict[str, dict[str, str]]] = {
    "python": {"args": "args=", "redo_from": "redo_from=",
               "redo_checkpoints": "redo_checkpoints=True"},
    "cli": {"args": "--args", "redo_from": "--redo-from",
            "redo_checkpoints": "--redo-checkpoints"},
}
MAX_LISTED: Final = 1000  # records of the steps after `from_step` a plan lists


@dataclass(frozen=True)
class ForkCheckpoint:
    """A record of a step in the source run (a checkpoint, a durable sleep or a child run's
    start, at `position` in the step's sequence) and whether the fork reuses it (its result
    returned, its function not run) or runs it again."""

    step: str
    name: str
    kind: RecordKind
    position: int
    reused: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ForkPlan:
    """What a fork of run `source_run_id` from `from_step` does: the steps it runs (that one
    and those after it, in definition order), the input of `from_step`, and each record the
    source made in those steps, reused or run again (see the module)."""

    source_run_id: int
    from_step: str
    args: dict[str, Any]
    steps: tuple[str, ...]
    checkpoints: tuple[ForkCheckpoint, ...]

    @property
    def reused(self) -> tuple[str, ...]:
        """The names of the records the fork reuses (all of `from_step`)."""
        return tuple(c.name for c in self.checkpoints if c.reused)

    def to_dict(self) -> dict[str, Any]:
        return {"forked_from": self.source_run_id, "from_step": self.from_step,
                "args": self.args, "steps": list(self.steps),
                "checkpoints": [c.to_dict() for c in self.checkpoints]}


@dataclass(frozen=True)
class Forked:
    """What `fork` started: the new run's id, the source run, the step it starts at, its
    input, and what it reuses and runs again (`plan`)."""

    run_id: int
    source_run_id: int
    from_step: str
    args: dict[str, Any]
    plan: ForkPlan

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, **self.plan.to_dict(), "args": self.args}


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


def _check_reachable(definition: Pipeline, start: Step[Any, Any]) -> list[str]:
    """Every step after `start` must wait only for `start` and steps after it; the steps
    that run in the fork, `start` first, in definition order."""
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
    return [start.name] + [s.name for s in definition.steps
                           if s.name in after and s is not start]


def _outputs(run: RunInfo, name: str) -> tuple[bool, bool, Any]:
    """(recorded, mapped, output) of step `name` in `run`: its result, or, for the instances
    of a map, their results in item order."""
    rows = [s for s in run.steps if s.step == name]
    if not rows or any(r.status != "succeeded" for r in rows):
        return False, False, None
    if all(r.map_index is not None for r in rows):
        return True, True, [r.result for r in sorted(rows, key=lambda r: r.map_index or 0)]
    return True, False, rows[0].result


def _inputs(run: RunInfo, step: Step[Any, Any], args_flag: str) -> dict[str, Any]:
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
            f"from {missing[0]!r} instead, or pass its input with {args_flag}")
    if len(step.parents) == 1:
        parent = step.parents[0]
        _, mapped, output = outputs[parent]
        if mapped:
            return {parent: output}
        if not isinstance(output, dict):
            raise RunStateError(
                f"step {step.name!r} was never reached in run {run.run_id}, and its parent "
                f"{parent!r} returned {type(output).__name__}, not the keywords of a step: "
                f"pass its input with {args_flag}")
        return dict(output)
    return {p: output for p, (_, _, output) in outputs.items()}


def _check_redo(redo_checkpoints: object, redo_from: object, flags: Mapping[str, str]
                ) -> None:
    if not isinstance(redo_checkpoints, bool):
        raise InvalidArgumentsError(f"redo_checkpoints is True or False, got "
                                    f"{type(redo_checkpoints).__name__}")
    if redo_from is not None and not isinstance(redo_from, str):
        raise InvalidArgumentsError(f"{flags['redo_from']} takes a checkpoint's name, got "
                                    f"{type(redo_from).__name__}")
    if redo_checkpoints and redo_from is not None:
        raise InvalidArgumentsError(
            f"give {flags['redo_checkpoints']} (run every checkpoint again) or "
            f"{flags['redo_from']} (run that one and those after it again), not both")


def _records(store: Store, run: RunInfo, step: Step[Any, Any], later: Sequence[str],
             redo_checkpoints: bool, redo_from: str | None, flags: Mapping[str, str]
             ) -> list[ForkCheckpoint]:
    """The source's records of `step` (reused before the redo point, see the module), then
    those of the steps in `later` (all run again), at most `MAX_LISTED` of the latter."""
    stored = forkable(store.checkpoints(run.run_id, step.name, None)[0])
    redo_at: int | None = -1 if redo_checkpoints else None
    if redo_from is not None:
        mine = [r for r in stored if record_kind(r.name) == "checkpoint"]
        found = next((r for r in mine if r.name == redo_from), None)
        if found is None:
            names = [r.name for r in mine]
            hint = did_you_mean(redo_from, names) if len(redo_from) <= MAX_NAME_CHARS else None
            shown = ", ".join(map(repr, names[:20])) + (", ..." if len(names) > 20 else "")
            raise InvalidArgumentsError(
                f"{flags['redo_from']} {redo_from[:60]!r}: step {step.name!r} of run "
                f"{run.run_id} recorded no checkpoint of that name"
                + (f" ({hint})" if hint else "")
                + (f"; its checkpoints: {shown}" if names else
                   f"; it recorded none, so nothing would be reused: drop {flags['redo_from']}"))
        redo_at = found.position
    records = [ForkCheckpoint(step=step.name, name=r.name,
                              kind=record_kind(r.name) or "checkpoint", position=r.position,
                              reused=redo_at is None or r.position < redo_at)
               for r in stored]
    if later:
        for c in store.run_checkpoints(run.run_id, MAX_LISTED):
            kind = record_kind(c.name)
            if c.step in later and kind is not None:
                records.append(ForkCheckpoint(step=c.step, name=c.name, kind=kind,
                                              position=c.position, reused=False))
    return records


def _plan(conn: sa.Connection, store: Store, run_id: int, from_step: str,
          args: Mapping[str, Any] | None, redo_checkpoints: bool, redo_from: str | None,
          via: Via) -> tuple[ForkPlan, PreparedCall[Enqueued]]:
    """The plan of a fork (its input as the new row stores it) and the enqueue that starts
    it; reads the source only, refusing what the module says."""
    flags = FLAGS["cli" if via == "cli" else "python"]
    _check_redo(redo_checkpoints, redo_from, flags)
    if args is not None and not isinstance(args, Mapping):
        raise InvalidArgumentsError(f"{flags['args'].rstrip('=')} must be a JSON object of "
                                    f"the step's keywords, got {type(args).__name__}")
    run = read_run(conn, store, run_id)
    if not run_finished(run):
        raise RunStateError(
            f"run {run_id} is still {run.status}: fork a run once it has ended (wait "
            f"for it, or cancel it with `flowq runs cancel {run_id}`), so that the "
            "outputs it reuses are final")
    definition = _definition(run, store.schema)
    step = _step(definition, from_step)
    steps = _check_reachable(definition, step)
    inputs = _inputs(run, step, flags["args"]) if args is None else dict(args)
    records = _records(store, run, step, steps[1:], redo_checkpoints, redo_from, flags)
    # Through JSON once: what the new row stores is what the plan says it gets.
    call = prepare_start_at(definition, step, inputs, schema=store.schema)
    plan = ForkPlan(source_run_id=run_id, from_step=step.name,
                    args=json.loads(call.params["args"]), steps=tuple(steps),
                    checkpoints=tuple(records))
    return plan, call


def plan_fork(bind: Bind, run_id: int, *, from_step: str,
              args: Mapping[str, Any] | None = None, redo_checkpoints: bool = False,
              redo_from: str | None = None, schema: str = DEFAULT_SCHEMA,
              via: Via = "python") -> ForkPlan:
    """What `fork` with these options would do (`ForkPlan`: the steps that run, each record
    of the source reused or run again), refused as `fork` would be; changes nothing (the
    dry run of `flowq runs fork --dry-run`)."""
    run_id = check_id(run_id)
    with binds.transaction(bind) as conn:
        plan, _ = _plan(conn, Store.of(conn, schema), run_id, from_step, args,
                        redo_checkpoints, redo_from, via)
    return plan


def fork(bind: Bind, run_id: int, *, from_step: str, args: Mapping[str, Any] | None = None,
         redo_checkpoints: bool = False, redo_from: str | None = None,
         schema: str = DEFAULT_SCHEMA, via: Via = "python") -> Forked:
    """Start a new run of run `run_id`'s pipeline at `from_step`, reusing the outputs the
    steps before it recorded (or `args`) and the checkpoints `from_step` recorded (unless
    `redo_checkpoints`, or from checkpoint `redo_from` on), and running from there with
    today's code; the old run is untouched, and the new one records it as `forked_from`.
    See the module for what a fork repeats and what is refused. Joins the transaction of a
    Connection (the caller commits), or commits its own."""
    run_id = check_id(run_id)
    with binds.transaction(bind) as conn:
        store = Store.of(conn, schema)
        plan, call = _plan(conn, store, run_id, from_step, args, redo_checkpoints,
                           redo_from, via)
        enqueued = execute(conn, call)
        store.mark_forked(enqueued.id, run_id)
        # In the enqueue's transaction: no worker can claim the new row before its copies.
        store.copy_checkpoints(run_id, enqueued.id, plan.from_step,
                               [c.name for c in plan.checkpoints
                                if c.reused and c.step == plan.from_step])
    return Forked(run_id=enqueued.id, source_run_id=run_id, from_step=plan.from_step,
                  args=plan.args, plan=plan)
