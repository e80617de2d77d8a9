"""A definition's shape and its fingerprint: what a deploy must keep for the runs in flight.

A pipeline's shape is what a run's rows depend on: its name and version, and per step (in
definition order) its name, parents, the signal it waits for and its parameters (name, kind,
required). Not its body, docstring, retry policy, timeout or queue: a run continues on new
code of the same shape. (A map is decided at run time, by a step returning `flowq.each`: its
instances are rows of the mapped step, so the step's shape covers them.)

- `shape_of(pipeline)`: the shape, a JSON-able dict (stored in `flowq.definitions`).
- `fingerprint_of(shape)`: the first 16 hex digits of the sha256 of the shape as canonical
  JSON (keys sorted, no spaces): the same in every process and Python version (never `hash()`).
- `pick_version(versions, fingerprint, version, step)`: which of an app's versions of a
  pipeline continues a run started under `fingerprint` (`version`, when the database knows it
  from `flowq.definitions`): the one rule, for the worker (`flowq.worker.resolution.resolve`)
  and the deploy check (`flowq.ops.deploy`).
- `obstacles(new, old, step, joined=..., names=...)`: why definition `new` could not
  continue a run at `step` that started under `old` (None: not recorded): the step is gone,
  its arguments would not bind, a join ahead gained a parent the run never runs. The one
  rule, for the deploy check (per group of runs) and the worker (per job).
- `misfit(params, names)`: why arguments with `names` would not bind to a step of a stored
  shape, or None (the deploy check's test, which has no handler to bind to).
"""

from __future__ import annotations

import difflib
import hashlib
import inspect
import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

if TYPE_CHECKING:
    from flowq.define.step import Step

__all__ = ["FINGERPRINT_DIGITS", "Obstacle", "Shape", "Shapeable", "Versioned", "fingerprint_of",
           "misfit", "obstacles", "pick_version", "shape_of", "short"]


class Versioned(Protocol):
    """A version of a definition: a `Pipeline`, or a stored `Shape`."""

    @property
    def version(self) -> int: ...

    @property
    def fingerprint(self) -> str: ...

    def step_named(self, name: str) -> object | None: ...


