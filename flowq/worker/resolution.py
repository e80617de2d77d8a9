"""Which definition runs a claimed job, and the one rule when none here can (`resolve`).

- `resolve(app, job, elsewhere)`: the job's pipeline and step (of the version its run
  started under: `flowq.define.shape.pick_version`); an `UnknownTaskError` when this
  worker's app has no definition of that name at all (a failure retried later: the job
  waits for another app's workers); or a `Mismatch` when the app defines the pipeline but
  cannot run the step (removed or renamed in a deploy).
- `mismatch(...)`: the rule for a mismatch, never silent (also for arguments that do not
  bind, judged when an attempt is prepared): the job is left to another live worker that
  serves a compatible definition (`Elsewhere`, from the registry), else it is retried when
  its run started under a definition no worker has registered yet, else it ends `dead`
  with a sentence that names the mismatch and the fix.

Pure: what the database knows beyond this worker's app comes in an `Elsewhere` (the
registry refreshes it); `flowq.worker.attempt` applies the outcome.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from flowq.db.rows import ClaimedJob
from flowq.define.app import FlowQ
from flowq.define.pipeline import Pipeline
from flowq.define.shape import Shape, misfit, obstacles, pick_version, short
from flowq.define.step import Step
from flowq.errors import UnknownTaskError

__all__ = ["Elsewhere", "Mismatch", "ServedBy", "mismatch", "resolve", "stored_names"]


@dataclass(frozen=True)
class ServedBy:
    """Another live worker, as its registry entry says: the queues it serves and, per
    pipeline, the (version, fingerprint) of each definition it serves."""

    worker: str
    queues: frozenset[str]
    definitions: Mapping[str, tuple[tuple[int, str], ...]]


@dataclass(frozen=True)
class Elsewhere:
    """What the database knows beyond this worker's app: the version and shape of each
    fingerprint recorded for its pipelines (`flowq.definitions`), and the other live
    workers (`flowq.workers`). Refreshed by the registry at each beat; empty by default
    (the test kit: no other worker)."""

    versions: Mapping[str, int] = field(default_factory=dict)
    shapes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    workers: tuple[ServedBy, ...] = ()

    def compatible(self, job: ClaimedJob, names: Collection[str] | None = None) -> str | None:
        """A live worker (its name) that serves `job`'s queue with a definition that can run
        it: the very one its run started under, or, for a run of unknown fingerprint, one
        with its step (taking arguments named `names`, when given). None if there is none."""
        for w in self.workers:
            if job.queue not in w.queues:
                continue
            for _version, fingerprint in w.definitions.get(job.task, ()):
                if job.fingerprint is not None:
                    if fingerprint == job.fingerprint:
                        return w.worker
                    continue
                shape = Shape(self.shapes.get(fingerprint) or {}, fingerprint)
                step = shape.step_named(job.step)
                if step is not None and (
                        names is None or misfit(shape.params(step["name"]), names) is None):
                    return w.worker
        return None


@dataclass(frozen=True)
class Mismatch:
    """A job this worker's definition cannot run: `text` (the stored error: the mismatch and
    the fix), and the live worker it is left to (`left_to`), or None: the job ends `dead`;
    unless `unheard` (its run started under a definition this worker has not heard of: newer
    code, whose worker may not have registered yet): then it fails as an attempt, retried
    by the default policy up to the row's cap, so a worker that knows it can take it."""

    text: str
    left_to: str | None = None
    unheard: bool = False


def resolve(app: FlowQ, job: ClaimedJob, elsewhere: Elsewhere | None = None
            ) -> tuple[Pipeline, Step[Any, Any]] | UnknownTaskError | Mismatch:
    """The pipeline and step `job` runs, or why this worker's app cannot run it."""
    versions = app.versions(job.task)
    world = elsewhere or Elsewhere()
    if not versions:
        return UnknownTaskError(
            f"no task or pipeline named {job.task!r} is registered in this worker's app "
            "(enqueued by a newer producer, or renamed?); it will be retried")
    known = None if job.fingerprint is None else world.versions.get(job.fingerprint)
    pipeline = pick_version(versions, job.fingerprint, known, job.step)
    if pipeline is None:  # the run's version is not in this code
        return mismatch(versions[-1], job, f"version {known} of pipeline {job.task!r} is "
                        "not in this code", elsewhere)
    step = pipeline.step_named(job.step) if job.step else pipeline.first
    if step is not None and job.fingerprint in (None, pipeline.fingerprint):
        return pipeline, step
    # Another definition than the run's: the deploy check's rule, for this job (its
    # arguments are bound when it is prepared).
    old = None if job.fingerprint is None else world.shapes.get(job.fingerprint)
    found = obstacles(Shape.of(pipeline), None if old is None else Shape(old, job.fingerprint),
                      job.step, joined=job.joined)
    if step is None or found:
        return mismatch(pipeline, job, "; ".join(o.text for o in found), elsewhere)
    return pipeline, step


def mismatch(pipeline: Pipeline, job: ClaimedJob, problem: str, elsewhere: Elsewhere | None,
             names: Collection[str] | None = None) -> Mismatch:
    """The one rule for a job that `pipeline` (this worker's version for its run) cannot
    run because of `problem`: left to a live worker serving a compatible definition; else,
    for a definition the registry has never recorded, retried (newer code: its workers may
    be starting); else dead with the mismatch and the fix. `elsewhere` None: nothing is
    known beyond this app (the test kit), so nothing is left to others and nothing waits."""
    started = (f"started under definition {short(job.fingerprint)}" if job.fingerprint
               else "started under an unrecorded definition")
    where = f"pipeline {job.task!r} version {pipeline.version} ({short(pipeline.fingerprint)})"
    other = (elsewhere or Elsewhere()).compatible(job, names)
    if other is None and elsewhere is not None and job.fingerprint is not None \
            and job.fingerprint not in elsewhere.versions:
        return Mismatch(
            f"run {job.run_id} started under definition {short(job.fingerprint)} of "
            f"{job.task!r}, which no worker has registered (newer code, whose workers are "
            f"starting?): this worker's {where} cannot run step "
            f"{job.step or pipeline.first.name!r}: {problem}; it will be retried",
            unheard=True)
    if other is not None:
        return Mismatch(f"left to worker {other!r}, which serves the "
                        f"definition run {job.run_id} {started}: this worker's {where} "
                        f"cannot run step {job.step or pipeline.first.name!r}: {problem}",
                        other)
    return Mismatch(
        f"run {job.run_id} ({started}) cannot continue on this worker's "
        f"{where}: {problem}; no live worker serves a definition that can run it. Fix: deploy "
        f"code that can (keep the step, or the version the run started on beside the new "
        f"one: app.pipeline({job.task!r}, version=N)) and `flowq runs retry {job.run_id}`, "
        f"or `flowq runs fork {job.run_id}` to continue it on the new definition "
        "(`flowq deploy-check` names such runs before a deploy)")


def stored_names(args: str) -> list[str] | None:
    """The argument names of stored arguments (JSON text), or None if they are no object."""
    try:
        value = json.loads(args)
    except ValueError:
        return None
    return list(value) if isinstance(value, dict) else None
