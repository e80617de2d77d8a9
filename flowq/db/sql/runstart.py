"""A run started: its idempotency key claimed, and its first rows inserted.

`claim_key` claims :idempotency_key in `flowq.run_keys` for a new run (two enqueues of one key
meet at its primary key), `FIND_RUN_BY_KEY` reads the run holding a key, and `start_run`
inserts the root rows of a run that starts with several steps. The enqueue statements of
`flowq.db.sql.jobs` and `flowq.db.sql.uniques` are built from them.
"""

from __future__ import annotations

from typing import Final

from flowq.db.sql.fragments import DEADLINE, DUE, TRACE, S, notify_new

__all__ = ["FIND_RUN_BY_KEY", "KEY_CLAIMED", "claim_key", "keyed_run", "start_run"]


# The run holding :idempotency_key, as (id: its first row, run_id, created = false): the key's
# entry in `flowq.run_keys` (revision 0018), else a live row holding it in `jobs` (a run an
# earlier release enqueued; its key is recorded when its row moves to history).
FIND_RUN_BY_KEY: Final = f"""
            SELECT f.id, k.run_id, false AS created
              FROM {S}.run_keys k
             CROSS JOIN LATERAL (SELECT min(s.id) AS id FROM {S}.steps s
                                  WHERE s.run_id = k.run_id) f
             WHERE k.key = CAST(:idempotency_key AS text) AND f.id IS NOT NULL
            UNION ALL
            SELECT j.id, j.run_id, false AS created FROM {S}.jobs j
             WHERE j.idempotency_key = CAST(:idempotency_key AS text)
               AND NOT EXISTS (SELECT 1 FROM {S}.run_keys k
                                WHERE k.key = CAST(:idempotency_key AS text))"""


def claim_key(source: str, where: str, run_id: str) -> str:
    """A CTE `keyed` claiming :idempotency_key (when not NULL) for the new run `run_id` (an
    SQL expression over `source`, a FROM item; only where `where`): the run's entry in
    `flowq.run_keys`, whose primary key is where two enqueues of one key meet. An enqueue
    that finds the key taken (DO NOTHING; PostgreSQL waits for the other transaction, and
    inserts if that rolls back) inserts no row (`KEY_CLAIMED`), and its caller reads the
    run holding the key. The run's rows take its run id from `keyed_run`."""
    return f"""keyed AS (
                INSERT INTO {S}.run_keys (key, run_id)
                SELECT CAST(:idempotency_key AS text), {run_id} FROM {source}
                 WHERE CAST(:idempotency_key AS text) IS NOT NULL AND {where}
                ON CONFLICT (key) DO NOTHING
                RETURNING run_id)"""


# Whether the new run may be inserted: no key, or `claim_key` claimed it.
KEY_CLAIMED: Final = ("(CAST(:idempotency_key AS text) IS NULL "
                      "OR EXISTS (SELECT 1 FROM keyed))")


def keyed_run(run_id: str) -> str:
    """The new run's id: the one `claim_key` recorded with the key, else `run_id`
    (evaluated only then: COALESCE stops at its first value)."""
    return f"COALESCE((SELECT run_id FROM keyed), {run_id})"


def start_run(head: str, source: str, where: str, run_id: str, tail: str) -> str:
    """A run that starts with several rows (one per root step: :steps, :step_indexes,
    :queues, :max_attempts, :delays, :signals, :waits), all sharing one run_id: after the
    CTEs `head`, the first root is inserted from `source` where `where` (holding
    :idempotency_key; `run_id`: its run id, or None to draw one), the others only if it
    was, roots waiting for a signal are entered in `flowq.signals`, and the new run is
    returned (notified) followed by `tail` (the rows of an existing run)."""
    roots = ("unnest(CAST(:steps AS text[]), CAST(:step_indexes AS smallint[]), "
             "CAST(:queues AS text[]), CAST(:max_attempts AS int[]), "
             "CAST(:delays AS float8[]), CAST(:signals AS text[]), CAST(:waits AS float8[])) "
             "WITH ORDINALITY AS r(step, step_index, queue, max_attempts, delay, signal, "
             "wait, n)")
    columns = """run_id, task, step, step_index, queue, priority, max_attempts, args,
                 status, run_at, trace_context, deadline, fingerprint"""

    def values(run: str) -> str:
        return f"""{run}, CAST(:task AS text), r.step, r.step_index, r.queue,
                 CAST(:priority AS smallint), r.max_attempts, CAST(:args AS jsonb),
                 CASE WHEN r.signal IS NULL THEN 'pending' ELSE 'waiting' END,
                 CASE WHEN r.signal IS NULL
                      THEN {DUE} + make_interval(secs => r.delay)
                      ELSE now() + make_interval(secs => r.wait) END, {TRACE}, {DEADLINE},
                 CAST(:fingerprint AS text)"""

    return f"""{head},
        {claim_key(source, f"r.n = 1 AND {where}", run_id)},
        first AS (
            INSERT INTO {S}.jobs ({columns}, idempotency_key)
            SELECT {values(keyed_run(run_id))}, CAST(:idempotency_key AS text)
              FROM {source}
             WHERE r.n = 1 AND {where} AND {KEY_CLAIMED}
            ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
            RETURNING id, run_id, step, queue, status, run_at
        ), rest AS (
            INSERT INTO {S}.jobs ({columns})
            SELECT {values("f.run_id")}
              FROM first f CROSS JOIN {roots}
             WHERE r.n > 1
            RETURNING id, run_id, step, queue, status, run_at
        ), met AS (
            INSERT INTO {S}.signals (run_id, name, step, timeout_s, reached_at)
            SELECT a.run_id, r.signal, r.step, r.wait, now()
              FROM (SELECT run_id, step FROM first UNION ALL SELECT run_id, step FROM rest) a
              JOIN {roots} ON r.step = a.step
             WHERE r.signal IS NOT NULL
        )
        SELECT f.id, f.run_id, true AS created,
               {notify_new("(SELECT queue, status, run_at FROM first UNION ALL "
                            "SELECT queue, status, run_at FROM rest) a "
                            "WHERE status = 'pending'")}
          FROM first f
        {tail}""".replace("{roots}", roots)