class Shapeable(Protocol):
    """What a shape is read from: a `Pipeline` (which imports this module to fingerprint
    itself): its name, version and steps, and, for `Shape.of`, its shape and fingerprint."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> int: ...

    @property
    def steps(self) -> Sequence[Step[Any, Any]]: ...

    @property
    def shape(self) -> dict[str, Any]: ...

    @property
    def fingerprint(self) -> str: ...


V = TypeVar("V", bound=Versioned)

# A fingerprint is written on every row of every run (`flowq.jobs.fingerprint`, twice per job
# in WAL): the first FINGERPRINT_DIGITS hex digits of the shape's sha256 (64 bits, unique
# enough for the shapes of one schema), 17 bytes in a row where `sha256:` and the whole digest
# took 72 (measured: +139 bytes of WAL per job).
FINGERPRINT_DIGITS: Final = 16

# Parameter kinds by a stable name (inspect's enum values are an implementation detail).
_KINDS: Final = {
    inspect.Parameter.POSITIONAL_ONLY: "positional_only",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional_or_keyword",
    inspect.Parameter.VAR_POSITIONAL: "var_positional",
    inspect.Parameter.KEYWORD_ONLY: "keyword_only",
    inspect.Parameter.VAR_KEYWORD: "var_keyword",
}


def shape_of(pipeline: Shapeable) -> dict[str, Any]:
    """The shape of `pipeline` (see the module): a dict of JSON values only."""
    steps = []
    for s in pipeline.steps:
        params = [[p.name, _KINDS[p.kind], p.default is inspect.Parameter.empty
                   and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
                  for p in list(s.signature.parameters.values())[1:]]
        steps.append({"name": s.name, "parents": list(s.parents), "wait_for": s.wait_for,
                      "params": params})
    return {"pipeline": pipeline.name, "version": pipeline.version, "steps": steps}


def fingerprint_of(shape: dict[str, Any]) -> str:
    """The fingerprint of `shape`: stable across processes, machines and Python versions."""
    canonical = json.dumps(shape, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:FINGERPRINT_DIGITS]


def short(fingerprint: str | None) -> str:
    """A fingerprint as people read it: its first 12 hex digits ('-' for none)."""
    if not fingerprint:
        return "-"
    return fingerprint[:12]


def pick_version(versions: Sequence[V], fingerprint: str | None, version: int | None,
                 step: str) -> V | None:
    """The version of a pipeline (`versions`: the app's, oldest first) that continues a run
    at `step` ('' : its start) started under `fingerprint`: the version of that exact
    fingerprint; else the version of the same number (`version`, from `flowq.definitions`:
    changed code kept under the number), or None if the app lacks that number (the run's
    version was removed, or is newer than this code); else (a run of unrecorded definition)
    the newest that has `step`, else the newest (which then cannot run it). None also when
    the app has no version at all."""
    if not versions:
        return None
    if fingerprint is not None:
        for p in versions:
            if p.fingerprint == fingerprint:
                return p
    if version is not None:
        return next((p for p in versions if p.version == version), None)
    for p in reversed(versions):
        if not step or p.step_named(step) is not None:
            return p
    return versions[-1]


def misfit(params: Iterable[Sequence[Any]], names: Iterable[str]) -> str | None:
    """Why keyword arguments named `names` would not bind to a step whose stored parameters
    are `params` ([name, kind, required] each, as `shape_of` writes them), or None."""
    params = [tuple(p) for p in params]
    given = set(names)
    takes_any = any(kind == "var_keyword" for _, kind, _ in params)
    keywords = {name for name, kind, _ in params
                if kind in ("positional_or_keyword", "keyword_only")}
    missing = sorted(name for name, kind, required in params
                     if required and kind != "positional_only" and name not in given)
    unknown = [] if takes_any else sorted(given - keywords)
    problems = []
    if missing:
        problems.append(f"needs argument(s) {', '.join(map(repr, missing))}")
    if unknown:
        problems.append(f"takes no argument(s) {', '.join(map(repr, unknown))}")
    return "; ".join(problems) or None


class Shape:
    """A stored shape (`shape_of`'s dict, e.g. from `flowq.definitions`), read defensively:
    it came from the database, so a missing or odd field reads as empty."""

    def __init__(self, shape: Mapping[str, Any], fingerprint: str | None = None) -> None:
        self.data = dict(shape) if isinstance(shape, Mapping) else {}
        self.name = str(self.data.get("pipeline", ""))
        version = self.data.get("version", 1)
        self.version = version if isinstance(version, int) else 1
        self.fingerprint = fingerprint or fingerprint_of(self.data)
        steps = self.data.get("steps")
        self.steps: list[dict[str, Any]] = [s for s in steps if isinstance(s, dict)
                                            and isinstance(s.get("name"), str)] \
            if isinstance(steps, list) else []
        self._by_name = {s["name"]: s for s in self.steps}

    @classmethod
    def of(cls, pipeline: Shapeable) -> Shape:
        return cls(pipeline.shape, pipeline.fingerprint)

    def step_named(self, name: str) -> dict[str, Any] | None:
        """The step called `name` ('' : the first), or None."""
        if not name:
            return self.steps[0] if self.steps else None
        return self._by_name.get(name)

    def parents(self, name: str) -> list[str]:
        step = self.step_named(name)
        parents = step.get("parents") if step is not None else None
        return [p for p in parents if isinstance(p, str)] if isinstance(parents, list) else []

    def params(self, name: str) -> list[Sequence[Any]]:
        step = self.step_named(name)
        params = step.get("params") if step is not None else None
        if not isinstance(params, list):
            return []
        return [p for p in params if isinstance(p, list) and len(p) == 3]

    def children(self, name: str) -> list[str]:
        return [s["name"] for s in self.steps if name in self.parents(s["name"])]

    def descendants(self, name: str) -> set[str]:
        """Every step that runs after `name` in a run (its children, theirs, ...)."""
        found: set[str] = set()
        todo = self.children(name)
        while todo:
            step = todo.pop()
            if step not in found:
                found.add(step)
                todo.extend(self.children(step))
        return found

    def accepted(self, name: str) -> set[str] | None:
        """The keyword names step `name` takes; None if it takes any (`**kwargs`)."""
        params = self.params(name)
        if any(p[1] == "var_keyword" for p in params):
            return None
        return {p[0] for p in params if p[1] in ("positional_or_keyword", "keyword_only")}


@dataclass(frozen=True)
class Obstacle:
    """Why a definition cannot continue a run: at `step`, of `kind` ("removed",
    "arguments", "join"), said in `text` (a clause without the number of runs)."""

    step: str
    kind: str
    text: str


def obstacles(new: Shape, old: Shape | None, step: str, *, joined: bool = False,
              names: Collection[str] | None = None) -> list[Obstacle]:
    """Why `new` could not continue a run at `step` ('' : its start) that started under
    `old` (None: not recorded, so only the step and its arguments are checked). `names`:
    the stored arguments' names, checked against the step's parameters (None: not
    checked); `joined`: the row was created by a join (its mapped inputs are gathered when
    it runs)."""
    here = new.step_named(step)
    if here is None:
        close = difflib.get_close_matches(step, [s["name"] for s in new.steps], n=1,
                                          cutoff=0.6)
        renamed = f" (renamed to {close[0]!r}?)" if close else ""
        return [Obstacle(step, "removed", f"step {step!r} was removed{renamed}")]
    name = here["name"]
    found: list[Obstacle] = []
    if names is not None:
        given = set(names)
        if joined:
            given |= set(new.parents(name))
        wait = here.get("wait_for")
        if isinstance(wait, str):
            given.add(wait)
        wrong = misfit(new.params(name), given)
        if wrong is not None:
            producers = (old.parents(name) if old is not None and old.step_named(name)
                         else new.parents(name))
            source = (f"step(s) {', '.join(map(repr, producers))} did not produce"
                      if producers else "the run was enqueued without")
            found.append(Obstacle(name, "arguments",
                                  f"step {name!r} now {wrong}: arguments {source}"))
    if old is None:
        return found
    after = {name} | new.descendants(name)
    ahead = new.descendants(name) | ({name} if joined else set())
    for s in new.steps:
        join = s["name"]
        parents = new.parents(join)
        if len(parents) < 2 or join not in ahead:
            continue
        gained = [p for p in parents if p not in old.parents(join) and p not in after]
        if gained:
            found.append(Obstacle(join, "join", f"join {join!r} gained parent(s) "
                                  f"{', '.join(map(repr, gained))}, which a run at step "
                                  f"{name!r} never runs (the join would never start)"))
    return found
