"""The enqueue's verbs: runs and jobs inserted, idempotency and unique keys, signals, batches.

An enqueue is sent on the caller's own connection, sync (`flowq.enqueueing.sync`: on its
psycopg connection directly, or through SQLAlchemy) or async (`flowq.enqueueing.aio`), so
most verbs here build rather than send: from values `flowq.enqueueing.prepare` validated,
they choose the statement and build every bind parameter, and return a `PreparedCall` (or a
`PreparedSignal`, or a statement with its parameters) that either path sends. `builder(schema)`
is the verbs of a schema without a runner, one per process, so an enqueue makes no store.

What the statements keep (`PreparedCall.statements` says it for both paths): a keyed enqueue
that waited for a concurrent inserter of its key reads that run with a new statement (a new
snapshot), and frees a key whose run has no rows; a unique enqueue whose snapshot was too old
sends its statement again. Rows are read here, by the column order of the statements beside
them (a first row is what both paths hand back), so no caller sees it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from typing import Any, Generic, TypeVar

import sqlalchemy as sa
from sqlalchemy.sql.elements import TextClause

from flowq.db.runner import Rows
from flowq.db.store.base import Verbs
from flowq.errors import EnqueueConflictError, RunNotFoundError, RunStateError, SignalError

__all__ = ["KEY_RACE_ATTEMPTS", "UNIQUE_RACE_ATTEMPTS", "EnqueueVerbs", "Enqueued", "NewRun",
           "PreparedCall", "PreparedSignal", "Root", "Signalled", "builder"]

# How often a keyed enqueue starts over when the run that beat it to its key was deleted
# before it could be read (see `PreparedCall.statements`).
KEY_RACE_ATTEMPTS = 3
# How often a unique enqueue sends its statement again when a concurrent claim of its key
# committed after its snapshot (each attempt has a newer snapshot: losing again needs that
# run to finish and yet another enqueuer to claim the key in between).
UNIQUE_RACE_ATTEMPTS = 10

T = TypeVar("T")


@dataclass(frozen=True)
class Enqueued:
    """What enqueue returns: the run's `id`, and `created=False` when an idempotency key or a
    unique key matched (`job_id`: that run's first row)."""

    id: int
    created: bool
    job_id: int


@dataclass(frozen=True)
class Signalled:
    """What `signal` returns: `created=False` when the same payload had already been sent."""

    run_id: int
    name: str
    created: bool
    delivered: bool  # the waiting step was reached and is now runnable


@dataclass(frozen=True, slots=True)
class NewRun:
    """A validated run to start, but its arguments: its first row's columns and its due time
    and deadline (`deadline_at`, or `deadline_in` from the database's now(); both None:
    none)."""

    task: str
    step: str  # '' for a run enqueued by name: the worker resolves its first step
    queue: str
    priority: int
    max_attempts: int
    key_limit: int | None
    fingerprint: str | None  # of the definition it starts under (None: unknown here)
    run_at: datetime | None
    delay: timedelta
    deadline_at: datetime | None
    deadline_in: timedelta | None


@dataclass(frozen=True)
class Root:
    """A step a run starts with, when it starts with several rows (or one that waits or is
    delayed): what `insert_run` writes of it."""

    name: str
    index: int
    queue: str
    max_attempts: int
    delay: float | None
    wait_for: str | None
    wait_timeout: float | None


@dataclass(frozen=True)
class PreparedCall(Generic[T]):
    """A validated enqueue, ready to run on a sync or async connection; `finish` reads its result."""

    statement: sa.Executable
    params: dict[str, Any]
    schema: str
    finish: Callable[[Sequence[Any]], T]  # reads a result row
    direct: bool = False  # may be sent on the caller's psycopg connection directly
    # A keyed enqueue's read of its key, for when its statement returns no row, and the
    # release of a key that names a run with no rows, for when that read finds none.
    lookup: sa.Executable | None = None
    release: sa.Executable | None = None
    # A unique enqueue: when its statement returns no row, send it again (a new snapshot).
    rerun: bool = False

    def statements(self) -> Generator[sa.Executable, Sequence[Any] | None, T]:
        """The statements to send, in turn: send back each one's first row (None if it had
        none); the generator returns the result. Sync and async execution share it."""
        for _ in range(UNIQUE_RACE_ATTEMPTS if self.rerun else KEY_RACE_ATTEMPTS):
            row = yield self.statement
            if row is None and self.lookup is not None:
                # The keyed statement waited for a concurrent inserter of its key, which
                # committed: that row is newer than the statement's snapshot, so it returned
                # nothing. Under READ COMMITTED a new statement takes a new snapshot, which
                # sees it. (Under REPEATABLE READ the INSERT raised a serialization failure.)
                row = yield self.lookup
                if row is None and self.release is not None:
                    # Or the key's entry names a run with no rows (pruned by an earlier
                    # release): free it, then start over.
                    yield self.release
            if row is not None:
                return self.finish(row)
            if self.lookup is None and not self.rerun:
                raise AssertionError("an enqueue statement returned no row")
            # The winner was deleted before we could read it: the key is free, start over.
            # (Unique: a claim of the key committed after our snapshot, which a new statement
            # sees; see `Queries.insert_job_unique`.)
        if self.rerun:
            raise EnqueueConflictError(
                f"could not enqueue with unique key {self.params['unique_key']!r}: "
                f"{UNIQUE_RACE_ATTEMPTS} times in a row a concurrent enqueue claimed it first "
                "(runs of that key start and finish faster than they can be enqueued?)")
        raise EnqueueConflictError(
            f"could not enqueue with idempotency_key {self.params['idempotency_key']!r}: "
            f"{KEY_RACE_ATTEMPTS} times a concurrent transaction inserted it, then it was "
            "deleted before it could be read"
        )


@dataclass(frozen=True)
class PreparedSignal:
    """A validated signal, ready to run on a sync or async connection (like an enqueue's
    `PreparedCall`: `statements()` yields each statement and is sent its first row).
    `check(task)` refuses a signal that no step of the run's task waits for."""

    params: dict[str, Any]
    schema: str
    check: Callable[[str], None]
    direct: bool = False

    @property
    def statement(self) -> TextClause:
        """The first statement (what picks the caller's session's connection)."""
        return builder(self.schema).q.select_run_state

    def statements(self) -> Generator[TextClause, Sequence[Any] | None, Signalled]:
        """Read the run's state, record the signal, and wake the waiting step if reached."""
        q = builder(self.schema).q
        run_id, name = self.params["run_id"], self.params["name"]
        state = yield q.select_run_state
        task, rows, active, cancelled = state if state is not None else (None, 0, 0, False)
        if not rows:
            raise RunNotFoundError(f"no run {run_id} exists to signal (it may have been pruned,"
                                   " or the id is a job id rather than a run id)")
        if cancelled:
            raise RunStateError(f"run {run_id} was cancelled: signal {name!r} cannot be "
                                "delivered")
        if not active:
            raise RunStateError(f"run {run_id} has finished: signal {name!r} cannot be "
                                "delivered")
        self.check(str(task))
        sent = yield q.send_signal
        if sent is None:
            same = yield q.compare_signal
            if same is not None and same[0]:
                return Signalled(run_id, name, created=False, delivered=False)
            raise SignalError(f"signal {name!r} was already sent to run {run_id} with another "
                              "payload: a signal is delivered once")
        step = sent[0]
        if step is None:  # not reached yet: the step takes the payload when it is
            return Signalled(run_id, name, created=True, delivered=False)
        self.params["step"] = step
        woken = yield q.wake_signalled_step
        return Signalled(run_id, name, created=True, delivered=woken is not None)


def _enqueued(row: Sequence[Any]) -> Enqueued:
    """An enqueue's row: (job id, run id, created, ...)."""
    job_id, run_id, created = row[:3]
    return Enqueued(id=run_id, created=bool(created), job_id=job_id)


def _run_ids(row: Sequence[Any]) -> list[int]:
    """`insert_jobs`' one row: the run ids, in the order of the arguments."""
    return list(row[0])


class EnqueueVerbs(Verbs):
    """Enqueue, signals and batches: what a producer's transaction writes."""

    # -- enqueue -------------------------------------------------------------------------------

    def _run_params(self, run: NewRun) -> dict[str, Any]:
        """The bind parameters every enqueue statement takes of its run."""
        return {
            "task": run.task,
            "step": run.step,
            "queue": run.queue,
            "priority": run.priority,
            "max_attempts": run.max_attempts,
            "key_limit": run.key_limit,
            "concurrency_key": None,
            "channel": self.channel,
            "trace_context": None,  # set by `execute` when tracing (flowq.tracing)
            "fingerprint": run.fingerprint,
            "run_at": run.run_at,
            "delay": run.delay,
            "deadline_at": run.deadline_at,
            "deadline_in": run.deadline_in,
        }

    def enqueue_call(self, run: NewRun, args: str, *, idempotency_key: str | None = None,
                     unique_key: str | None = None, concurrency_key: str | None = None,
                     roots: Sequence[Root] | None = None, roots_queue: str | None = None
                     ) -> PreparedCall[Enqueued]:
        """One run with `args` (JSON text): a single row (keyless, keyed, held under
        `unique_key`, with a concurrency key), or a run starting with `roots` (all moved to
        `roots_queue` if given); `idempotency_key` names the run."""
        q = self.q
        params = self._run_params(run)
        params["args"] = args
        if concurrency_key is not None:
            params["concurrency_key"] = concurrency_key
        if unique_key is not None:
            params.update(unique_key=unique_key, idempotency_key=idempotency_key)
        if roots is not None:
            params.update(idempotency_key=idempotency_key, steps=[r.name for r in roots],
                          step_indexes=[r.index for r in roots], queues=[r.queue for r in roots],
                          max_attempts=[r.max_attempts for r in roots],
                          delays=[r.delay for r in roots], signals=[r.wait_for for r in roots],
                          waits=[r.wait_timeout for r in roots])
            if roots_queue is not None:  # queue= moves the steps the run starts with
                params["queues"] = [roots_queue] * len(roots)
            if unique_key is not None:
                return PreparedCall(q.insert_run_unique, params, self.schema, _enqueued, True,
                                    rerun=True)
            keyed = idempotency_key is not None
            return PreparedCall(q.insert_run, params, self.schema, _enqueued, True,
                                lookup=q.find_run_by_key if keyed else None,
                                release=q.release_orphaned_key if keyed else None)
        if unique_key is not None:
            return PreparedCall(q.insert_job_unique, params, self.schema, _enqueued, True,
                                rerun=True)
        if idempotency_key is None:
            # A job with a concurrency key also marks its queue keyed (in the same statement):
            # its limit holds in whatever queue it is enqueued in. The keyless hot path does not.
            statement = q.insert_job if concurrency_key is None else q.insert_keyed_job
            return PreparedCall(statement, params, self.schema, _enqueued, True)
        params["idempotency_key"] = idempotency_key
        return PreparedCall(q.insert_job_by_key, params, self.schema, _enqueued, True,
                            lookup=q.find_run_by_key, release=q.release_orphaned_key)

    def enqueue_many_call(self, run: NewRun, args: list[str],
                          concurrency_keys: list[str | None]) -> PreparedCall[list[int]]:
        """One single-row run per item of `args` (JSON texts), with its concurrency key, in
        one statement (through SQLAlchemy: its cost is its rows, not a round trip)."""
        params = self._run_params(run)
        params["args"] = args
        params["concurrency_keys"] = concurrency_keys
        return PreparedCall(self.q.insert_jobs, params, self.schema, _run_ids)

    def check_schema_statement(self) -> tuple[TextClause, dict[str, Any]]:
        """The check that the schema's tables exist (a statement that cannot fail, sent before
        an enqueue would abort the caller's transaction); `schema_found` reads its row."""
        return self.q.check_schema, {}

    @staticmethod
    def schema_found(row: Sequence[Any] | None) -> bool:
        """Whether `check_schema_statement`'s row found the jobs table."""
        return row is not None and row[0] is not None

    # -- signals -------------------------------------------------------------------------------

    def signal_call(self, run_id: int, name: str, payload: str,
                    check: Callable[[str], None]) -> PreparedSignal:
        """Signal `name` with `payload` (JSON text) to run `run_id`; `check(task)` refuses a
        name no step of the run's task waits for."""
        return PreparedSignal({"run_id": run_id, "name": name, "payload": payload,
                               "step": None, "channel": self.channel}, self.schema, check)

    def signal_statement(self, run_id: int, name: str) -> tuple[TextClause, dict[str, Any]]:
        """The read of signal `name`'s payload if it was sent to run `run_id` (a waiting step
        whose timeout passed); `read_signal` reads its rows."""
        return self.q.find_signal, {"run_id": run_id, "name": name}

    @staticmethod
    def read_signal(rows: Sequence[Sequence[Any]]) -> tuple[Any] | None:
        """(payload,) of `signal_statement`'s rows, or None when the signal was not sent."""
        return (rows[0][0],) if rows else None

    def map_results_statement(self, run_id: int, step: str
                              ) -> tuple[TextClause, dict[str, Any]]:
        """The read of the results of mapped step `step`'s instances of run `run_id` (a
        join's input); `read_map_results` reads its rows."""
        return self.q.select_map_results, {"run_id": run_id, "step": step}

    @staticmethod
    def read_map_results(rows: Sequence[Sequence[Any]]) -> list[Any]:
        """The results of `map_results_statement`'s rows, in item order."""
        return [r[0] for r in rows]

    # -- batches -------------------------------------------------------------------------------

    def batch_id_statement(self) -> tuple[TextClause, dict[str, Any]]:
        """The draw of a new batch's id (never reused); `read_count` reads its row."""
        return self.q.select_batch_id, {}

    def insert_batch_statement(self, batch_id: int, run_ids: Sequence[int],
                               callback: PreparedCall[Any]) -> tuple[TextClause, dict[str, Any]]:
        """The write of closing batch `batch_id`: the runs `run_ids` that joined it and its
        `callback` (the row an enqueue of it inserts); `read_count` reads how many runs it
        waits for."""
        p = callback.params
        return self.q.insert_batch, {
            "id": batch_id, "run_ids": sorted(set(run_ids)), "task": p["task"],
            "step": p["step"], "queue": p["queue"], "priority": p["priority"],
            "max_attempts": p["max_attempts"], "args": p["args"]}

    def start_batch_statement(self, batch_id: int) -> tuple[TextClause, dict[str, Any]]:
        """The enqueue of batch `batch_id`'s callback if its runs have all finished (an empty
        batch's, at once)."""
        return self.q.start_batch_callbacks, {"batch_id": batch_id, "limit": 1,
                                              "channel": self.channel}

    @staticmethod
    def read_count(row: Sequence[Any]) -> int:
        """The one value of a statement's one row (a batch id, a batch's runs)."""
        return int(row[0])

    # -- reads -----------------------------------------------------------------------------------

    def pending_jobs_statement(self, task: str | None, queue: str | None
                               ) -> tuple[TextClause, dict[str, Any]]:
        """The read of the pending jobs of `task` and `queue` (None: any), oldest first, every
        column by name: what the test kit's `assert_enqueued` looks at."""
        return self.q.select_pending_jobs, {"task": task, "queue": queue}

    def due_jobs_exist(self, queues: Sequence[str], horizon: float) -> bool:
        """Whether a job of `queues` is due within `horizon` seconds."""
        rows = self.run(self.q.exists_due_jobs, {"queues": queues, "horizon": horizon})
        return bool(rows[0][0])


def _unsent(statement: sa.ClauseElement, params: Mapping[str, Any], /) -> Rows:
    raise TypeError("these enqueue verbs only build statements: the caller's connection "
                    "sends them (flowq.enqueueing.sync, flowq.enqueueing.aio)")


@cache
def builder(schema: str) -> EnqueueVerbs:
    """The enqueue verbs of `schema` that build statements without sending them (one per
    process: an enqueue makes no store of its own)."""
    return EnqueueVerbs(_unsent, schema)
