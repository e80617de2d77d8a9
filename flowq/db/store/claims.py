"""The worker's verbs: claims, permits, fenced writes, checkpoints, reaping (`ClaimVerbs`).

Each verb takes Python values (claims as `Claim`, successes as `Completion` and `Successor`
dataclasses), builds every bind parameter by the names of the columns the statement declares
(`fragments.bind_rows`), and gives back frozen dataclasses read by column name
(`flowq.db.rows.read`).

What the verbs keep from the statements they send:
- every write after the claim is fenced on (id, lease) and `running` (`flowq.db.sql.claims`);
- the rows of a batch are locked in id order (`complete`, `heartbeat`, `release` sort their
  claims): two statements locking the same rows in different orders deadlocked once in a
  1,000,000-job drain;
- a single claim is written with the one-row VALUES shape (a primary-key lookup), a batch with
  `unnest`; successors are always a batch (one success may create many).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, TypeAlias

from sqlalchemy.sql.elements import TextClause

from flowq.db.rows import (
    Beat,
    Claim,
    ClaimedJob,
    ClaimKey,
    Completed,
    Completion,
    Expired,
    Fired,
    Reaped,
    Retry,
    Spawned,
    StoredCheckpoint,
    Successor,
    column,
    read,
    read_one,
)
from flowq.db.runner import Rows
from flowq.db.sql.fragments import CLAIM_KEY, SPAWN, SUCCESSOR, bind_rows
from flowq.db.store.base import Verbs

__all__ = ["ClaimVerbs", "LimitedClaim", "PermittedClaim", "QueueControl"]

# How many candidate rows a limited claim scans per job it wants (at least MIN_SCAN): keys at
# their limit are skipped in the scan, so it must look past them.
SCAN_FACTOR = 4
MIN_SCAN = 100


@dataclass(frozen=True)
class LimitedClaim:
    """What a claim within a queue's limits got, and whether the limits held due jobs back
    (capacity frees up as other workers' jobs end, which no notification announces)."""

    jobs: list[ClaimedJob]
    held_back: bool


@dataclass(frozen=True)
class PermittedClaim:
    """What a claim under a worker's permits got: the jobs, whether due jobs remain, the
    permits it holds (0: none, or voided), which of its earlier claims still run, its
    running jobs of the queue after the claim,
    its share of the queue's concurrency, and whether its permits were valid (`ok` false:
    the queue is no longer claimed under permits, or its limit changed)."""

    jobs: list[ClaimedJob]
    more: bool
    held: int
    mine: list[int]  # which of the ids given still run, ours
    running: int
    share: int
    ok: bool


# How a worker claims a queue that `flowq.queues` controls (see `Store.controls`).
QueueControl: TypeAlias = Literal["paused", "permits", "limited"]


class ClaimVerbs(Verbs):
    """The worker's verbs: what a claim takes, and every fenced write after it."""

    # -- claims ------------------------------------------------------------------------------

    def claim(self, queue: str, limit: int, worker: str,
              after: ClaimKey | None = None) -> list[ClaimedJob]:
        """Claim up to `limit` due jobs of `queue` for `worker` (none from a paused or limited
        queue: see `claim_limited`), only those sorting after the claim key `after` when it
        is given (`claim_jobs_after`). One statement per queue: the pending index leads with
        the queue, so the caller visits its queues in rotation."""
        params: dict[str, Any] = {"queue": queue, "limit": limit, "worker": worker}
        if after is None:
            return read(ClaimedJob, self.run(self.q.claim_jobs, params))
        priority, run_at, job_id = after
        return read(ClaimedJob, self.run(self.q.claim_jobs_after, {
            **params, "priority": priority, "run_at": run_at, "id": job_id}))

    def claim_any(self, queue: str, limit: int, worker: str,
                  run_ids: Sequence[int] | None = None) -> list[ClaimedJob]:
        """`claim` ignoring pauses and limits, optionally only of the runs `run_ids`: the test
        kit's drain, in the test's own transaction."""
        params: dict[str, Any] = {"queue": queue, "limit": limit, "worker": worker}
        if run_ids is None:
            return read(ClaimedJob, self.run(self.q.claim_any_jobs, params))
        return read(ClaimedJob, self.run(self.q.claim_run_jobs,
                                         {**params, "run_ids": list(run_ids)}))

    def controlled_queues(self, queues: Sequence[str]) -> dict[str, bool]:
        """Which of `queues` are paused (True) or limited (False)."""
        return {name: c == "paused" for name, c in self.controls(queues).items()}

    def controls(self, queues: Sequence[str]) -> dict[str, QueueControl]:
        """How each of `queues` that `flowq.queues` controls is claimed: not at all
        (paused), under permits (a concurrency limit alone), or the limited way."""
        rows = self.run(self.q.select_controlled_queues, {"queues": list(queues)})
        return {name: "paused" if paused else "permits" if permits else "limited"
                for name, paused, permits in zip(column(rows, "name"), column(rows, "paused"),
                                                 column(rows, "permits"), strict=True)}

    def claim_limited_statements(self, queue: str, limit: int, worker: str
                                 ) -> list[tuple[TextClause, Mapping[str, Any]]]:
        """The two statements of a limited claim, to send in one transaction (in that order,
        each in its own snapshot): lock the queue's row, then claim within its limits.
        `read_limited` reads the rows of the second."""
        params = {"queue": queue, "limit": limit, "worker": worker}
        return [(self.q.lock_queue, params),
                (self.q.claim_limited_jobs,
                 {**params, "scan": max(MIN_SCAN, SCAN_FACTOR * limit)})]

    @staticmethod
    def read_limited(rows: Rows) -> LimitedClaim:
        """The claimed jobs and the `more` flag of `claim_limited_jobs`' rows (a single row of
        NULLs and `more` stands for "none claimed")."""
        held_back = bool(rows and rows[0][rows.columns.index("more")])
        claimed = Rows(rows.columns, (r for r in rows if r[rows.columns.index("id")] is not None))
        return LimitedClaim(read(ClaimedJob, claimed), held_back)

    def claim_limited(self, queue: str, limit: int, worker: str) -> LimitedClaim:
        """`claim` for a paused or limited queue; send it inside a transaction (the queue's
        lock is held to its end, so limited claims of one queue take turns)."""
        rows = Rows()
        for statement, params in self.claim_limited_statements(queue, limit, worker):
            rows = self.run(statement, params)
        return self.read_limited(rows)

    # -- permits (a queue limited by its concurrency alone) -------------------------------------

    def lease_permits_statements(self, queue: str, want: int, worker: str
                                 ) -> list[tuple[TextClause, Mapping[str, Any]]]:
        """The two statements of a lease, to send in one transaction (in that order, each in
        its own snapshot): lock the queue's row (reclaiming the permits of workers gone from
        the registry), then lease `worker` permits for what it runs plus `want` more.
        `read_lease` reads the rows of the second."""
        return [(self.q.lock_queue, {"queue": queue}),
                (self.q.lease_permits, {"queue": queue, "worker": worker, "want": want})]

    @staticmethod
    def read_lease(rows: Rows) -> tuple[int, bool, bool]:
        """(the permits held after a lease, whether the queue is claimed under permits,
        whether any of its jobs is due)."""
        held, ok, due = rows[0] if rows else (0, False, False)
        return int(held), bool(ok), bool(due)

    def claim_permitted(self, queue: str, limit: int, worker: str,
                        mine: Collection[int]) -> PermittedClaim:
        """Claim up to `limit` due jobs of `queue` under `worker`'s own permits (one statement,
        no lock on the queue's row). `mine`: the ids of every job of `queue` that `worker`
        claimed and has not seen end (its running jobs are counted among them)."""
        rows = self.run(self.q.claim_permitted_jobs,
                        {"queue": queue, "limit": limit, "worker": worker, "ids": list(mine)})
        first = dict(zip(rows.columns, rows[0], strict=True))
        claimed = Rows(rows.columns, (r for r in rows if r[rows.columns.index("id")] is not None))
        return PermittedClaim(read(ClaimedJob, claimed), bool(first["more"]),
                              int(first["held"]), list(first["mine"]), int(first["running"]),
                              int(first["share"]), bool(first["ok"]))

    def running_ids(self, queue: str, worker: str) -> set[int]:
        """The ids of `worker`'s running jobs of `queue` (what `claim_permitted` is first
        given)."""
        return {int(i) for i in column(self.run(self.q.select_running_ids,
                                                {"queue": queue, "worker": worker}), "id")}

    def release_permits(self, queue: str, worker: str, keep: int = 0) -> int:
        """Give back `worker`'s permits of `queue` beyond max(`keep`, its running jobs);
        returns what it holds after."""
        rows = self.run(self.q.release_permits, {"queue": queue, "worker": worker, "keep": keep})
        return int(rows[0][0])

    def release_worker_permits(self, worker: str) -> int:
        """Give back every permit of `worker` beyond its running jobs (a clean stop, after the
        release); returns how many queues' permits it no longer holds at all."""
        return int(self.run(self.q.release_worker_permits, {"worker": worker})[0][0])

    # -- fenced writes -----------------------------------------------------------------------

    def heartbeat(self, worker: str, claims: Sequence[Claim],
                  progress: Mapping[int, str] | None = None) -> list[Beat]:
        """Beat `worker`'s registry entry; the `claims` still ours, with whether their run was
        cancelled (the running handler is told). Each claim's own heartbeat is refreshed
        only when the entry cannot stand for it (see `heartbeat_jobs`). `progress`: the new
        `ctx.progress` JSON of some of them, by job id, written in the same statement."""
        progress = progress or {}
        beats = [_Progress(i, lease, progress.get(i)) for i, lease in sorted(claims)]
        return read(Beat, self.run(self.q.heartbeat_jobs, {
            "worker": worker, **bind_rows((*CLAIM_KEY, ("progress", "jsonb")), beats,
                                          single=False)}))

    def complete(self, completions: Sequence[Completion],
                 successors: Sequence[Successor] = ()) -> list[Completed]:
        """Mark `completions` succeeded and create `successors` (each naming the claim it
        follows), in one statement; the completions that were still ours. A successor is
        created only if its claim landed and its run was not cancelled meanwhile."""
        done = sorted(completions, key=lambda c: c.id)
        single = len(done) == 1
        params = bind_rows((*CLAIM_KEY, ("result", "jsonb")), done, single=single)
        params["channel"] = self.channel  # new successors', and waiting parents' (children)
        if not successors:
            statement = self.q.complete_job if single else self.q.complete_jobs
        else:
            # Chains and map instances take the plain statement; joins and signals the
            # workflow one (counters, rendezvous), which costs more to plan and run.
            flow = any(isinstance(s, Spawned) and (s.parents > 0 or s.signal is not None)
                       for s in successors)
            params.update(bind_rows(SPAWN if flow else SUCCESSOR,
                                    [_full(s) for s in successors] if flow else successors,
                                    single=False, prefix="next_"))
            if flow:
                statement = self.q.complete_flow if single else self.q.complete_flows
            else:
                statement = self.q.complete_step if single else self.q.complete_steps
        return read(Completed, self.run(statement, params))

    def retry(self, claim: Claim, delay: float, error: str) -> Retry | None:
        """Send a failed attempt back to pending after `delay` seconds, with `error`; None if
        the claim is no longer ours."""
        job_id, lease = claim
        return read_one(Retry, self.run(self.q.retry_job, {
            "id": job_id, "lease": lease, "delay": delay, "error": error}))

    # -- checkpoints (flowq.durable) ------------------------------------------------------------

    def checkpoints(self, run_id: int, step: str, map_index: int | None
                    ) -> tuple[list[StoredCheckpoint], datetime]:
        """The recorded checkpoints of one step (a map instance's own), by position, and the
        database's clock."""
        rows = self.run(self.q.select_checkpoints, {
            "run_id": run_id, "step": step, "map_index": map_index})
        now = rows[0][rows.columns.index("now")]
        name = rows.columns.index("name")
        found = Rows(rows.columns, [r for r in rows if r[name] is not None])
        return read(StoredCheckpoint, found), now

    def record_checkpoint(self, claim: Claim, run_id: int, step: str, map_index: int | None,
                          name: str, position: int, *, result: str | None = None,
                          sleep: float | None = None, until: datetime | None = None
                          ) -> str | None:
        """Record checkpoint `name` of a running claim, fenced, in the runner's transaction
        (its row stays locked until that ends): `result` (JSON text), or for a sleep
        (`sleep` seconds from now, or `until`) its deadline; the stored JSON, or None if the
        claim is no longer ours."""
        job_id, lease = claim
        rows = self.run(self.q.record_checkpoint, {
            "id": job_id, "lease": lease, "run_id": run_id, "step": step,
            "map_index": map_index, "name": name, "position": position, "result": result,
            "sleep": sleep, "until": until})
        return str(rows[0][rows.columns.index("result")]) if rows else None

    def suspend(self, claim: Claim, step: str, *, until: datetime | None, delay: float,
                snoozes: int | None, note: str | None = None) -> Retry | None:
        """Send a claim back to pending until `until` (else `delay` seconds from now) giving
        its attempt back, storing the step's snooze count if given and `note` as its
        `last_error`; None if no longer ours."""
        job_id, lease = claim
        return read_one(Retry, self.run(self.q.suspend_job, {
            "id": job_id, "lease": lease, "step": step, "until": until, "delay": delay,
            "snoozes": snoozes, "note": note}))

    def hand_over(self, claim: Claim, step: str, delay: float, note: str) -> Retry | None:
        """Leave a claim to another worker after `delay` seconds, its attempt not counted
        (`suspend` with `note`); None if the claim is no longer ours."""
        return self.suspend(claim, step, until=None, delay=delay, snoozes=None, note=note)

    def end(self, claim: Claim, status: Literal["dead", "cancelled"], error: str
            ) -> str | None:
        """End a claim as `status` with `error`; its status, or None if no longer ours."""
        job_id, lease = claim
        rows = self.run(self.q.end_job, {"id": job_id, "lease": lease, "status": status,
                                         "error": error, "channel": self.channel})
        return rows[0][rows.columns.index("status")] if rows else None

    def release(self, claims: Sequence[Claim]) -> list[int]:
        """Hand `claims` back without burning their attempt (waking other workers); the ids
        released."""
        keys = [_Key(i, lease) for i, lease in sorted(claims)]
        rows = self.run(self.q.release_jobs, {**bind_rows(CLAIM_KEY, keys, single=False),
                                              "channel": self.channel})
        return [int(i) for i in column(rows, "id")]

    def reap(self, stale: float, limit: int) -> list[Reaped]:
        """Requeue, bury or cancel up to `limit` running jobs whose heartbeat is older than
        `stale` seconds (their worker died)."""
        return read(Reaped, self.run(self.q.reap_jobs, {"stale": stale, "limit": limit,
                                                        "channel": self.channel}))

    def expire_deadlines(self, error: str, limit: int) -> list[Expired]:
        """Cancel up to `limit` unfinished rows of runs whose deadline passed, as a run
        cancel does (`error`: their last_error, a format string given the deadline)."""
        return read(Expired, self.run(self.q.cancel_expired_jobs,
                                      {"error": error, "limit": limit}))

    def advance_batches(self, limit: int) -> int:
        """Count up to `limit` finished runs of batches into their batches; how many
        batches changed."""
        return len(self.run(self.q.advance_batches, {"limit": limit}))

    def start_batch_callbacks(self, limit: int) -> list[Fired]:
        """Enqueue the callback of up to `limit` batches whose runs have all finished."""
        return read(Fired, self.run(self.q.start_batch_callbacks, {
            "batch_id": None, "limit": limit, "channel": self.channel}))

    def expire_waits(self, limit: int) -> list[int]:
        """Make up to `limit` steps whose signal did not come by their timeout runnable
        (oldest deadline first), waking their queues; their ids."""
        return [int(i) for i in column(self.run(self.q.expire_waits, {
            "limit": limit, "channel": self.channel}), "id")]


@dataclass(frozen=True)
class _Key:
    """A claim as the columns `CLAIM_KEY` names."""

    id: int
    lease: int


@dataclass(frozen=True)
class _Progress:
    """A claim and its new progress JSON (None: none new), as `heartbeat_jobs` names them."""

    id: int
    lease: int
    progress: str | None


def _full(successor: Successor) -> Spawned:
    """`successor` with the workflow columns (none: created at once, no join, no signal)."""
    if isinstance(successor, Spawned):
        return successor
    return Spawned(**{name: getattr(successor, name) for name, _ in SUCCESSOR})
