"""Child runs: a step starts runs of its own, then waits for them without holding a slot.

- `start(task, args)` (`ctx.start_child(task_or_pipeline, **args)`): enqueues a run through
  the one enqueue path (`flowq.enqueueing.sync.enqueue`: its arguments and options checked
  like any enqueue's) in the session of a checkpoint of flowq's own, `flowq.child.N` (the
  N-th child of the attempt), which also links it to its parent (table `flowq.children`: the run,
  step and map instance). The child, its link and the record commit in one transaction,
  fenced on the claim: a retry (or a replay after a wait) gets the same run id back and
  never starts it twice, and a worker that lost its claim starts nothing. The handle is the
  child's run id, an int: JSON, so a step may return it and a later step wait on it.
- `wait_all(handles)` (`ctx.wait(child)`, `ctx.wait_all([...])`): reads the children's
  statuses (the rule of `flowq.ops.runinfo.run_status`) in one statement. Every child
  succeeded: their results, in the order asked (a run's result as `flowq.runs.get_run`
  gives it). One dead or cancelled: `flowq.ChildFailed` naming the first such (in the
  order asked), its failed step and error, for the parent's retry policy. Otherwise the
  step suspends (`flowq.durable.sleeps.Suspend`: back to pending, no slot held, its
  attempt given back) and runs again after a re-check delay, its checkpoints replaying.

Two ways a waiting parent learns that its children finished. The write that ends a child's
step (`flowq.db.sql.children.wake_parents`, part of every success statement and of
`end_job`, which ends a step dead or cancelled) makes the parent's suspended job due now
and notifies its queue (the step that waits: a later step waiting for a child an earlier
one started repoints the child's link at itself when it suspends); measured with a `-c 4` worker,
a parent ends a median 15 ms after its one 1.2 s child (0.86 s by the re-check alone). And
a bounded re-check, for what the wake-up misses (a child ended by the reaper or by a
cancel, or one that ends while its parent is still running up to its wait): the delay is the time since the newest
waited-on child was started, at least `MIN_RECHECK` and at most `MAX_RECHECK` seconds
(0.5, 1, 2, 4, then every 5 s). Each re-check is one claim, one read of the step's
checkpoints and one of the children.

Hostile handles: a handle is a run id (an int); one that is not a child of this run (of any
of its steps) is a `WorkflowError` (not retried). At most `MAX_WAIT` distinct children per
wait. Options a child cannot take: `schema` (a child lives in its parent's schema),
`idempotency_key`, `unique` and `unique_key` (its checkpoint already starts it once; a key
matching another run would make that run a child of two parents).

Options and their defaults: `MIN_RECHECK = 0.5`, `MAX_RECHECK = 5.0` seconds,
`MAX_WAIT = 10_000` children per wait, `MAX_DEPTH = 100` levels a cancel walks down.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final

from flowq.db.store import Store
from flowq.durable.checkpoints import CHILD_PREFIX, Ledger
from flowq.durable.session import commit_step_session
from flowq.durable.sleeps import Suspend
from flowq.enqueueing.sync import enqueue
from flowq.errors import (
    CancelRun,
    ChildFailed,
    ContextError,
    InvalidArgumentsError,
    RunNotFoundError,
    WorkflowError,
)
from flowq.names import check_id
from flowq.ops.runinfo import read_run, read_runs

if TYPE_CHECKING:
    from flowq.define.pipeline import Pipeline

__all__ = ["CHILD_PREFIX", "MAX_DEPTH", "MAX_RECHECK", "MAX_WAIT", "MIN_RECHECK", "Children"]

MIN_RECHECK: Final = 0.5
MAX_RECHECK: Final = 5.0
MAX_WAIT: Final = 10_000
MAX_DEPTH: Final = 100
# Options `enqueue` takes that a child cannot (see the module).
REFUSED_OPTIONS: Final = ("schema", "idempotency_key", "unique", "unique_key")


def check_handle(handle: object) -> int:
    """The run id a child handle names, or WorkflowError."""
    if isinstance(handle, bool) or not isinstance(handle, int):
        raise WorkflowError(f"ctx.wait takes the handles ctx.start_child returned (run ids), "
                            f"got {type(handle).__name__}")
    try:
        return check_id(handle)
    except RunNotFoundError as exc:
        raise WorkflowError(f"ctx.wait: {exc}: not a child handle") from None


class Children:
    """The child runs of one attempt of one step (see the module), recorded through its
    `ledger`; `job_id` is the attempt's job, locked when a child is linked."""

    def __init__(self, ledger: Ledger, job_id: int) -> None:
        self.ledger, self.job_id = ledger, job_id
        self._started = 0

    def start(self, task: Pipeline | str, args: dict[str, Any]) -> int:
        """Start a child run of `task` with `args` once per step (see the module); its run id."""
        refused = [o for o in REFUSED_OPTIONS if o in args]
        if refused:
            raise InvalidArgumentsError(
                f"ctx.start_child does not take {', '.join(refused)}: a child runs in its "
                "parent's schema, and its checkpoint already starts it once")
        name = f"{CHILD_PREFIX}{self._started}"
        self._started += 1
        ledger = self.ledger

        def make(session: Any) -> int:
            if session is None:
                raise ContextError("ctx.start_child needs a database: this context has none "
                                 "(pass session= to make_context or run_step)")
            child = enqueue(session, task, schema=ledger.schema, **args)
            linked = Store.of(session, ledger.schema).link_child(
                self.job_id, child.id, ledger.run_id, ledger.step, ledger.map_index, name)
            if linked.cancelled:
                raise CancelRun("the run was cancelled: its child was not started")
            return int(child.id)

        return int(ledger.own_checkpoint(name, make))

    def wait_all(self, handles: Sequence[object]) -> list[Any]:
        """The results of the children `handles`, once all succeeded (see the module)."""
        if isinstance(handles, str | bytes) or not isinstance(handles, Sequence):
            raise WorkflowError(f"ctx.wait_all takes a list of child handles, got "
                                f"{type(handles).__name__}")
        ids = [check_handle(h) for h in handles]
        distinct = sorted(set(ids))
        if not ids:
            return []
        if len(distinct) > MAX_WAIT:
            raise WorkflowError(f"ctx.wait_all waits on at most {MAX_WAIT} children at once, "
                                f"got {len(distinct)}: wait on them in parts")
        ledger = self.ledger
        if ledger.session_factory is None:
            raise ContextError("ctx.wait needs a database: this context has none")
        with ledger.session_factory() as session:
            store = Store.of(session, ledger.schema)
            now, rows = store.children_status(ledger.run_id, distinct)
            found = {r.run_id: r for r in rows}
            strangers = [i for i in distinct if i not in found]
            if strangers:
                raise WorkflowError(
                    f"ctx.wait: run {strangers[0]} is not a child of run {ledger.run_id}"
                    + (f" (nor are {len(strangers) - 1} more)" if len(strangers) > 1 else "")
                    + ": wait on the handles ctx.start_child returned in this run")
            for i in ids:
                status = found[i].status
                if status is None:
                    raise ChildFailed(i, "gone", None, "its rows no longer exist (pruned)")
                if status in ("dead", "cancelled"):
                    child = read_run(session.connection(), store.schema, i)
                    failed = next((s for s in child.steps if s.status == status),
                                  child.current_step)
                    raise ChildFailed(i, status, failed.step, failed.last_error)
            if all(found[i].status == "succeeded" and found[i].finished for i in ids):
                runs = read_runs(session.connection(), store.schema, distinct)
                return [runs[i].result for i in ids]
            unfinished = sum(1 for i in distinct if not found[i].finished)
            newest = max(found[i].created_at for i in distinct)
            if ledger.claim is not None:  # a later step waiting: its children now wake it
                store.wait_on_children(self.job_id, ledger.run_id, distinct)
                commit_step_session(session)
        waited = (now - newest).total_seconds()
        delay = 0.0 if ledger.skip_sleeps else min(MAX_RECHECK, max(MIN_RECHECK, waited))
        raise Suspend(now + timedelta(seconds=delay),
                      f"ctx.wait: {unfinished} of {len(distinct)} child runs unfinished")
