"""Claimer: claims due jobs for the worker's free slots and hands each one on at once.

One `claim_jobs` statement per queue, the queues visited in rotation (the pending index leads
with the queue, so `queue = ANY(...)` could not use its order across queues), each asking for
what is still free. A paused queue is skipped; a limited one (`flowq.queues`) is claimed with
`claim_limited_jobs` in a short transaction that first locks the queue's row. Each row is
handed to the executor as soon as its statement returns, so an error in a later queue's claim
drops nothing: the rows already claimed are already running. Autocommit on a dedicated
connection: each claim is one atomic statement. The statements, their parameters and the
claimed rows (`ClaimedJob`, read by column name) are `flowq.db.store.Store`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flowq.db.rows import ClaimedJob
from flowq.db.sql import Queries
from flowq.db.store import Store
from flowq.storable import describe, first_line
from flowq.worker.connection import DedicatedConnection
from flowq.worker.logs import ERROR, log_event

__all__ = ["Claimer"]


class Claimer:
    """Claims up to the free slots, across `queues` in rotation, for worker `name`."""

    def __init__(self, conn: DedicatedConnection, queries: Queries, queues: Sequence[str],
                 name: str, submit: Callable[[ClaimedJob], None]) -> None:
        self.conn = conn
        self.store = Store(conn.execute, queries.schema)
        self.queues = list(queues)
        self.name = name
        self.submit = submit
        self.claimed = 0
        self._rotation = 0
        # Queues that are paused (True) or limited (False), as last read from flowq.queues:
        # paused ones are skipped, limited ones claimed under their row's lock.
        self.controlled: dict[str, bool] = {}
        # Set by a claim when a limit held due jobs back: capacity frees up as other
        # workers' jobs end, which no notification announces, so the worker looks again soon.
        self.held_back = False

    def refresh(self) -> None:
        """Re-read which of our queues are paused or limited (every poll interval)."""
        self.controlled = self.store.controlled_queues(self.queues)

    def _claim(self, queue: str, want: int, limited_want: int) -> list[ClaimedJob]:
        paused = self.controlled.get(queue)
        if paused:
            return []
        if paused is None:
            return self.store.claim(queue, want, self.name)
        want = min(want, limited_want)
        if want <= 0:
            return []
        # Limited: take the queue's lock, then claim in a snapshot taken after it, so what
        # the other workers' claims started is counted. The `more` column says whether the
        # limits held due jobs back; a row of NULLs stands for "none claimed".
        limited = self.store.read_limited(self.conn.transaction(
            self.store.claim_limited_statements(queue, want, self.name)))
        if limited.held_back:
            self.held_back = True
        return limited.jobs

    def run_once(self, free_slots: int,
                 submit: Callable[[ClaimedJob], None] | None = None, *,
                 free_handlers: int | None = None) -> int:
        """Claim and submit up to `free_slots` jobs; returns how many. A database error is
        raised after the rows of earlier queues were submitted.

        From a limited queue, at most `free_handlers` (default: all the free slots): a job
        claimed ahead would start later than its claim, so a rate limit counted at the
        claim would let more start in a window than it allows (issue 20)."""
        submit = submit or self.submit
        handlers = free_slots if free_handlers is None else free_handlers
        self.held_back = False
        n = len(self.queues)
        start, self._rotation = self._rotation, (self._rotation + 1) % n
        got = 0
        for i in range(n):
            want = free_slots - got
            if want <= 0:
                break
            for job in self._claim(self.queues[(start + i) % n], want, handlers - got):
                got += 1
                self.claimed += 1
                try:
                    submit(job)
                except Exception as exc:  # a bug: the claim runs out and the reaper requeues
                    log_event(ERROR, "could not start a claimed job", job_id=job.id,
                              error=first_line(describe(exc)))
        return got
