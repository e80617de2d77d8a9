"""The raw-SQL references: hand-written psycopg loops on the same `flowq.jobs` table.

They are what an expert writes without a library, and what flowq is measured against. A
completion moves its rows to `flowq.job_history` itself (`_retire`: DELETE … RETURNING and
INSERT in one statement, as flowq's success does since revision 0018):
- `one_per_tx`: BEGIN; SELECT … LIMIT 1 FOR UPDATE SKIP LOCKED; move it as 'succeeded';
  COMMIT (optionally inserting one ledger row in the same transaction);
- `batched`: claim 100 with flowq's own CTE `UPDATE … RETURNING`, then complete them with one
  move `WHERE id = ANY(…)`; `pipeline` also inserts the next steps, as flowq's completer does;
- `steady`: `batched` in autocommit (one round trip a statement) that runs until stopped,
  looking again 1 ms after a claim that found nothing: the loop a fixed-rate producer feeds
  (the `overload` scenario's reference);
- `ten_tx`: a job claimed in one transaction (`running`), then ten ledger rows in ten
  transactions of their own, then completed in one more: what the `checkpoint` scenario's
  ten checkpoints do, written by hand without a fence or a record;
- `listener`: LISTEN, and on each notification claim and stamp the handler-start time
  when the claim returns, before its COMMIT; `listener_durable` stamps it after the COMMIT
  (flowq's handler starts once its claim is durable: the commit's flush is in its pickup);
- `dag`: batched-100 on diamond runs (start -> left, right -> join): one statement per batch
  completes it, inserts `left` and `right` after each `start`, and counts `left`/`right`
  towards the run's row in `flowq.joins` (`INSERT … ON CONFLICT DO UPDATE SET remaining =
  remaining - k … RETURNING`, their results merged into `inputs`), inserting `join` with
  those inputs when the counter reaches 0;
- `map`: batched-100 on one map run: completing `split` inserts its N item rows in bulk
  (`unnest(jsonb[]) WITH ORDINALITY`, the items built in Python) and a counter of N;
  each batch of items is completed with the counter decremented in the same statement, and
  the one that brings it to 0 inserts `gather`, which reads the N results in item order;
- `minimal`: batched-100 as an expert writes it from scratch, on a minimal table of its own
  (`MINIMAL_DDL`: id, status, payload, created_at, locked_at, and finished_at for the
  bench's measurement, with one partial index on pending ids): claim 100 with
  `UPDATE … WHERE id IN (SELECT … ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED) RETURNING
  id, payload`, complete them with one `UPDATE … WHERE id = ANY(…)`. What flowq's table
  and its statements cost beside the least a queue needs (`drains.minimal_drains`). Its
  variants (`MINIMAL_VARIANTS`), so that the reference is the fastest honest loop and never
  flatters flowq: `minimal` (each statement in an explicit transaction: BEGIN, statement,
  COMMIT), `minimal_autocommit` (each statement atomic on its own: one round trip each) and
  `minimal_chained` (autocommit, and one statement per batch that completes the previous
  batch and claims the next: a data-modifying CTE) and `minimal_chained_tx` (that statement
  in an explicit transaction). `drains.fastest_minimal` measures them all and the scenario
  keeps the fastest (see the measurement beside `MINIMAL_VARIANTS`).

`run_loops` runs P of them in processes (multiprocessing, spawn), released together once all
are connected, so process start-up is not timed. Each loop sets `finished_at = now()` like flowq,
so the same database-clock measurement serves both.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import psycopg

from flowq.db.schema import JOB_COLUMNS

__all__ = ["LOOPS", "MINIMAL", "MINIMAL_DDL", "MINIMAL_REFERENCE", "MINIMAL_TABLE",
           "MINIMAL_VARIANTS", "run_loops"]

BATCH: Final = 100
QUEUE: Final = "bench"

# -- the end of a row: moved to job_history by the statement itself ---------------------------

# A finished row lives in flowq.job_history (revision 0018). Every raw completion moves its
# rows itself, a DELETE and an INSERT of the same rows in one statement, as flowq's success
# does (`fragments.succeed`): an UPDATE to 'succeeded' would be moved too, by the trigger
# `jobs_retire`, but row by row and with a dead tuple more, a slower loop than an expert
# writes for this layout.
_UNLOCKED: Final = {"locked_by": "NULL", "locked_at": "NULL", "heartbeat_at": "NULL"}


def _retire(where: str, ends: dict[str, str], returning: str = "id") -> str:
    """Two CTEs, `gone` (the rows of flowq.jobs matching `where`, deleted) and `done` (the
    same rows written to flowq.job_history with the columns of `ends`, name -> SQL over `g`,
    RETURNING `returning`): every column listed by name (`JOB_COLUMNS`)."""
    items = ", ".join(ends.get(name, f"g.{name}") for name in JOB_COLUMNS.split(", "))
    return f"""gone AS (
        DELETE FROM flowq.jobs WHERE {where} RETURNING *
    ), done AS (
        INSERT INTO flowq.job_history ({JOB_COLUMNS}) SELECT {items} FROM gone g
        RETURNING {returning})"""


_PICK_ONE = """SELECT id FROM flowq.jobs
    WHERE status = 'pending' AND queue = %s AND run_at <= now()
    ORDER BY priority, run_at, id LIMIT 1 FOR UPDATE SKIP LOCKED"""
_DONE_ONE = "WITH " + _retire("id = %s", {
    "status": "'succeeded'", "attempts": "g.attempts + 1", "finished_at": "now()"},
) + " SELECT count(*) FROM done"
# ten_tx's: its claim counted the attempt.
_DONE_CLAIMED = "WITH " + _retire("id = %s", {
    "status": "'succeeded'", "finished_at": "now()"}) + " SELECT count(*) FROM done"
_LEDGER = "INSERT INTO bench_ledger (job_id) VALUES (%s)"
_CLAIM = """WITH picked AS (
        SELECT id FROM flowq.jobs
        WHERE status = 'pending' AND queue = %s AND run_at <= now()
        ORDER BY priority, run_at, id LIMIT %s FOR UPDATE SKIP LOCKED)
    UPDATE flowq.jobs j SET status = 'running', attempts = j.attempts + 1, locked_by = %s,
        locked_at = now(), heartbeat_at = now()
    FROM picked WHERE j.id = picked.id
    RETURNING j.id, j.run_id, j.task, j.step_index, j.args::text"""
# started_at: the claim's time, as flowq keeps it, so a pickup reads the same from both.
_DONE_MANY = "WITH " + _retire("id = ANY(%s) AND status = 'running'", {
    "status": "'succeeded'", "finished_at": "now()", "started_at": "g.locked_at",
    **_UNLOCKED}) + " SELECT count(*) FROM done"
_NEXT_STEPS = """INSERT INTO flowq.jobs (run_id, task, step, step_index, queue, args)
    SELECT r, t, s, i, %s, '{}'::jsonb
    FROM unnest(%s::bigint[], %s::text[], %s::text[], %s::smallint[]) AS u(r, t, s, i)"""
_STAMP = "INSERT INTO bench_stamps (run_id, started) SELECT * FROM unnest(%s::bigint[], %s::float8[])"
_ANY_RUNNING = "SELECT 1 FROM flowq.jobs WHERE status IN ('running', 'pending') LIMIT 1"
_PIPELINE_STEPS: Final = ("first", "second", "third")

# -- dag and map: what flowq's completer does for a join and a map, written by hand ---------

# One statement per batch, like flowq's: complete, fork after `start`, count `left`/`right`
# towards the join (grouped per run, since a batch may hold both parents of one run, and in
# run_id order so that two loops lock counter rows in the same order), create `join` at 0.
_DAG_COMPLETE = "WITH " + _retire("id = ANY(%(ids)s) AND status = 'running'", {
    "status": "'succeeded'", "result": "'null'::jsonb", "finished_at": "now()", **_UNLOCKED},
    "run_id, step, result") + """, forked AS (
        INSERT INTO flowq.jobs (run_id, task, step, step_index, queue, args)
        SELECT d.run_id, 'dag', c.step, c.idx, %(queue)s, '{}'::jsonb
          FROM done d CROSS JOIN (VALUES ('left', 1), ('right', 2)) AS c(step, idx)
         WHERE d.step = 'start'
    ), counted AS (
        INSERT INTO flowq.joins AS k (run_id, step, parents, remaining, inputs)
        SELECT run_id, 'join', 2, 2 - count(*), jsonb_object_agg(step, result)
          FROM done WHERE step IN ('left', 'right')
         GROUP BY run_id ORDER BY run_id
        ON CONFLICT (run_id, step) DO UPDATE
           SET remaining = k.remaining - (excluded.parents - excluded.remaining),
               inputs = k.inputs || excluded.inputs
        RETURNING run_id, remaining, inputs
    )
    INSERT INTO flowq.jobs (run_id, task, step, step_index, queue, args, joined)
    SELECT run_id, 'dag', 'join', 3, %(queue)s, inputs, true FROM counted WHERE remaining = 0"""

# clock_timestamp() here and in _MAP_GATHERED, not now() (the transaction's start): flowq
# stamps these rows with the start of the statement that writes them, after the items were
# built (split) or the results read (gather); so do these, in the same place.
_MAP_SPLIT = "WITH " + _retire("id = %(id)s AND status = 'running'", {
    "status": "'succeeded'", "result": "CAST(%(result)s AS jsonb)",
    "finished_at": "clock_timestamp()", **_UNLOCKED}) + " SELECT count(*) FROM done"
_MAP_ITEMS = """INSERT INTO flowq.jobs (run_id, task, step, step_index, queue, args, map_index)
    SELECT %s, 'fan', 'work', 1, %s, a.value, a.n - 1
      FROM unnest(%s::jsonb[]) WITH ORDINALITY AS a(value, n)"""
_MAP_COUNTER = """INSERT INTO flowq.joins (run_id, step, parents, remaining)
    VALUES (%s, 'gather', 1, %s)"""
_MAP_GATHER = """INSERT INTO flowq.jobs (run_id, task, step, step_index, queue, joined)
    VALUES (%s, 'fan', 'gather', 2, %s, true)"""
# Items of one batch: completed, counted (one counter row per run), `gather` created at 0.
_MAP_COMPLETE = "WITH " + _retire("id = ANY(%(ids)s) AND status = 'running'", {
    "status": "'succeeded'", "result": "'null'::jsonb", "finished_at": "now()", **_UNLOCKED},
    "run_id") + """, counted AS (
        UPDATE flowq.joins k SET remaining = k.remaining - d.n
          FROM (SELECT run_id, count(*) AS n FROM done GROUP BY run_id) d
         WHERE k.run_id = d.run_id AND k.step = 'gather'
        RETURNING k.run_id, k.remaining
    )
    INSERT INTO flowq.jobs (run_id, task, step, step_index, queue, joined)
    SELECT run_id, 'fan', 'gather', 2, %(queue)s, true FROM counted WHERE remaining = 0"""
# The items have all ended when `gather` runs: their rows are in job_history (revision 0018).
_MAP_RESULTS = """SELECT result FROM flowq.job_history
    WHERE run_id = %s AND step = 'work' AND map_index IS NOT NULL ORDER BY map_index"""
_MAP_GATHERED = _MAP_SPLIT

# -- minimal: the least a queue table needs -------------------------------------------------

MINIMAL: Final = "minimal"
MINIMAL_TABLE: Final = "bench_minimal"
# finished_at is not part of the minimal design: the bench's clock needs it (the drain ends
# at max(finished_at), set by now() in the completing UPDATE as on every other side).
MINIMAL_DDL: Final = (
    f"""CREATE TABLE {MINIMAL_TABLE} (id bigserial PRIMARY KEY,
        status text NOT NULL DEFAULT 'pending', payload jsonb NOT NULL DEFAULT '{{}}',
        created_at timestamptz NOT NULL DEFAULT now(), locked_at timestamptz,
        finished_at timestamptz)""",
    f"CREATE INDEX {MINIMAL_TABLE}_pending ON {MINIMAL_TABLE} (id) WHERE status = 'pending'",
)
_MINIMAL_CLAIM = f"""UPDATE {MINIMAL_TABLE} SET status = 'running', locked_at = now()
    WHERE id IN (SELECT id FROM {MINIMAL_TABLE} WHERE status = 'pending'
                 ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED)
    RETURNING id, payload"""
_MINIMAL_DONE = f"""UPDATE {MINIMAL_TABLE} SET status = 'succeeded', finished_at = now()
    WHERE id = ANY(%s)"""
# The previous batch completed and the next claimed in one statement: the claim's snapshot
# is the statement's, in which the completed rows are `running`, so the two never overlap.
_MINIMAL_CHAINED = f"""WITH done AS (
        UPDATE {MINIMAL_TABLE} SET status = 'succeeded', finished_at = now()
        WHERE id = ANY(%s))
    UPDATE {MINIMAL_TABLE} SET status = 'running', locked_at = now()
    WHERE id IN (SELECT id FROM {MINIMAL_TABLE} WHERE status = 'pending'
                 ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED)
    RETURNING id, payload"""
# The variants of the minimal batched-100 drain: each statement in an explicit transaction
# (psycopg sends BEGIN and COMMIT as round trips of their own) or autocommit (one round trip a
# statement), and the claim and the previous batch's completion in two statements or in one.
# Measured on the 2-core bench machine, 2026-12-02 (`drains.minimal_drains` of each variant in
# turn: the embedded server with durable defaults, a fresh database, P=2, 50,000 rows a
# drain, 8 rounds over two runs, the order of the variants reversed every other round; jobs/s,
# median and best of the 8; noisy: other sessions shared the machine):
#   minimal             6 round trips a batch   median 21,700  best 42,700
#   minimal_autocommit  2                       median 27,200  best 45,300
#   minimal_chained_tx  3                       median 26,700  best 45,900
#   minimal_chained     1                       median 34,400  best 60,400
# One statement, autocommit, was the fastest in median and in best: `MINIMAL_REFERENCE`, the
# default reference. The drain scenario still measures all four on its own server
# (`drains.fastest_minimal`) and keeps whichever is fastest there.
MINIMAL_VARIANTS: Final = ("minimal", "minimal_autocommit", "minimal_chained",
                           "minimal_chained_tx")
MINIMAL_REFERENCE: Final = "minimal_chained"

_Row = tuple[Any, ...]


def _one_per_tx(conn: psycopg.Connection[Any], ledger: bool) -> int:
    done = 0
    while True:
        with conn.transaction():
            row = conn.execute(_PICK_ONE, (QUEUE,)).fetchone()
            if row is None:
                return done
            if ledger:
                conn.execute(_LEDGER, row)
            conn.execute(_DONE_ONE, row)
        done += 1


_TAKE_ONE = """UPDATE flowq.jobs SET status = 'running', attempts = attempts + 1,
    locked_at = now() WHERE id = (""" + _PICK_ONE + """) RETURNING id"""


def _ten_tx(conn: psycopg.Connection[Any], rows: int = 10) -> int:
    done = 0
    while True:
        with conn.transaction():
            row = conn.execute(_TAKE_ONE, (QUEUE,)).fetchone()
        if row is None:
            return done
        for _ in range(rows):
            with conn.transaction():
                conn.execute(_LEDGER, row)
        with conn.transaction():
            conn.execute(_DONE_CLAIMED, row)
        done += 1


def _batched(conn: psycopg.Connection[Any], pipeline: bool) -> int:
    done = 0
    while True:
        with conn.transaction():
            rows = conn.execute(_CLAIM, (QUEUE, BATCH, "raw")).fetchall()
        if not rows:
            # A pipeline's next steps appear as other loops complete theirs: stop only once
            # nothing is running anywhere.
            if pipeline and conn.execute(_ANY_RUNNING).fetchone():
                conn.commit()
                time.sleep(0.001)
                continue
            return done
        with conn.transaction():
            conn.execute(_DONE_MANY, ([r[0] for r in rows],))
            nxt = [r for r in rows if pipeline and r[3] < len(_PIPELINE_STEPS) - 1]
            if nxt:
                conn.execute(_NEXT_STEPS, (
                    QUEUE, [r[1] for r in nxt], [r[2] for r in nxt],
                    [_PIPELINE_STEPS[r[3] + 1] for r in nxt], [r[3] + 1 for r in nxt]))
        done += len(rows)


def _steady(conn: psycopg.Connection[Any], stop: Any) -> int:
    """Claim 100 and complete them, each statement on its own, until `stop` is set; when
    nothing is due, look again 1 ms later. Every execution is planned, as on flowq's claim
    and completion connections: a generic plan made while the table was analyzed empty
    reads whole partial indexes, dead entries included, so under a steady producer each
    statement grew slower with every job done (100 completions: 5 to 15 ms in 15 s)."""
    conn.autocommit = True
    conn.prepare_threshold = None
    done = 0
    while not stop.is_set():
        rows = conn.execute(_CLAIM, (QUEUE, BATCH, "raw")).fetchall()
        if not rows:
            time.sleep(0.001)
            continue
        conn.execute(_DONE_MANY, ([r[0] for r in rows],))
        done += len(rows)
    return done


def _minimal(conn: psycopg.Connection[Any], autocommit: bool = False) -> int:
    """Claim 100, complete them, until none is left: in a transaction each (as `_batched`),
    or with `autocommit` each statement on its own."""
    conn.autocommit = autocommit
    block = contextlib.nullcontext if autocommit else conn.transaction
    done = 0
    while True:
        with block():
            rows = conn.execute(_MINIMAL_CLAIM, (BATCH,)).fetchall()
        if not rows:
            return done
        with block():
            conn.execute(_MINIMAL_DONE, ([r[0] for r in rows],))
        done += len(rows)


def _minimal_chained(conn: psycopg.Connection[Any], autocommit: bool = True) -> int:
    """One statement per batch: complete the previous, claim the next; atomic on its own
    (`autocommit`) or in an explicit transaction (BEGIN, statement, COMMIT)."""
    conn.autocommit = autocommit
    block = contextlib.nullcontext if autocommit else conn.transaction
    done = 0
    previous: list[int] = []
    while True:
        with block():
            rows = conn.execute(_MINIMAL_CHAINED, (previous, BATCH)).fetchall()
        done += len(previous)
        if not rows:
            return done
        previous = [r[0] for r in rows]


def _listener(conn: psycopg.Connection[Any], stop: Any, durable: bool = False) -> int:
    """Claim on every notification (or 1 s poll); stamp each job's start, then complete.
    The start is stamped as soon as the claim returns, inside its transaction, or with
    `durable` once the claim has committed (where flowq's handler starts: after its claim
    is on disk, so that a crash cannot hand the same lease out again)."""
    listen = psycopg.connect(conn.info.dsn, autocommit=True)
    listen.execute('LISTEN "flowq"')
    done = 0
    try:
        while not stop.is_set():
            while True:
                with conn.transaction():
                    rows = conn.execute(_CLAIM, (QUEUE, BATCH, "raw")).fetchall()
                    started = time.time()
                if durable:
                    started = time.time()
                if not rows:
                    break
                with conn.transaction():
                    conn.execute(_STAMP, ([r[1] for r in rows], [started] * len(rows)))
                    conn.execute(_DONE_MANY, ([r[0] for r in rows],))
                done += len(rows)
            for _ in listen.notifies(timeout=1.0, stop_after=1):
                pass
    finally:
        listen.close()
    return done


def _flow(conn: psycopg.Connection[Any],
          complete: Callable[[psycopg.Connection[Any], Sequence[_Row]], None]) -> int:
    """Claim batches with flowq's CTE and `complete` each in a transaction of its own, until
    nothing is pending or running anywhere (other loops' completions create steps)."""
    done = 0
    while True:
        with conn.transaction():
            rows = conn.execute(_CLAIM, (QUEUE, BATCH, "raw")).fetchall()
        if not rows:
            if conn.execute(_ANY_RUNNING).fetchone():
                conn.commit()
                time.sleep(0.001)
                continue
            return done
        with conn.transaction():
            complete(conn, rows)
        done += len(rows)


def _dag_complete(conn: psycopg.Connection[Any], rows: Sequence[_Row]) -> None:
    conn.execute(_DAG_COMPLETE, {"ids": [r[0] for r in rows], "queue": QUEUE})


def _map_complete(conn: psycopg.Connection[Any], rows: Sequence[_Row]) -> None:
    """A batch of the map run: `split` (step_index 0) fans out, `work` (1) counts down,
    `gather` (2) reads the results in item order."""
    for job_id, run_id, _, index, args in rows:
        if index == 0:
            n = int(json.loads(args).get("n", 0))
            texts = [json.dumps({"i": i}) for i in range(n)]
            conn.execute(_MAP_SPLIT, {"result": "[" + ", ".join(texts) + "]", "id": job_id})
            if n:
                conn.execute(_MAP_ITEMS, (run_id, QUEUE, texts))
                conn.execute(_MAP_COUNTER, (run_id, n))
            else:
                conn.execute(_MAP_GATHER, (run_id, QUEUE))
        elif index == 2:
            results = [r[0] for r in conn.execute(_MAP_RESULTS, (run_id,))]
            conn.execute(_MAP_GATHERED, {"result": json.dumps(len(results)), "id": job_id})
    items = [r[0] for r in rows if r[3] == 1]
    if items:
        conn.execute(_MAP_COMPLETE, {"ids": items, "queue": QUEUE})


LOOPS: Final[dict[str, Callable[[psycopg.Connection[Any], Any], int]]] = {
    "one_per_tx": lambda conn, stop: _one_per_tx(conn, ledger=False),
    "one_per_tx_ledger": lambda conn, stop: _one_per_tx(conn, ledger=True),
    "batched": lambda conn, stop: _batched(conn, pipeline=False),
    "pipeline": lambda conn, stop: _batched(conn, pipeline=True),
    "ten_tx": lambda conn, stop: _ten_tx(conn),
    "steady": _steady,
    "listener": _listener,
    "listener_durable": lambda conn, stop: _listener(conn, stop, durable=True),
    "dag": lambda conn, stop: _flow(conn, _dag_complete),
    "map": lambda conn, stop: _flow(conn, _map_complete),
    MINIMAL: lambda conn, stop: _minimal(conn),
    "minimal_autocommit": lambda conn, stop: _minimal(conn, autocommit=True),
    "minimal_chained": lambda conn, stop: _minimal_chained(conn),
    "minimal_chained_tx": lambda conn, stop: _minimal_chained(conn, autocommit=False),
}


def _child(kind: str, dsn: str, ready: Any, go: Any, stop: Any, results: Any) -> None:
    with psycopg.connect(dsn, application_name=f"flowq-bench raw {kind}") as conn:
        conn.execute("SELECT 1")
        conn.commit()
        ready.release()
        go.wait()
        results.put(LOOPS[kind](conn, stop))


class RawLoops:
    """P processes of one loop kind, started and connected; `go()` releases them."""

    def __init__(self, kind: str, dsn: str, processes: int) -> None:
        ctx = mp.get_context("spawn")
        self._ready = ctx.Semaphore(0)
        self._go = ctx.Event()
        self.stop = ctx.Event()
        self._results: Any = ctx.Queue()
        self.procs = [ctx.Process(target=_child, args=(kind, dsn, self._ready, self._go,
                                                      self.stop, self._results), daemon=True)
                      for _ in range(processes)]

    def __enter__(self) -> RawLoops:
        for p in self.procs:
            p.start()
        for _ in self.procs:
            if not self._ready.acquire(timeout=60):
                raise TimeoutError("raw loop processes did not connect")
        return self

    def go(self) -> None:
        self._go.set()

    def join(self, timeout: float = 3600.0,
             finished: Callable[[], None] | None = None) -> int:
        """Wait for every loop to finish; the jobs they completed between them. `finished`
        is called once all have reported, before they are reaped (their CPU is readable)."""
        total = sum(int(self._results.get(timeout=timeout)) for _ in self.procs)
        if finished is not None:
            finished()
        for p in self.procs:
            p.join(timeout=10)
        return total

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._go.set()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def run_loops(kind: str, dsn: str, processes: int) -> RawLoops:
    """`with run_loops(...) as loops: t0 = …; loops.go(); loops.join()`."""
    return RawLoops(kind, dsn, processes)
