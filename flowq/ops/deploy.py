"""The deploy check: which runs in flight the code about to be deployed could not continue.

`check_deploy(engine, app)` compares `app`'s definitions (every version of every pipeline)
with the runs in flight (`flowq.jobs`' active rows, by the fingerprint their run started
under, step and stored argument names) and with what the live workers serve
(`flowq.workers.definitions`), and says per pipeline: compatible, or which runs it could not
continue and why, each with the number of runs, the oldest and an example run id:

- the pipeline (or the version the runs are on, with no other to continue them) is gone;
- step `x` was removed (or renamed) while runs wait to run it;
- step `y` needs an argument the stored arguments (or step `w`'s result, as the old shape's
  next step took it) do not have, or refuses one they have;
- a join gained a parent those runs never ran (its counter would never reach zero).

A run continues on the version `flowq.define.shape.pick_version` picks, the worker's own
rule: the same fingerprint is compatible without further checks. A run whose definition is
not recorded (enqueued by name, or before revision 0014) is checked by its step and
arguments only. `check_shapes` does the same for stored shapes: `flowq doctor` checks the
runs in flight against the definitions the live workers serve. Reads only; at most
`MAX_GROUPS` groups of rows are read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Final

import sqlalchemy as sa

from flowq.db.store import Store
from flowq.define.app import FlowQ
from flowq.define.shape import Shape, obstacles, pick_version, short
from flowq.names import validate_schema_name

__all__ = ["MAX_GROUPS", "DeployReport", "PipelineReport", "Stranded", "check_deploy",
           "check_shapes", "served_shapes", "shapes_of"]

MAX_GROUPS: Final = 100_000  # (task, fingerprint, step, argument names) groups read
# How long a worker counts as live for the check (seconds since its last beat).
LIVE_S: Final = 60.0


@dataclass(frozen=True)
class Stranded:
    """Runs the code could not continue, for one reason: how many, the oldest, an example."""

    pipeline: str
    step: str
    reason: str  # the sentence, with the number of runs
    runs: int
    oldest: datetime | None
    example_run_id: int
    started_under: str  # "version N (fingerprint)" or "an unrecorded definition"
    served_by: tuple[str, ...] = ()  # live workers serving the definition they started under


@dataclass(frozen=True)
class PipelineReport:
    """One pipeline: compatible, or the runs stranded; runs in flight per version."""

    pipeline: str
    stranded: list[Stranded] = field(default_factory=list)
    in_flight: dict[str, int] = field(default_factory=dict)  # "version N (fp)" -> runs
    served_by: list[str] = field(default_factory=list)  # "worker: version N (fp)"
    versions: list[str] = field(default_factory=list)  # the code's, "version N (fp)"

    @property
    def compatible(self) -> bool:
        return not self.stranded


@dataclass(frozen=True)
class DeployReport:
    """The check's answer: per pipeline, and whether every run in flight can continue."""

    pipelines: list[PipelineReport]

    @property
    def ok(self) -> bool:
        return all(p.compatible for p in self.pipelines)

    @property
    def stranded(self) -> list[Stranded]:
        return [s for p in self.pipelines for s in p.stranded]

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "pipelines": [
            {**asdict(p), "compatible": p.compatible,
             "stranded": [{**asdict(s), "oldest": s.oldest.isoformat() if s.oldest else None}
                          for s in p.stranded]} for p in self.pipelines]}

    def lines(self) -> list[str]:
        """The report as text, a pipeline per paragraph."""
        out: list[str] = []
        for p in self.pipelines:
            flight = "; ".join(f"{label}: {n:,} run(s)" for label, n in p.in_flight.items())
            head = f"{p.pipeline}: " + ("compatible" if p.compatible else
                                        f"{len(p.stranded)} problem(s)")
            out.append(head + (f" (in flight: {flight})" if flight else " (no runs in flight)"))
            if len(p.versions) > 1:
                drained = [v for v in p.versions if not p.in_flight.get(v)]
                if drained:
                    out.append(f"  drained: {', '.join(drained)}: no run in flight is on it; "
                               "it can be removed once no worker of older code starts runs")
            for s in p.stranded:
                when = f"oldest {s.oldest:%Y-%m-%d %H:%M:%S}, " if s.oldest else ""
                served = (f"; served now by {', '.join(s.served_by)}: keep it running until "
                          "they finish" if s.served_by else "")
                out.append(f"  - {s.reason} ({when}e.g. run {s.example_run_id}; started "
                           f"under {s.started_under}){served}")
            for w in p.served_by:
                out.append(f"  live worker {w}")
        return out


def shapes_of(app: FlowQ) -> dict[str, list[Shape]]:
    """Every version of every definition of `app`, as shapes, by name (oldest first)."""
    return {p.name: [Shape.of(v) for v in app.versions(p.name)] for p in app}


def served_shapes(engine: sa.Engine, *, schema: str) -> dict[str, list[Shape]]:
    """The definitions the live workers registered, as shapes by pipeline (oldest version
    first; two workers may serve two shapes of one version): the code `flowq doctor`
    checks the runs in flight against."""
    validate_schema_name(schema)
    with engine.connect() as conn:
        store = Store.of(conn, schema)
        workers = store.served_definitions(LIVE_S)
        served = {fp for w in workers for fp in _fingerprints(w.definitions)}
        names = sorted({str(n) for w in workers if isinstance(w.definitions, dict)
                        for n in w.definitions})
        known = store.definitions(names) if names else []
        conn.rollback()
    shapes: dict[str, list[Shape]] = {}
    for r in known:  # by pipeline, version, first sight
        if r.fingerprint in served:
            shapes.setdefault(r.pipeline, []).append(Shape(r.shape, r.fingerprint))
    return shapes


