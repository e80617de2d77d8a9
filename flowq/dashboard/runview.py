"""What a run page draws, computed from a `RunInfo` and, when this process imported it, the
run's definition: the graph's boxes, the timeline's bars, every attempt of every step, and
what a waiting step waits for.

- **Graph** (`nodes`): with the definition, every step it declares, in its order, those not
  reached yet `unreached` (grey); without it, the steps reached, in step order and without
  edges (the rows do not say their parents). A mapped step is one box with its instances'
  counts by status.
- **Timeline** (`bars`): a step row from when it was created (queued; a delayed step's
  delay included), with every attempt of `StepInfo.history` as a bar (a failed one apart:
  an attempt lost to a killed worker shows as the time it ran); at most `TIMELINE_ROWS`
  rows.
- **Attempts** (`attempts`): `StepInfo.history` of each row (the failed attempts kept by
  the fenced retry and end statements, then the current one), at most `ATTEMPT_ROWS`.
- **Waits** (`signal_of`): the signal a waiting step waits for (from the definition), and
  its `run_at`, which for a waiting row is when the wait expires.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from flowq.dashboard.svg import Bar, Node, Span
from flowq.define.app import find_definition
from flowq.ops.runinfo import RunInfo, StepInfo

__all__ = [
    "ATTEMPT_ROWS",
    "TIMELINE_ROWS",
    "AttemptRow",
    "attempts",
    "bars",
    "definition_of",
    "nodes",
    "signal_of",
]

TIMELINE_ROWS: Final = 200
ATTEMPT_ROWS: Final = 200


def definition_of(run: RunInfo, schema: str) -> Any:
    """The run's pipeline if this process imported it (`flowq dashboard --app`) and its step
    names fit the rows (another app's pipeline of that name does not), else None."""
    definition = find_definition(run.task, schema)
    if definition is None or not definition.steps:
        return None
    names = {st.name for st in definition.steps}
    if not {s.step for s in run.steps} <= names | {""}:
        return None
    return definition


def _label(s: StepInfo) -> str:
    name = s.step or "(first)"
    return name if s.map_index is None else f"{name}[{s.map_index}]"


def nodes(run: RunInfo, definition: Any) -> list[Node]:
    """The graph's boxes (see the module docstring)."""
    groups = {g.step: g for g in run.graph}
    if definition is not None:
        first = definition.steps[0].name
        if "" in groups and first not in groups:
            groups[first] = groups.pop("")
        declared = [(st.name, tuple(st.parents), st.wait_for) for st in definition.steps]
    else:
        # The rows do not say which step follows which: no edges are guessed.
        declared = [(reached.step, (), None) for reached in run.graph]
    out = []
    for name, parents, signal in declared:
        g = groups.get(name)
        if g is None:
            out.append(Node(name, parents, "unreached", "not reached yet", signal))
            continue
        if g.instances is not None:
            counts = ", ".join(f"{n} {st}" for st, n in sorted(g.counts.items()))
            note = f"x{g.instances}: {counts}"
        elif g.status == "waiting" and signal is not None:
            note = f"waits for signal {signal}"
        else:
            note = f"{g.status}, {g.attempts} attempt{'s' if g.attempts != 1 else ''}"
        out.append(Node(name, parents, g.status, note, signal))
    return out


def bars(run: RunInfo) -> list[Bar]:
    """The timeline's rows (see the module docstring)."""
    return [Bar(_label(s), s.status, s.created_at,
                tuple(Span(a.started_at, a.finished_at, a.error is not None)
                      for a in s.history))
            for s in run.steps[:TIMELINE_ROWS]]


@dataclass(frozen=True)
class AttemptRow:
    """One line of the attempts table."""

    job_id: int
    step: str
    attempt: int
    started_at: datetime | None
    duration_s: float | None
    worker: str | None
    error: str | None
    running: bool


def attempts(run: RunInfo) -> list[AttemptRow]:
    """Every attempt of every step row, in step order then attempt order."""
    out = []
    for s in run.steps:
        for a in s.history:
            duration = (None if a.started_at is None or a.finished_at is None
                        else max((a.finished_at - a.started_at).total_seconds(), 0.0))
            out.append(AttemptRow(s.job_id, _label(s), a.attempt, a.started_at, duration,
                                  a.worker, a.error, s.status == "running" and
                                  a.finished_at is None))
            if len(out) >= ATTEMPT_ROWS:
                return out
    return out


def signal_of(step: StepInfo, definition: Any) -> str | None:
    """The signal a step waits for, when its definition is known."""
    if definition is None:
        return None
    found = definition.step_named(step.step) if step.step else definition.steps[0]
    return None if found is None else found.wait_for
