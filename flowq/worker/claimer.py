"""Claimer: claims due jobs for the worker's free slots and hands each one on at once.

One `claim_jobs` statement per queue, the queues visited in rotation (the pending index leads
with the queue, so `queue = ANY(...)` could not use its order across queues), each asking for
what is still free. A paused queue is skipped. A queue limited by its `concurrency` alone is
claimed under permits (`flowq.db.sql.queues`): the claimer leases a batch of them (a short
transaction under the queue's row lock) when it has none to spare and due jobs wait, then
claims under the ones it holds, one statement that locks only this worker's permits row;
it gives back what it does not use when the queue has no due job left, when its share
shrinks (another worker asks), when it made no claim of the queue for a poll interval, and
at shutdown (`release_permits`). Any other limited queue (a rate, per-key limits) is claimed
with `claim_limited_jobs` in a short transaction that first locks the queue's row. Each row
is handed to the executor as soon as its statement returns, so an error in a later queue's
claim drops nothing: the rows already claimed are already running. Autocommit on a dedicated
connection: each claim is one atomic statement. The statements, their parameters and the
claimed rows (`ClaimedJob`, read by column name) are `flowq.db.store.Store`'s.

A queue claimed plainly keeps a cursor: the claim key (priority, run_at, id) of the last row
claimed of it. A claim starts its index scan after it (`claim_jobs_after`), so it does not
fetch again the entries earlier claims left at the head of the pending index, which an open
snapshot elsewhere keeps vacuum from removing (issue 21). A claim from the head (`claim_jobs`)
runs instead when one is due: the first of a queue, the first after each `refresh` (every
poll interval), and the first once `HEAD_SCAN_EVERY` (0.5 s) has passed since the last. It
takes what sorts before the cursor within its priority (a more urgent job is taken by the
cursor claim itself): a run_at in the past, a late commit, a row another transaction held
locked when the cursor passed it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Final

from flowq.db.rows import Claim, ClaimedJob, ClaimKey
from flowq.db.store import QueueControl, Store
from flowq.storable import describe, first_line
from flowq.worker.connection import DB_ERRORS, DedicatedConnection
from flowq.worker.logs import ERROR, INFO, WARNING, log_event

__all__ = ["HEAD_SCAN_EVERY", "Claimer"]

# How often a worker's claims of a queue start from the head of its pending index, not after
# its cursor: so at most this long (while the worker claims; a poll interval when it is idle
# and gets no notification) a job that sorts before the cursor waits for its turn. A claim
# from the head costs a heap fetch per entry claimed while a snapshot elsewhere is open.
HEAD_SCAN_EVERY: Final = 0.5


@dataclass
class Permits:
    """What this worker last learnt of its permits of one queue (the database decides every
    claim; this only says when to lease or give back)."""

    held: int
    running: int
    share: int
    used: bool = True  # claimed from since the last refresh


class Claimer:
    """Claims up to the free slots, across `queues` in rotation, for worker `name`."""

    def __init__(self, conn: DedicatedConnection, schema: str, queues: Sequence[str],
                 name: str, submit: Callable[[ClaimedJob], None], *,
                 held: Callable[[], Collection[Claim]] | None = None,
                 head_scan_every: float = HEAD_SCAN_EVERY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.conn = conn
        self.store = Store(conn.execute, schema)
        self.queues = list(queues)
        self.name = name
        self.submit = submit
        # The claims this worker still holds (running, or outcomes not written yet): only a
        # hint that a claim under permits would find none free, so it is not sent.
        self.held = held
        self.claimed = 0
        self._rotation = 0
        # How the queues flowq.queues controls are claimed, as last read from it: paused
        # ones are skipped, "permits" ones claimed under permits, "limited" ones under the
        # queue row's lock.
        self.controls: dict[str, QueueControl] = {}
        self.permits: dict[str, Permits] = {}
        # Per queue claimed under permits, the ids of every job we claimed of it and have
        # not seen end (a claim under permits counts our running jobs among them): pruned
        # only by what the database says, never by what the executor thinks it holds (an
        # outcome the completer dropped leaves its row running). Seeded from the database
        # when a queue is first claimed this way.
        self.mine: dict[str, set[int]] = {}
        self.leases = 0  # lease transactions made (tests and the bench read it)
        # Set by a claim when a limit held due jobs back: capacity frees up as other
        # workers' jobs end, which no notification announces, so the worker looks again soon.
        self.held_back = False
        # Per queue claimed plainly: the key of the last row claimed (the cursor) and when
        # its last claim from the head ran (the `clock`'s time).
        self.cursors: dict[str, ClaimKey] = {}
        self.head_scans: dict[str, float] = {}
        self.head_scan_every = head_scan_every
        self.clock = clock

    @property
    def controlled(self) -> dict[str, bool]:
        """Which of our queues are paused (True) or limited (False), as last read."""
        return {name: c == "paused" for name, c in self.controls.items()}

    def refresh(self) -> None:
        """Re-read which of our queues are paused or limited (every poll interval); give
        back the permits of queues not claimed from since the last refresh (this worker's
        handlers were busy elsewhere: its unused permits would hold the others back)."""
        self.controls = self.store.controls(self.queues)
        self.head_scans.clear()  # every queue's next claim starts from the head
        for queue, p in list(self.permits.items()):
            if not p.used or self.controls.get(queue) != "permits":
                self._give_back(queue, 0)
            else:
                p.used = False

    def release_permits(self) -> None:
        """Give back every permit beyond this worker's running jobs (a clean stop, after its
        unfinished jobs were released). If the database says no, the permits come back at
        the next lease after this worker leaves the registry."""
        try:
            gone = self.store.release_worker_permits(self.name)
        except DB_ERRORS as exc:
            log_event(WARNING, "could not give back queue permits; they come back once this "
                      "worker is out of the registry", error=first_line(exc))
            return
        self.permits.clear()
        if gone:
            log_event(INFO, "gave back queue permits at shutdown", queues=gone)

    def _void(self, queue: str) -> None:
        """Our permits of `queue` no longer stand for claims (its limit changed, it became
        rate-limited or keyed, a worker of an earlier release registered, or they were
        reclaimed): give back the row, which the queue's locked claims count as running
        (else the queue stays blocked as long as we live), and read our running jobs again
        when permits come back. Holding none we knew of (a first claim: "none yet"), there
        is no row to give back, and no statement is sent."""
        self.mine.pop(queue, None)
        if self.permits.pop(queue, None) is not None:
            self.store.release_permits(queue, self.name, 0)

    def _give_back(self, queue: str, keep: int) -> None:
        held = self.store.release_permits(queue, self.name, keep)
        if held:
            self.permits[queue].held = held
        else:
            self.permits.pop(queue, None)

    def _lease(self, queue: str, want: int) -> bool:
        """Lease permits for what we run plus `want`; False when the queue is no longer
        claimed under permits (its controls are re-read) or we hold none after it (then a
        due job sets `held_back`: the others hold the limit, look again soon)."""
        self.leases += 1
        held, ok, due = self.store.read_lease(self.conn.transaction(
            self.store.lease_permits_statements(queue, want, self.name)))
        if not ok:
            self._void(queue)
            self.controls = self.store.controls(self.queues)
            return False
        if not held:  # none to claim under: nothing due, or the others hold the limit
            self.held_back = self.held_back or due
            return False
        p = self.permits.setdefault(queue, Permits(held, 0, held))
        p.held = held
        return True

    def _claim_permitted(self, queue: str, want: int) -> list[ClaimedJob]:
        """Claim under our permits of `queue`, leasing first when none is spare, and once
        more when the claim found due jobs beyond them and our share allows more."""
        jobs: list[ClaimedJob] = []
        p = self.permits.get(queue)
        if p is not None:
            p.used = True  # we want its jobs: what we hold is not idle (see `refresh`)
        # Claim first while we hold any: what our jobs that ended freed is counted there.
        # Holding none, lease first if we asked before (jobs were due); never having asked
        # (or given all back), claim first: it takes none, and says without the queue's
        # lock whether any job is due (an idle queue polled often is never locked).
        if p is not None and p.held == 0 and not self._lease(queue, want):
            return jobs
        try:
            return self._claim_under(queue, want, jobs)
        except DB_ERRORS:
            # The claim may have committed with its result lost: what we run is read again.
            self.mine.pop(queue, None)
            raise

    def _claim_under(self, queue: str, want: int, jobs: list[ClaimedJob]) -> list[ClaimedJob]:
        p = self.permits.get(queue)
        mine = self.mine.get(queue)
        if mine is None:
            mine = self.mine[queue] = self.store.running_ids(queue, self.name)
        elif p is not None and len(mine) >= min(p.held, p.share) and self._all_held(mine):
            # Every permit is in use by a job we still hold: a claim would take none (woken
            # by a freed slot before its outcome is written). Look again soon.
            self.held_back = True
            return jobs
        for again in (True, False):  # at most one lease after a claim: bounded
            got = self.store.claim_permitted(queue, want - len(jobs), self.name, mine)
            mine = self.mine[queue] = {*got.mine, *(j.id for j in got.jobs)}
            jobs += got.jobs
            p = self.permits[queue] = Permits(got.held, got.running, got.share)
            if not got.ok:  # none yet, reclaimed (we looked dead), voided (limit changed)...
                self._void(queue)
                if not (again and got.more and self._lease(queue, want - len(jobs))):
                    return jobs
                continue
            if got.more:
                self.held_back = True
                if (again and len(jobs) < want and got.running >= got.held
                        and got.held < got.share and self._lease(queue, want - len(jobs))):
                    continue
            elif got.held > got.running or not got.held:  # no due job left: keep what
                self._give_back(queue, 0)  # runs (a request for none goes: the share grows)
            if got.held > got.share and got.held > got.running:  # another worker asks
                self._give_back(queue, got.share)
            return jobs
        return jobs

    def _all_held(self, ids: set[int]) -> bool:
        if self.held is None:
            return False
        return ids <= {job_id for job_id, _ in self.held()}

    def _claim_plain(self, queue: str, want: int) -> list[ClaimedJob]:
        """Claim from the head when one is due, else after the queue's cursor (see the
        module's docstring), and move the cursor to where the claim stopped."""
        self.mine.pop(queue, None)  # not counted under permits: read again when they return
        cursor, last, now = self.cursors.get(queue), self.head_scans.get(queue), self.clock()
        if cursor is not None and last is not None and now - last < self.head_scan_every:
            jobs = self.store.claim(queue, want, self.name, cursor)
            self._advance(queue, jobs)
            return jobs
        self.head_scans[queue] = now
        jobs = self.store.claim(queue, want, self.name)
        # A full claim from the head may have left due rows between its last and the
        # cursor: the cursor goes back to its last, so the next claims take them in order.
        self._advance(queue, jobs, back=len(jobs) == want)
        return jobs

    def _advance(self, queue: str, jobs: Sequence[ClaimedJob], *, back: bool = False) -> None:
        keys = [k for k in (j.order for j in jobs) if k is not None]
        cursor = self.cursors.get(queue)
        if keys and (back or cursor is None):
            self.cursors[queue] = max(keys)
        elif keys and cursor is not None:
            self.cursors[queue] = max(cursor, *keys)

    def _claim(self, queue: str, want: int, limited_want: int) -> list[ClaimedJob]:
        control = self.controls.get(queue)
        if control == "paused":
            return []
        if control is None:
            return self._claim_plain(queue, want)
        want = min(want, limited_want)
        if want <= 0:
            return []
        if control == "permits":
            return self._claim_permitted(queue, want)
        # Limited: take the queue's lock, then claim in a snapshot taken after it, so what
        # the other workers' claims started is counted. The `more` column says whether the
        # limits held due jobs back; a row of NULLs stands for "none claimed".
        self.mine.pop(queue, None)  # claims of this path are not tracked: seed them again
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