def _fingerprints(definitions: Any) -> list[str]:
    if not isinstance(definitions, dict):
        return []
    return [v["fingerprint"] for versions in definitions.values()
            if isinstance(versions, list) for v in versions
            if isinstance(v, dict) and isinstance(v.get("fingerprint"), str)]


def check_deploy(engine: sa.Engine, app: FlowQ, *, schema: str | None = None) -> DeployReport:
    """Whether `app`'s code could continue every run in flight (see the module)."""
    return check_shapes(engine, shapes_of(app), schema=app.schema if schema is None else schema)


def check_shapes(engine: sa.Engine, code: Mapping[str, Sequence[Shape]], *,
                 schema: str) -> DeployReport:
    """`check_deploy` for definitions given as shapes (by name, oldest version first)."""
    validate_schema_name(schema)
    with engine.connect() as conn:
        store = Store.of(conn, schema)
        groups = store.runs_in_flight(MAX_GROUPS)
        names = sorted(set(code) | {g.task for g in groups})
        known = store.definitions(names)
        workers = store.served_definitions(LIVE_S)
        conn.rollback()
    recorded = {r.fingerprint: Shape(r.shape, r.fingerprint) for r in known}
    served: dict[str, list[tuple[str, int, str]]] = {}  # pipeline -> (worker, version, fp)
    for w in workers:
        entries = w.definitions if isinstance(w.definitions, dict) else {}
        for name, versions in entries.items():
            for v in versions if isinstance(versions, list) else ():
                # Another process's word: only entries of the shape this release writes.
                if isinstance(v, dict) and isinstance(v.get("fingerprint"), str) \
                        and isinstance(v.get("version"), int):
                    served.setdefault(str(name), []).append(
                        (w.name, v["version"], v["fingerprint"]))
    reports = {name: PipelineReport(name, versions=[_label(s.version, s.fingerprint)
                                                    for s in code.get(name, ())])
               for name in names}
    found: dict[tuple[str, str, str], dict[str, Any]] = {}
    for g in groups:
        old = recorded.get(g.fingerprint) if g.fingerprint else None
        label = (_label(old.version, g.fingerprint) if old is not None and g.fingerprint else
                 f"unrecorded {short(g.fingerprint)}" if g.fingerprint else "unrecorded")
        report = reports[g.task]
        report.in_flight[label] = report.in_flight.get(label, 0) + int(g.runs)
        for step, kind, sentence in _problems(code.get(g.task, ()), old, g):
            key = (g.task, kind, f"{step}\0{sentence}\0{label}")
            entry = found.setdefault(key, {"pipeline": g.task, "step": step,
                                           "sentence": sentence, "runs": 0, "oldest": None,
                                           "example": g.example, "label": label,
                                           "fingerprint": g.fingerprint})
            entry["runs"] += int(g.runs)
            if g.oldest is not None and (entry["oldest"] is None or g.oldest < entry["oldest"]):
                entry["oldest"] = g.oldest
            entry["example"] = min(entry["example"], g.example)
    for e in found.values():
        by = tuple(sorted({w for w, _v, fp in served.get(e["pipeline"], ())
                           if e["fingerprint"] is not None and fp == e["fingerprint"]}))
        reports[e["pipeline"]].stranded.append(Stranded(
            e["pipeline"], e["step"], e["sentence"].replace("{runs}", f"{e['runs']:,}"), e["runs"],
            e["oldest"], int(e["example"]), e["label"], by))
    for name, report in reports.items():
        ours = {s.fingerprint for s in code.get(name, ())}
        for worker, version, fp in served.get(name, ()):
            same = "the same as this code's" if fp in ours else "not in this code"
            report.served_by.append(f"{worker}: {_label(version, fp)}, {same}")
        report.stranded.sort(key=lambda s: (-s.runs, s.reason))
    return DeployReport([reports[n] for n in names])


def _label(version: int, fingerprint: str) -> str:
    return f"version {version} ({short(fingerprint)})"


def _problems(versions: Sequence[Shape], old: Shape | None, g: Any
              ) -> list[tuple[str, str, str]]:
    """(step, kind, sentence with `{runs}`) for each reason `versions` (the code's, of
    `g.task`) could not continue the runs of group `g`, whose definition is `old` (None:
    not recorded): `flowq.define.shape.obstacles`, the worker's rule, per group."""
    new = pick_version(list(versions), g.fingerprint, old.version if old else None, g.step)
    if new is None:
        what = (f"version {old.version} of pipeline {g.task!r}" if versions and old is not None
                else f"pipeline {g.task!r}")
        return [(g.step, "gone", f"{what} is not in this code while {{runs}} run(s) on it "
                 "are in flight")]
    if g.fingerprint is not None and new.fingerprint == g.fingerprint:
        return []
    found = obstacles(new, old, g.step, joined=bool(g.joined), names=list(g.names))
    tails = {"removed": " while {runs} run(s) wait to run it",
             "arguments": " ({runs} run(s) wait to run it)",
             "join": " ({runs} run(s) at step " + repr(g.step) + ")"}
    return [(o.step, o.kind, o.text + tails.get(o.kind, " ({runs} run(s))")) for o in found]
