"""A pipeline's step graph: the index of its steps, and the rules a new step's links obey.

`StepIndex` keeps the lookups over a pipeline's steps (by name, by signal, children, roots)
up to date as steps are appended, so that defining N steps is linear and a worker's per-job
lookups are dict lookups. A step being added is checked against the steps before it:
`parents_of` (parents are defined before their children, which keeps the graph free of
cycles), `wait_of` (a signal is delivered to one step of a run) and `check_inputs` (a join
or a waiting step must take the keywords it receives).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flowq.define.step import Step
from flowq.errors import ConfigurationError
from flowq.names import validate_name

__all__ = ["StepIndex", "check_inputs", "parents_of", "wait_of"]


@dataclass
class StepIndex:
    """What is looked up in a pipeline's steps, kept up to date as steps are appended, so
    that defining N steps is linear and a worker's per-job lookups are dict lookups."""

    count: int = 0  # how many of `Pipeline.steps` are indexed
    by_name: dict[str, Step[Any, Any]] = field(default_factory=dict)
    by_signal: dict[str, Step[Any, Any]] = field(default_factory=dict)
    children: dict[str, list[Step[Any, Any]]] = field(default_factory=dict)
    roots: list[Step[Any, Any]] = field(default_factory=list)

    def add(self, step: Step[Any, Any]) -> None:
        self.count += 1
        self.by_name.setdefault(step.name, step)
        if step.wait_for is not None:
            self.by_signal.setdefault(step.wait_for, step)
        for parent in step.parents:
            self.children.setdefault(parent, []).append(step)
        if not step.parents:
            self.roots.append(step)


def parents_of(pipeline: str, steps: Sequence[Step[Any, Any]], index: StepIndex, name: str,
               parents: Sequence[Step[Any, Any] | str] | None) -> tuple[str, ...]:
    """The parents of step `name`, about to be added to `pipeline` after `steps` (`index`
    up to date with them): `parents` as names, checked; the step before when None."""
    if parents is None:  # a chain: the step defined before, if any
        return (steps[-1].name,) if steps else ()
    if isinstance(parents, str | Step) or not isinstance(parents, Sequence):
        raise ConfigurationError(
            f"parents of {name!r} must be a list of steps, e.g. parents=[fetch, parse]")
    names: list[str] = []
    for p in parents:
        if isinstance(p, Step):
            if index.by_name.get(p.name) is not p:
                raise ConfigurationError(
                    f"parent {p.name!r} of step {name!r} is not a step of pipeline "
                    f"{pipeline!r} (a parent in another pipeline?)")
            pname = p.name
        elif isinstance(p, str):
            if p == name:
                raise ConfigurationError(
                    f"step {name!r} cannot be its own parent (that is a cycle)")
            if index.by_name.get(p) is None:
                raise ConfigurationError(
                    f"unknown parent {p!r} of step {name!r}: pipeline {pipeline!r} has no "
                    "such step yet (define parents before their children: that is also "
                    "what keeps the graph free of cycles)")
            pname = p
        else:
            raise ConfigurationError(
                f"parents of {name!r} must be steps of {pipeline!r}, got {p!r}")
        if pname in names:
            raise ConfigurationError(f"step {name!r} lists parent {pname!r} twice")
        names.append(pname)
    return tuple(names)

def wait_of(pipeline: str, index: StepIndex, name: str, wait_for: str | None) -> str | None:
    """The signal step `name` of `pipeline` waits for, checked: one step of a run per signal."""
    if wait_for is None:
        return None
    signal = validate_name("signal", wait_for)
    other = index.by_signal.get(signal)
    if other is not None:
        raise ConfigurationError(
            f"step {other.name!r} of {pipeline!r} already waits for signal {signal!r}: "
            "a signal is delivered to one step of a run")
    return signal

def check_inputs(s: Step[Any, Any]) -> None:
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
