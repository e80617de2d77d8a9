"""Every SQL statement the worker and the run tools send, named verb_noun, in one place.

The worker never writes SQL itself: it calls `Queries(schema).claim_jobs` and friends. Each
statement is compiled once per schema (the schema name is a validated identifier, so it is
safe to format in). Every write after the claim is fenced: it only touches a row that is
still `running` under the lease the worker claimed it with. A lease comes from a sequence on
every claim and is never reused, so a worker presumed dead that comes back can change
nothing, however often the job was claimed, released or retried since. All times are the
database's `now()`.

A statement that exists for a batch and for one row (`complete_jobs`/`complete_job`, ...)
is written once (`_rows` gives it either shape).
"""

from __future__ import annotations

from functools import cache, cached_property

import sqlalchemy as sa
from sqlalchemy.sql.elements import TextClause

from flowq.names import validate_schema_name

__all__ = ["Queries", "queries"]

# The columns a worker needs of a claimed row, in `ClaimedJob`'s field order.
_CLAIMED = """j.id, j.lease, j.run_id, j.task, j.step, j.step_index, j.queue, j.priority,
    j.attempts, j.max_attempts, j.args::text AS args, j.cancel_requested,
    extract(epoch FROM now() - j.created_at)::float8 AS age, j.map_index, j.joined,
    j.scheduled_at,
    extract(epoch FROM now() - j.run_at)::float8 AS pickup_delay,
    j.trace_context::text AS trace_context"""

# The fence's status check, written so that no partial index can serve it (the planner cannot
# prove `status = 'running'` from `... IS TRUE`). A fenced write must find its rows through the
# primary key. Given the plain condition, a planner misled by a table analyzed empty (a queue
# that drained, then a burst) chose a scan of `jobs_running_idx`, which holds an entry for
# every job that ran since the last vacuum: each completion batch then cost O(jobs run), and
# a drain stalled (seen in `flowq bench`).
_FENCE = "j.id = c.id AND j.lease = c.lease AND (j.status = 'running') IS TRUE"

# Clears the claim on a row that goes back to pending or ends. The lease stays: it is the
# last claim's token, and the next claim draws a new one.
_UNLOCK = "locked_by = NULL, locked_at = NULL, heartbeat_at = NULL"

# The W3C trace context an enqueue stores with its rows (JSON text, NULL: not traced; see
# flowq.tracing). The steps a run creates later copy it from the row that creates them.
_TRACE = "CAST(:trace_context AS jsonb)"
# What every enqueued row takes from the call, typed (a driver that prepares statements, such
# as asyncpg, must know each parameter's type), and its due time: :run_at, else now + :delay.
_CALL = f"""CAST(:task AS text), CAST(:step AS text), CAST(:queue AS text),
                    CAST(:priority AS smallint), CAST(:max_attempts AS int),
                    CAST(:key_limit AS int), {_TRACE}"""
# The columns `_CALL` fills, in its order.
_CALL_COLUMNS = "task, step, queue, priority, max_attempts, key_limit, trace_context"
_DUE = "COALESCE(CAST(:run_at AS timestamptz), now() + CAST(:delay AS interval))"



def _wake(queue: str, run_at: str) -> str:
    """The NOTIFY payload of new jobs: the queue, and for jobs due later `queue@seconds`, the
    wait measured from the transaction's start (`now()`). A worker receives it at commit or
    later, so waking that many seconds after receipt is never early."""
    return (f"CASE WHEN {run_at} > now() THEN {queue} || '@' || "
            f"extract(epoch FROM {run_at} - now())::text ELSE {queue} END")


def _notify_new(rows: str) -> str:
    """An expression waking the workers of the new jobs in `rows` (a FROM item with `queue`
    and `run_at`, and optionally a WHERE): one notification per distinct payload."""
    return (f"(SELECT count(pg_notify(:channel, w)) FROM (SELECT DISTINCT "
            f"{_wake('queue', 'run_at')} AS w FROM {rows}) x)")


_Columns = tuple[tuple[str, str], ...]
_CLAIM_KEY: _Columns = (("id", "bigint"), ("lease", "bigint"))
# A successor names the claim it follows, (id, lease): a worker may hold two claims of one
# step (an attempt lost to the reaper, and its own re-claim), and only the claim that landed
# may create the next step, once.
_SUCCESSOR: _Columns = (("id", "bigint"), ("lease", "bigint"), ("task", "text"),
                        ("step", "text"), ("step_index", "smallint"), ("queue", "text"),
                        ("max_attempts", "int"), ("args", "jsonb"), ("map_index", "int"),
                        ("delay", "float8"))
# What a success spawns in a workflow (`flowq.worker.model.Spawn`): a successor's columns,
# the signal it waits for (and how long), and its share in a join (`parents` > 0).
_SPAWN: _Columns = (*_SUCCESSOR, ("signal", "text"), ("wait", "float8"), ("parents", "int"),
                    ("delta", "int"), ("source", "text"), ("input", "jsonb"))


def plural(name: str) -> str:
    """The bind parameter of a column in a batch statement: `id` -> `ids`."""
    if name.endswith("s"):
        return name
    return name + ("es" if name.endswith("x") else "s")


def _rows(alias: str, columns: _Columns, *, single: bool, prefix: str = "") -> str:
    """The rows a fenced statement applies to, as a FROM item `alias(columns)`.

    One definition, two shapes: a batch is `unnest` over array parameters (`:ids`,
    `:leases`, ...), a single row a one-row VALUES over scalars (`:id`, `:lease`, ...). The
    planner pulls a one-row VALUES up into constants, so the single shape is a plain lookup by
    primary key with no join to misplan (it runs on a handler's `ctx.session` connection,
    which has none of the hot path's planner settings)."""
    names = ", ".join(name for name, _ in columns)
    if single:
        values = ", ".join(f"CAST(:{prefix}{name} AS {type_})" for name, type_ in columns)
        return f"(VALUES ({values})) AS {alias}({names})"
    arrays = ", ".join(f"CAST(:{prefix}{plural(name)} AS {type_}[])" for name, type_ in columns)
    return f"unnest({arrays}) AS {alias}({names})"


def _take(picked: str) -> str:
    """The UPDATE that claims the rows of CTE `picked` (ids) for :worker, each under a new
    lease, returning what `ClaimedJob` holds."""
    return f"""UPDATE {{s}}.jobs j
               SET status = 'running', attempts = j.attempts + 1,
                   lease = nextval('{{s}}.lease_seq'), locked_by = :worker,
                   locked_at = now(), heartbeat_at = now()
              FROM {picked} WHERE j.id = {picked}.id
            RETURNING {_CLAIMED}"""


# The queues a plain claim must leave alone: paused, or limited (claimed under their lock).
_CONTROLLED = """SELECT 1 AS one, q.name, q.paused FROM {s}.queues q
    WHERE (q.paused OR q.keyed OR q.concurrency IS NOT NULL OR q.rate_limit IS NOT NULL)"""


def _succeed(single: bool) -> str:
    """Mark claims succeeded with their results (`c(id, lease, result)`, batch or single),
    fenced; every completing statement starts with it, as its `done` CTE."""
    claims = _rows("c", (*_CLAIM_KEY, ("result", "jsonb")), single=single)
    return f"""
                UPDATE {{s}}.jobs j
                   SET status = 'succeeded', result = c.result, finished_at = now(), {_UNLOCK}
                  FROM {claims}
                 WHERE {_FENCE}
                RETURNING j.id, j.lease, j.run_id, j.priority, j.cancel_requested,
                          j.trace_context"""


class Queries:
    """The statements for one flowq schema."""

    def __init__(self, schema: str) -> None:
        self.schema = validate_schema_name(schema)

    def _t(self, sql: str) -> TextClause:
        return sa.text(sql.replace("{s}", self.schema))

    def _claim(self, only: str = "") -> TextClause:
        return self._t(f"""
            WITH picked AS (
                SELECT id FROM {{s}}.jobs
                WHERE status = 'pending' AND queue = :queue AND run_at <= now(){only}
                ORDER BY priority, run_at, id
                LIMIT :limit
                FOR UPDATE SKIP LOCKED
            )
            {_take("picked")}""")

    @cached_property
    def claim_jobs(self) -> TextClause:
        """Claim up to :limit due jobs of :queue for :worker, each under a new lease. A CTE, so
        that the LIMIT binds the locking subquery and the UPDATE can never touch more rows
        than were picked; SKIP LOCKED lets concurrent workers pick disjoint rows without
        waiting on each other. Claims nothing from a queue that is paused or limited
        (`flowq.queues`): those are claimed with `claim_limited_jobs` (one primary key lookup
        tells, so a worker that has not yet seen a new limit cannot break it)."""
        return self._claim(f" AND NOT EXISTS ({_CONTROLLED} AND q.name = :queue)")

    # -- queues as configuration (flowq.queues) --------------------------------------------

    @cached_property
    def select_controlled_queues(self) -> TextClause:
        """Which of :queues are paused or limited: (name, paused). The worker re-reads it every
        poll interval: a paused queue is skipped, a limited one claimed through
        `claim_limited_jobs`."""
        return self._t(f"""
            SELECT q.name, q.paused FROM ({_CONTROLLED} AND q.name = ANY(:queues)) q""")

    @cached_property
    def lock_queue(self) -> TextClause:
        """Lock queue :queue's row for the transaction: limited claims of one queue take turns,
        each counting in a snapshot taken after the previous one committed."""
        return self._t("SELECT name FROM {s}.queues WHERE name = :queue FOR UPDATE")

    @cached_property
    def claim_limited_jobs(self) -> TextClause:
        """Claim up to :limit due jobs of :queue within its limits, after `lock_queue` in the
        same transaction (so that what is counted as running is current): none if paused;
        at most `concurrency` running; at most the rate limit's tokens (refilled at `limit`
        per period, up to `limit`), spending one per claim; and per concurrency key at most
        its `key_limit` running, keys already at their limit skipped in the scan (up to
        :scan candidates) so that other keys are not held up behind them. Returns the claimed
        rows, each with `more` last (a single row of NULLs and `more` when none was claimed):
        whether due jobs remain that the limits held back."""
        return self._t(f"""
            WITH cfg AS (
                SELECT paused, concurrency, rate_limit,
                       CASE WHEN rate_limit IS NULL THEN NULL ELSE least(
                           rate_limit::float8,
                           COALESCE(tokens, rate_limit::float8)
                           + extract(epoch FROM now() - COALESCE(refilled_at, now()))
                             * rate_limit / rate_period) END AS tokens
                  FROM {{s}}.queues WHERE name = :queue
            ), running AS (
                SELECT count(*) AS n FROM {{s}}.jobs
                 WHERE status = 'running' AND queue = :queue
            ), busy AS (
                SELECT concurrency_key AS key, count(*) AS n FROM {{s}}.jobs
                 WHERE status = 'running' AND queue = :queue AND concurrency_key IS NOT NULL
                 GROUP BY concurrency_key
            ), allowed AS (
                SELECT CASE WHEN cfg.paused THEN 0 ELSE greatest(0, least(
                           CAST(:limit AS int),
                           COALESCE(cfg.concurrency - (SELECT n FROM running), :limit),
                           COALESCE(floor(cfg.tokens)::int, :limit))) END AS n
                  FROM cfg
            ), candidates AS (
                SELECT j.id, j.priority, j.run_at, j.concurrency_key, j.key_limit
                  FROM {{s}}.jobs j
                 WHERE j.status = 'pending' AND j.queue = :queue AND j.run_at <= now()
                   AND (j.concurrency_key IS NULL OR NOT EXISTS (
                        SELECT 1 FROM busy b
                         WHERE b.key = j.concurrency_key AND b.n >= j.key_limit))
                 ORDER BY j.priority, j.run_at, j.id
                 LIMIT :scan
                 FOR UPDATE SKIP LOCKED
            ), ranked AS (
                SELECT c.*, row_number() OVER (PARTITION BY c.concurrency_key
                                               ORDER BY c.priority, c.run_at, c.id) AS k
                  FROM candidates c
            ), picked AS (
                SELECT r.id FROM ranked r LEFT JOIN busy b ON b.key = r.concurrency_key
                 WHERE r.concurrency_key IS NULL OR r.k + COALESCE(b.n, 0) <= r.key_limit
                 ORDER BY r.priority, r.run_at, r.id
                 LIMIT (SELECT n FROM allowed)
            ), claimed AS (
                {_take("picked")}
            ), spent AS (
                UPDATE {{s}}.queues
                   SET tokens = (SELECT tokens FROM cfg) - (SELECT count(*) FROM claimed),
                       refilled_at = now()
                 WHERE name = :queue AND rate_limit IS NOT NULL
            )
            -- Always one row at least: whether due jobs are left that the limits held back
            -- (the worker then tries again shortly rather than at its next poll), and the
            -- claimed jobs, if any (NULLs when none).
            SELECT c.*, EXISTS (
                       SELECT 1 FROM {{s}}.jobs w
                        WHERE w.status = 'pending' AND w.queue = :queue AND w.run_at <= now()
                          AND w.id NOT IN (SELECT id FROM claimed)) AS more
              FROM (SELECT 1) one LEFT JOIN claimed c ON true""")

    @cached_property
    def declare_queues(self) -> TextClause:
        """Write the declared limits of :names (:concurrencies, :rate_limits, :rate_periods;
        NULL: none) as :worker's, keeping each queue's paused state; a changed rate starts
        with a full bucket."""
        return self._t("""
            INSERT INTO {s}.queues (name, concurrency, rate_limit, rate_period, declared_at,
                                    declared_by)
            SELECT d.name, d.concurrency, d.rate_limit, d.rate_period, now(), :worker
              FROM unnest(CAST(:names AS text[]), CAST(:concurrencies AS int[]),
                          CAST(:rate_limits AS int[]), CAST(:rate_periods AS float8[]))
                   AS d(name, concurrency, rate_limit, rate_period)
             ORDER BY d.name
            ON CONFLICT (name) DO UPDATE
               SET concurrency = excluded.concurrency, rate_limit = excluded.rate_limit,
                   rate_period = excluded.rate_period, declared_at = excluded.declared_at,
                   declared_by = excluded.declared_by,
                   tokens = CASE WHEN (queues.rate_limit, queues.rate_period)
                                      IS NOT DISTINCT FROM
                                      (excluded.rate_limit, excluded.rate_period)
                                 THEN queues.tokens END""")

    @cached_property
    def mark_keyed_queues(self) -> TextClause:
        """Mark :names as running tasks with per-key limits (claimed through the limited path),
        without touching their limits."""
        return self._t("""
            INSERT INTO {s}.queues (name, keyed)
            SELECT n, true FROM unnest(CAST(:names AS text[])) AS n ORDER BY n
            ON CONFLICT (name) DO UPDATE SET keyed = true WHERE NOT queues.keyed""")

    @cached_property
    def set_queue_paused(self) -> TextClause:
        """Pause or resume queue :name (:paused); whether that changed anything."""
        return self._t("""
            WITH before AS (SELECT paused FROM {s}.queues WHERE name = :name FOR UPDATE),
            changed AS (
                INSERT INTO {s}.queues (name, paused) VALUES (:name, :paused)
                ON CONFLICT (name) DO UPDATE SET paused = excluded.paused)
            SELECT COALESCE((SELECT paused FROM before), false)
                   IS DISTINCT FROM CAST(:paused AS boolean)""")

    @cached_property
    def list_queues(self) -> TextClause:
        """Every queue with jobs not yet finished (or dead) or a row in `flowq.queues`: its
        jobs by state, the age of its oldest due job, its limits, whether it is paused.
        Reads the unfinished and dead rows only (through their partial indexes)."""
        return self._t("""
            WITH counts AS (
                SELECT queue AS name,
                       count(*) FILTER (WHERE status = 'pending' AND run_at <= now())
                           AS pending,
                       count(*) FILTER (WHERE status = 'pending' AND run_at > now())
                           AS scheduled,
                       count(*) FILTER (WHERE status = 'waiting') AS waiting,
                       count(*) FILTER (WHERE status = 'running') AS running,
                       count(*) FILTER (WHERE status = 'dead') AS dead,
                       extract(epoch FROM now() - min(run_at) FILTER (
                           WHERE status = 'pending' AND run_at <= now()))::float8
                           AS oldest_due_s
                  FROM {s}.jobs
                 -- ORs, not IN: each arm is served by its partial index (a BitmapOr), so
                 -- the retained finished rows are never read (an IN list is a seq scan).
                 WHERE (status = 'pending' OR status = 'waiting' OR status = 'running'
                        OR status = 'dead')
                 GROUP BY queue)
            SELECT COALESCE(c.name, q.name) AS name, COALESCE(c.pending, 0) AS pending,
                   COALESCE(c.scheduled, 0) AS scheduled, COALESCE(c.waiting, 0) AS waiting,
                   COALESCE(c.running, 0) AS running, COALESCE(c.dead, 0) AS dead,
                   c.oldest_due_s, q.concurrency, q.rate_limit,
                   q.rate_period AS rate_period_s, COALESCE(q.paused, false) AS paused
              FROM counts c FULL JOIN {s}.queues q ON q.name = c.name
             ORDER BY 1""")

    # -- enqueue (flowq.session, flowq.aio): in the caller's transaction ----------------------

    @cached_property
    def check_schema(self) -> TextClause:
        """Whether this schema's jobs table exists (NULL if not): a query that cannot fail, so
        a missing schema is reported before an INSERT would abort the caller's transaction."""
        return self._t("SELECT to_regclass('{s}.jobs')")

    @cached_property
    def insert_job(self) -> TextClause:
        """The keyless enqueue: one plain INSERT (no CTE, no conflict arbitration: it is the
        hot path of every business transaction) whose RETURNING also notifies :channel with
        the queue, delivered at commit only."""
        return self._t(f"""
            INSERT INTO {{s}}.jobs ({_CALL_COLUMNS}, args, run_at, concurrency_key)
            VALUES ({_CALL}, CAST(:args AS jsonb), {_DUE}, CAST(:concurrency_key AS text))
            RETURNING id, run_id, true AS created, pg_notify(:channel, {_wake("queue", "run_at")})""")

    @cached_property
    def find_run_by_key(self) -> TextClause:
        """The run holding :idempotency_key, as (id, run_id, created = false)."""
        return self._t("""
            SELECT id, run_id, false AS created FROM {s}.jobs
             WHERE idempotency_key = CAST(:idempotency_key AS text)""")

    @cached_property
    def insert_job_by_key(self) -> TextClause:
        """The keyed enqueue: the run holding :idempotency_key, else a new one (notified).

        The key is read first, in the statement's snapshot, and the INSERT runs only when
        nothing was found; so a duplicate touches no row and takes no lock that a worker's
        heartbeat of the existing run would wait behind (`ON CONFLICT DO UPDATE` did). Under
        REPEATABLE READ an old key is found in the snapshot even if a worker updated its row
        since, where any ON CONFLICT arbitration would raise a serialization failure (the
        newest version of the row is invisible to the snapshot).

        `DO NOTHING` remains for a key inserted concurrently: PostgreSQL makes the INSERT
        wait for that transaction. If it rolls back, ours goes in; if it commits, the
        statement returns no row (the winner is newer than its snapshot), and the caller
        sends `find_run_by_key`."""
        return self._t(f"""
            WITH existing AS ({self.find_run_by_key.text}),
            inserted AS (
                INSERT INTO {{s}}.jobs ({_CALL_COLUMNS}, args, run_at, concurrency_key,
                                        idempotency_key)
                SELECT {_CALL}, CAST(:args AS jsonb), {_DUE}, CAST(:concurrency_key AS text),
                       CAST(:idempotency_key AS text)
                 WHERE NOT EXISTS (SELECT 1 FROM existing)
                ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
                RETURNING id, run_id, queue, run_at)
            SELECT id, run_id, true AS created, pg_notify(:channel, {_wake("queue", "run_at")})
              FROM inserted
            UNION ALL
            SELECT id, run_id, created, NULL FROM existing""")

    @cached_property
    def insert_jobs(self) -> TextClause:
        """The bulk enqueue: one run per element of :args (JSON texts), one notification; the
        run ids in input order (run_id is drawn from its sequence row by row in input order,
        while RETURNING itself promises no order)."""
        return self._t(f"""
            WITH inserted AS (
                INSERT INTO {{s}}.jobs ({_CALL_COLUMNS}, args, run_at, concurrency_key)
                SELECT {_CALL}, a.value, {_DUE}, a.key
                  FROM unnest(CAST(:args AS jsonb[]), CAST(:concurrency_keys AS text[]))
                       WITH ORDINALITY AS a(value, key, n)
                 ORDER BY a.n
                RETURNING run_id, run_at)
            SELECT array_agg(run_id ORDER BY run_id),
                   pg_notify(:channel, {_wake("CAST(:queue AS text)", "min(run_at)")})
              FROM inserted""")

    def _start_run(self, head: str, source: str, where: str, run_id: str, tail: str) -> str:
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
                     status, run_at, trace_context"""

        def values(run: str) -> str:
            return f"""{run}, CAST(:task AS text), r.step, r.step_index, r.queue,
                     CAST(:priority AS smallint), r.max_attempts, CAST(:args AS jsonb),
                     CASE WHEN r.signal IS NULL THEN 'pending' ELSE 'waiting' END,
                     CASE WHEN r.signal IS NULL
                          THEN {_DUE} + make_interval(secs => r.delay)
                          ELSE now() + make_interval(secs => r.wait) END, {_TRACE}"""

        return f"""{head},
            first AS (
                INSERT INTO {{s}}.jobs ({columns}, idempotency_key)
                SELECT {values(run_id)}, CAST(:idempotency_key AS text)
                  FROM {source}
                 WHERE r.n = 1 AND {where}
                ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
                RETURNING id, run_id, step, queue, status, run_at
            ), rest AS (
                INSERT INTO {{s}}.jobs ({columns})
                SELECT {values("f.run_id")}
                  FROM first f CROSS JOIN {roots}
                 WHERE r.n > 1
                RETURNING id, run_id, step, queue, status, run_at
            ), met AS (
                INSERT INTO {{s}}.signals (run_id, name, step, timeout_s, reached_at)
                SELECT a.run_id, r.signal, r.step, r.wait, now()
                  FROM (SELECT run_id, step FROM first UNION ALL SELECT run_id, step FROM rest) a
                  JOIN {roots} ON r.step = a.step
                 WHERE r.signal IS NOT NULL
            )
            SELECT f.id, f.run_id, true AS created,
                   {_notify_new("(SELECT queue, status, run_at FROM first UNION ALL "
                                "SELECT queue, status, run_at FROM rest) a "
                                "WHERE status = 'pending'")}
              FROM first f
            {tail}""".replace("{roots}", roots)

    @cached_property
    def insert_run(self) -> TextClause:
        """Enqueue a run of a workflow: one row per root step, all sharing one run_id (see
        `_start_run`). A root waiting for a signal starts `waiting` and is entered in
        `flowq.signals` (a signal needs its run to exist, so none can be there yet). Keyed
        like `insert_job_by_key`: the other roots are inserted only if the first one was,
        and the run holding :idempotency_key is returned otherwise."""
        return self._t(self._start_run(
            f"WITH existing AS ({self.find_run_by_key.text})", "{roots}",
            "NOT EXISTS (SELECT 1 FROM existing)", "nextval('{s}.run_id_seq')",
            "UNION ALL SELECT id, run_id, created, NULL FROM existing"))

    # -- the worker ---------------------------------------------------------------------------

    @cached_property
    def exists_due_jobs(self) -> TextClause:
        """Whether any job of :queues is due within :horizon seconds (`run_until_idle` uses it
        to know it is done)."""
        return self._t("""
            SELECT EXISTS (SELECT 1 FROM {s}.jobs
                           WHERE status = 'pending' AND queue = ANY(:queues)
                             AND run_at <= now() + make_interval(secs => :horizon))""")

    @cached_property
    def select_map_results(self) -> TextClause:
        """The results of every instance of mapped step :step of run :run_id, in item order:
        a join's input from a mapped parent, collected when the join runs (an instance
        completing never reads its siblings; the join's counter is all it touches)."""
        return self._t("""
            SELECT result FROM {s}.jobs
             WHERE run_id = :run_id AND step = :step AND map_index IS NOT NULL
             ORDER BY map_index""")

    @cached_property
    def find_signal(self) -> TextClause:
        """The payload of signal :name of run :run_id, if it was sent: (payload,) or no row."""
        return self._t("""
            SELECT payload FROM {s}.signals
             WHERE run_id = :run_id AND name = :name AND sent_at IS NOT NULL""")

    @cached_property
    def expire_waits(self) -> TextClause:
        """Make up to :limit steps whose signal did not arrive by their timeout (`run_at`)
        runnable: they run without the payload, fail with SignalTimeout, and their retry
        policy decides. Returns (id, queue) and wakes their queues."""
        return self._t("""
            WITH expired AS (
                SELECT id FROM {s}.jobs
                 WHERE status = 'waiting' AND run_at <= now()
                 ORDER BY run_at LIMIT :limit
                 FOR UPDATE SKIP LOCKED
            ), woken AS (
                UPDATE {s}.jobs j SET status = 'pending'
                  FROM expired e WHERE j.id = e.id AND (j.status = 'waiting') IS TRUE
                RETURNING j.id, j.queue)
            SELECT w.id, w.queue, pg_notify(:channel, w.queue) FROM woken w""")

    @cached_property
    def find_stranded_jobs(self) -> TextClause:
        """Due jobs of :tasks that sit on a queue outside :queues (the queues their app's
        steps use, which its workers serve by default): enqueued with a queue= no worker of
        that app serves, they would wait forever. Up to 20 (queue, task) groups, largest
        first; the worker logs them at start."""
        return self._t("""
            SELECT queue, task, count(*) AS n,
                   extract(epoch FROM now() - min(run_at))::float8 AS oldest_s
              FROM {s}.jobs
             WHERE status = 'pending' AND run_at <= now()
               AND task = ANY(:tasks) AND queue <> ALL(:queues)
             GROUP BY queue, task ORDER BY count(*) DESC LIMIT 20""")

    @cached_property
    def heartbeat_jobs(self) -> TextClause:
        """Refresh the heartbeat of this worker's claims (:ids, :leases); returns the ids
        still ours, with whether their run was cancelled meanwhile (the running handler is
        told: cooperative cancellation)."""
        return self._t(f"""
            UPDATE {{s}}.jobs j SET heartbeat_at = now()
              FROM {_rows("c", _CLAIM_KEY, single=False)}
             WHERE {_FENCE}
            RETURNING j.id, j.cancel_requested""")

    def _complete(self, *, single: bool) -> TextClause:
        return self._t(f"""
            WITH done AS ({_succeed(single)})
            SELECT id, cancel_requested FROM done""")

    @cached_property
    def complete_jobs(self) -> TextClause:
        """Mark claims (:ids, :leases) succeeded with :results; returns the rows that were
        still ours (with whether their run was cancelled meanwhile)."""
        return self._complete(single=False)

    @cached_property
    def complete_job(self) -> TextClause:
        """`complete_jobs` for one claim (:id, :lease, :result), by primary key: what a
        `ctx.session` handler's own transaction sends."""
        return self._complete(single=True)

    def _complete_steps(self, *, single: bool) -> TextClause:
        # Successors are always a batch: one success may create many (a map's instances).
        successors = _rows("n", _SUCCESSOR, single=False, prefix="next_")
        return self._t(f"""
            WITH done AS ({_succeed(single)}), inserted AS (
                INSERT INTO {{s}}.jobs (run_id, task, step, step_index, queue, priority,
                                        max_attempts, args, map_index, run_at, trace_context)
                SELECT d.run_id, n.task, n.step, n.step_index, n.queue, d.priority,
                       n.max_attempts, n.args, n.map_index,
                       now() + make_interval(secs => n.delay), d.trace_context
                  FROM done d JOIN {successors} ON n.id = d.id AND n.lease = d.lease
                 WHERE NOT d.cancel_requested
                RETURNING queue, run_at
            )
            SELECT d.id, d.cancel_requested, {_notify_new("inserted")} AS woken
              FROM done d""")

    @cached_property
    def complete_steps(self) -> TextClause:
        """`complete_jobs` plus, in the same statement, the steps the successes create (a
        chain's next step, a map's instances; `:next_ids`, `:next_leases` name the claim each
        follows; none when the run was cancelled meanwhile), waking the workers of their
        queues. One statement, so it is atomic even in autocommit: no step is ever done
        without its successors, nor a successor created for a step that was not ours."""
        return self._complete_steps(single=False)

    @cached_property
    def complete_step(self) -> TextClause:
        """`complete_steps` for one claim (`:id`, `:lease`, `:result`), by primary key (see
        `complete_job`)."""
        return self._complete_steps(single=True)

    def _complete_flow(self, *, single: bool) -> TextClause:
        spawns = _rows("n", _SPAWN, single=False, prefix="next_")
        waits = "r.signal IS NOT NULL AND m.sent_at IS NULL"
        return self._t(f"""
            WITH done AS ({_succeed(single)}), spawn AS (
                SELECT d.run_id, d.priority, d.trace_context, n.*
                  FROM done d JOIN {spawns} ON n.id = d.id AND n.lease = d.lease
                 WHERE NOT d.cancel_requested
            ), counted AS (
                INSERT INTO {{s}}.joins (run_id, step, parents, remaining, inputs)
                SELECT run_id, step, max(parents), max(parents) + sum(delta),
                       COALESCE(jsonb_object_agg(source, input)
                                FILTER (WHERE source IS NOT NULL), '{{}}'::jsonb)
                  FROM spawn WHERE parents > 0
                 GROUP BY run_id, step
                 ORDER BY run_id, step  -- one lock order for every batch: fewer deadlocks
                ON CONFLICT (run_id, step) DO UPDATE
                   SET remaining = joins.remaining + excluded.remaining - excluded.parents,
                       inputs = joins.inputs || excluded.inputs
                RETURNING run_id, step, remaining, inputs
            ), ready AS (
                SELECT run_id, priority, task, step, step_index, queue, max_attempts, args,
                       map_index, delay, signal, wait, false AS joined, trace_context
                  FROM spawn WHERE parents = 0
                UNION ALL
                SELECT * FROM (
                    SELECT DISTINCT ON (s.run_id, s.step)
                           s.run_id, s.priority, s.task, s.step, s.step_index, s.queue,
                           s.max_attempts, c.inputs, NULL::int, s.delay, s.signal, s.wait, true,
                           s.trace_context  -- the context of the parent completing the join
                      FROM spawn s JOIN counted c ON c.run_id = s.run_id AND c.step = s.step
                     WHERE s.parents > 0 AND c.remaining = 0) joined
            ), met AS (
                INSERT INTO {{s}}.signals (run_id, name, step, timeout_s, reached_at)
                SELECT run_id, signal, step, wait, now() FROM ready WHERE signal IS NOT NULL
                ON CONFLICT (run_id, name) DO UPDATE
                   SET step = excluded.step, timeout_s = excluded.timeout_s,
                       reached_at = excluded.reached_at
                RETURNING run_id, name, payload, sent_at
            ), inserted AS (
                INSERT INTO {{s}}.jobs (run_id, task, step, step_index, queue, priority,
                                        max_attempts, args, map_index, joined, status, run_at,
                                        trace_context)
                SELECT r.run_id, r.task, r.step, r.step_index, r.queue, r.priority,
                       r.max_attempts,
                       CASE WHEN m.sent_at IS NULL THEN r.args
                            ELSE r.args || jsonb_build_object(r.signal, m.payload) END,
                       r.map_index, r.joined,
                       CASE WHEN {waits} THEN 'waiting' ELSE 'pending' END,
                       now() + make_interval(secs => CASE WHEN {waits} THEN r.wait
                                                          ELSE r.delay END),
                       r.trace_context
                  FROM ready r LEFT JOIN met m ON m.run_id = r.run_id AND m.name = r.signal
                RETURNING queue, status, run_at
            )
            SELECT d.id, d.cancel_requested,
                   {_notify_new("inserted WHERE status = 'pending'")} AS woken
              FROM done d""")

    @cached_property
    def complete_flows(self) -> TextClause:
        """`complete_steps` for workflows: besides the steps created at once, each success
        adds its share to the counters of the joins it is a parent of (`flowq.joins`; the
        success that brings one to zero creates that step, exactly once, even when two
        parents complete at the same instant: the counter row serializes them), and a step
        that waits for a signal meets it on `flowq.signals` (created `waiting` until its
        timeout, or `pending` with the payload if it was already sent)."""
        return self._complete_flow(single=False)

    @cached_property
    def complete_flow(self) -> TextClause:
        """`complete_flows` for one claim, by primary key."""
        return self._complete_flow(single=True)

    @cached_property
    def retry_job(self) -> TextClause:
        """Send a failed attempt back to pending after :delay seconds (or end it `cancelled` if
        its run was cancelled meanwhile); returns the new status and run_at, or nothing if
        the claim is no longer ours."""
        return self._t(f"""
            UPDATE {{s}}.jobs j
               SET status = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'pending' END,
                   finished_at = CASE WHEN cancel_requested THEN now() END,
                   run_at = now() + make_interval(secs => :delay),
                   last_error = :error, {_UNLOCK}
              FROM {_rows("c", _CLAIM_KEY, single=True)}
             WHERE {_FENCE}
            RETURNING j.status, j.run_at""")

    @cached_property
    def end_job(self) -> TextClause:
        """End a claim as :status (`dead` or `cancelled`) with :error."""
        return self._t(f"""
            UPDATE {{s}}.jobs j
               SET status = :status, finished_at = now(), last_error = :error, {_UNLOCK}
              FROM {_rows("c", _CLAIM_KEY, single=True)}
             WHERE {_FENCE}
            RETURNING j.status""")

    @cached_property
    def release_jobs(self) -> TextClause:
        """Hand claims back without burning the attempt: unfinished ones at shutdown, and jobs
        claimed ahead that did not start (or end them `cancelled` when their run was
        cancelled meanwhile). Giving the attempt back is safe: the fence is the lease, which
        the next claim renews. Notifies :channel with each queue, so other workers take them
        at once (identical notifications of one transaction are delivered once)."""
        return self._t(f"""
            UPDATE {{s}}.jobs j
               SET status = CASE WHEN j.cancel_requested THEN 'cancelled' ELSE 'pending' END,
                   finished_at = CASE WHEN j.cancel_requested THEN now() END,
                   attempts = greatest(j.attempts - 1, 0), run_at = now(), {_UNLOCK}
              FROM {_rows("c", _CLAIM_KEY, single=False)}
             WHERE {_FENCE}
            RETURNING j.id, pg_notify(:channel, j.queue)""")

    @cached_property
    def end_backend(self) -> TextClause:
        """End server process :pid: the connection of an attempt abandoned at its timeout,
        whose open transaction would otherwise hold its row locks until the stuck handler
        returns (if ever)."""
        return sa.text("SELECT pg_terminate_backend(:pid)")

    @cached_property
    def try_maintenance_lock(self) -> TextClause:
        """Take the transaction-scoped advisory lock of one maintenance service, or not."""
        return sa.text("SELECT pg_try_advisory_xact_lock(hashtext(:name))")

    @cached_property
    def reap_jobs(self) -> TextClause:
        """Requeue (or bury, once attempts are spent) running jobs whose heartbeat is older than
        :stale seconds: their worker died. The crashed attempt counts."""
        return self._t("""
            WITH stale AS (
                SELECT id FROM {s}.jobs
                WHERE status = 'running' AND heartbeat_at < now() - make_interval(secs => :stale)
                ORDER BY heartbeat_at
                LIMIT :limit
                FOR UPDATE SKIP LOCKED
            ), reaped AS (
                UPDATE {s}.jobs j
                   SET status = CASE WHEN j.cancel_requested THEN 'cancelled'
                                     WHEN j.attempts >= j.max_attempts THEN 'dead'
                                     ELSE 'pending' END,
                       finished_at = CASE WHEN j.cancel_requested OR j.attempts >= j.max_attempts
                                          THEN now() END,
                       run_at = now(),
                       last_error = format('WorkerLost: worker %s stopped heartbeating during '
                                           'attempt %s of %s (last heartbeat %s)',
                                           j.locked_by, j.attempts, j.max_attempts,
                                           j.heartbeat_at),
                       """ + _UNLOCK + """
                  FROM stale WHERE j.id = stale.id
                RETURNING j.id, j.run_id, j.task, j.step, j.queue, j.status, j.attempts)
            SELECT r.*, pg_notify(:channel, r.queue) FROM reaped r""")

    @cached_property
    def prune_jobs(self) -> TextClause:
        """Delete up to :limit runs whose rows all ended more than :retention seconds ago
        (:dead_retention for runs with a dead step). Whole runs only, so a retained run keeps
        its history and its idempotency key. A unique key still held by a pruned run goes
        with it (`flowq.uniques` has no index on run_id: a scan of that small table per
        batch)."""
        return self._t("""
            WITH old AS (
                SELECT DISTINCT j.run_id FROM {s}.jobs j
                WHERE j.status IN ('succeeded', 'dead', 'cancelled')
                  AND j.finished_at < now() - make_interval(secs => :retention)
                  AND NOT EXISTS (
                      SELECT 1 FROM {s}.jobs o
                      WHERE o.run_id = j.run_id
                        AND (o.status IN ('pending', 'running', 'waiting')
                             OR o.finished_at >= now() - make_interval(secs => :retention)
                             OR (o.status = 'dead' AND o.finished_at >=
                                 now() - make_interval(secs => :dead_retention))))
                LIMIT :limit)
            , gone AS (DELETE FROM {s}.jobs WHERE run_id IN (SELECT run_id FROM old)
                       RETURNING run_id)
            , joins AS (DELETE FROM {s}.joins WHERE run_id IN (SELECT run_id FROM old))
            , signals AS (DELETE FROM {s}.signals WHERE run_id IN (SELECT run_id FROM old))
            , held_keys AS (DELETE FROM {s}.uniques WHERE run_id IN (SELECT run_id FROM old))
            SELECT count(*) FROM gone""")

    # -- the workers registry ---------------------------------------------------------------

    @cached_property
    def register_worker(self) -> TextClause:
        """Register worker :name (or refresh it, if it exists: a restart under the same name)."""
        return self._t("""
            INSERT INTO {s}.workers (name, host, pid, queues, tasks, concurrency, version)
            VALUES (:name, :host, :pid, CAST(:queues AS text[]), CAST(:tasks AS text[]),
                    :concurrency, :version)
            ON CONFLICT (name) DO UPDATE
               SET host = excluded.host, pid = excluded.pid, queues = excluded.queues,
                   tasks = excluded.tasks, concurrency = excluded.concurrency,
                   version = excluded.version, started_at = now(), heartbeat_at = now()""")

    @cached_property
    def beat_worker(self) -> TextClause:
        """Refresh worker :name's heartbeat; no row when it expired (then register again)."""
        return self._t("""
            UPDATE {s}.workers SET heartbeat_at = now() WHERE name = :name RETURNING name""")

    @cached_property
    def unregister_worker(self) -> TextClause:
        """Remove worker :name (a clean stop)."""
        return self._t("DELETE FROM {s}.workers WHERE name = :name")

    @cached_property
    def expire_workers(self) -> TextClause:
        """Remove workers whose heartbeat is older than :stale seconds (they died)."""
        return self._t("""
            DELETE FROM {s}.workers
             WHERE heartbeat_at < now() - make_interval(secs => :stale) RETURNING name""")

    @cached_property
    def select_unserved_jobs(self) -> TextClause:
        """Due jobs that no live worker (heartbeat within :stale seconds) serves: none listens
        on their queue with their task in its app. Up to :limit (queue, task) groups, largest
        first. Scans the pending jobs: for an operator's eyes, not a hot path."""
        return self._t("""
            SELECT j.queue, j.task, count(*) AS n,
                   extract(epoch FROM now() - min(j.run_at))::float8 AS oldest_s
              FROM {s}.jobs j
             WHERE j.status = 'pending' AND j.run_at <= now()
               AND NOT EXISTS (
                   SELECT 1 FROM {s}.workers w
                    WHERE j.queue = ANY(w.queues) AND j.task = ANY(w.tasks)
                      AND w.heartbeat_at >= now() - make_interval(secs => :stale))
             GROUP BY j.queue, j.task ORDER BY count(*) DESC LIMIT :limit""")

    # -- signals (flowq.workflows): in the sender's transaction -----------------------------

    @cached_property
    def select_run_state(self) -> TextClause:
        """Run :run_id's task, its number of rows and of active (unfinished) rows, and whether
        it was cancelled: what a signal checks before it is written."""
        return self._t("""
            SELECT min(task), count(*),
                   count(*) FILTER (WHERE status IN ('pending', 'running', 'waiting')),
                   bool_or(status = 'cancelled' OR cancel_requested)
              FROM {s}.jobs WHERE run_id = :run_id""")

    @cached_property
    def send_signal(self) -> TextClause:
        """Record signal :name of run :run_id with :payload, unless it was sent already (then
        no row). Returns the step waiting for it, if that step was reached. The upsert on
        the primary key meets a completion creating the step: whichever writes second
        waits for the first and sees its row."""
        return self._t("""
            INSERT INTO {s}.signals (run_id, name, payload, sent_at)
            VALUES (:run_id, :name, CAST(:payload AS jsonb), now())
            ON CONFLICT (run_id, name) DO UPDATE
               SET payload = excluded.payload, sent_at = excluded.sent_at
             WHERE signals.sent_at IS NULL
            RETURNING step""")

    @cached_property
    def compare_signal(self) -> TextClause:
        """Whether the signal already sent as :name for :run_id has this very :payload."""
        return self._t("""
            SELECT payload = CAST(:payload AS jsonb) FROM {s}.signals
             WHERE run_id = :run_id AND name = :name""")

    @cached_property
    def wake_signalled_step(self) -> TextClause:
        """Hand the payload to step :step of run :run_id, which waits for signal :name: it
        becomes runnable now with the payload as its keyword argument :name. A new
        statement, so that under READ COMMITTED it sees a step created by a completion that
        `send_signal` waited for."""
        return self._t("""
            WITH woken AS (
                UPDATE {s}.jobs
                   SET status = 'pending', run_at = least(run_at, now()),
                       args = args || jsonb_build_object(CAST(:name AS text),
                                                         CAST(:payload AS jsonb))
                 WHERE run_id = :run_id AND step = :step AND map_index IS NULL
                   AND status IN ('waiting', 'pending')
                RETURNING id, queue)
            SELECT w.id, pg_notify(:channel, w.queue) FROM woken w""")

    # -- runs: inspection and control (flowq.runs) ------------------------------------------

    @cached_property
    def select_run_jobs(self) -> TextClause:
        """Every row of run :run_id, in step order. One statement, so one snapshot: a step's
        success and its successor's insert (one transaction) are seen together or not at all."""
        return self._t("""
            SELECT id, run_id, task, step, step_index, queue, status, priority, attempts,
                   max_attempts, args, result, last_error, idempotency_key, cancel_requested,
                   run_at, locked_at, heartbeat_at, locked_by, created_at, finished_at,
                   map_index
              FROM {s}.jobs WHERE run_id = :run_id
             ORDER BY step_index, map_index NULLS FIRST, id""")

    @cached_property
    def lock_run_jobs(self) -> TextClause:
        """Lock every row of run :run_id (waiting for an in-flight completion); returns their
        ids. Repeat until the set stops growing: a completion that committed while we waited
        may have inserted a successor this statement's snapshot could not see."""
        return self._t("""
            SELECT id FROM {s}.jobs WHERE run_id = :run_id ORDER BY id FOR UPDATE""")

    @cached_property
    def cancel_run_jobs(self) -> TextClause:
        """Cancel run :run_id (rows locked first): pending and waiting steps end `cancelled`
        with :error, running ones get `cancel_requested` (they finish, but create no
        successor and count towards no join)."""
        return self._t("""
            UPDATE {s}.jobs
               SET status = CASE WHEN status = 'running' THEN status ELSE 'cancelled' END,
                   finished_at = CASE WHEN status = 'running' THEN finished_at ELSE now() END,
                   last_error = CASE WHEN status = 'running' THEN last_error ELSE :error END,
                   cancel_requested = true
             WHERE run_id = :run_id
               AND (status IN ('pending', 'waiting')
                    OR (status = 'running' AND NOT cancel_requested))
            RETURNING id, status""")

    @cached_property
    def retry_dead_jobs(self) -> TextClause:
        """Send every dead step of run :run_id back with a fresh attempt budget, and wake the
        workers of their queues (at commit): due now, or, for a step whose signal never
        came, `waiting` again for its timeout. `last_error` is kept until the next attempt
        ends. Returns the ids."""
        return self._t("""
            WITH retried AS (
                UPDATE {s}.jobs j
                   SET status = CASE WHEN g.run_id IS NULL THEN 'pending' ELSE 'waiting' END,
                       attempts = 0, finished_at = NULL,
                       run_at = now() + make_interval(secs => COALESCE(g.timeout_s, 0))
                  FROM {s}.jobs d
                  LEFT JOIN {s}.signals g
                         ON g.run_id = d.run_id AND g.step = d.step AND g.sent_at IS NULL
                 WHERE d.run_id = :run_id AND d.status = 'dead' AND j.id = d.id
                RETURNING j.id, j.queue, j.status)
            SELECT r.id, pg_notify(:channel, r.queue) FROM retried r""")

    # -- run filters and bulk redrive (flowq.runs) ------------------------------------------

    # A run's status, derived from its rows as `flowq.ops.runs.run_status` does (aggregates over
    # the rows of one run).
    _RUN_STATUS = """CASE WHEN bool_or(status = 'cancelled' OR cancel_requested)
                               THEN 'cancelled'
                          WHEN bool_or(status = 'running') THEN 'running'
                          WHEN bool_or(status = 'pending') THEN 'pending'
                          WHEN bool_or(status = 'waiting') THEN 'waiting'
                          WHEN bool_or(status = 'dead') THEN 'dead'
                          ELSE 'succeeded' END"""

    def _runs_page(self, *, newest_first: bool, status: str) -> TextClause:
        """Up to :limit runs matching the filters, one row each, in run id order from a
        cursor (exclusive; NULL: from the start): newest first below :before, or oldest
        first above :after. Filters (NULL: any): derived status `status` (an SQL expression),
        :task, :queue (any of its steps on it), created (its first row) in
        [:since, :until).

        The plan walks the run ids of `jobs_run_id_idx` in order from the cursor, keeping
        the rows that could make their run match (its task; created since :since; a row
        with the status asked for, which every run of that status has, else a row on
        :queue, else one created before :until), computes each kept run's status from its rows (an index lookup per run)
        and stops at :limit matches. So a page costs about the index entries walked past,
        plus one lookup per candidate run, not the whole table: a page of recent runs takes
        milliseconds, while filters that match nothing walk every row below the cursor
        (0.1-0.2 s per million rows, measured; several seconds per million runs only when
        every run must be looked up: --until together with --status or --queue, matching
        none of the newest runs)."""
        order, param, op = ("DESC", "before", "<") if newest_first else ("ASC", "after", ">")
        return self._t(f"""
            SELECT r.* FROM (
                SELECT j.run_id FROM {{s}}.jobs j
                 WHERE (CAST(:{param} AS bigint) IS NULL
                        OR j.run_id {op} CAST(:{param} AS bigint))
                   AND (CAST(:task AS text) IS NULL OR j.task = CAST(:task AS text))
                   AND (CAST(:since AS timestamptz) IS NULL
                        OR j.created_at >= CAST(:since AS timestamptz))
                   AND (CAST({status} AS text) IS NULL
                        OR j.status = CAST({status} AS text)
                        OR (CAST({status} AS text) = 'cancelled' AND j.cancel_requested))
                   AND (CAST(:queue AS text) IS NULL
                        OR (CAST({status} AS text) IS NULL AND j.queue = CAST(:queue AS text))
                        OR (CAST({status} AS text) IS NOT NULL AND EXISTS (
                            SELECT 1 FROM {{s}}.jobs o
                             WHERE o.run_id = j.run_id AND o.queue = CAST(:queue AS text))))
                   AND (CAST(:until AS timestamptz) IS NULL OR CAST({status} AS text) IS NOT NULL
                        OR CAST(:queue AS text) IS NOT NULL
                        OR j.created_at < CAST(:until AS timestamptz))
                 GROUP BY j.run_id ORDER BY j.run_id {order}
            ) c CROSS JOIN LATERAL (
                SELECT c.run_id,
                       (array_agg(task ORDER BY step_index DESC, id DESC))[1] AS task,
                       (array_agg(step ORDER BY step_index DESC, id DESC))[1] AS step,
                       max(step_index) AS step_index,
                       {self._RUN_STATUS} AS status,
                       (array_agg(idempotency_key ORDER BY step_index, id))[1]
                           AS idempotency_key,
                       min(created_at) AS created_at,
                       (array_agg(finished_at ORDER BY step_index DESC, id DESC))[1]
                           AS finished_at
                  FROM {{s}}.jobs a WHERE a.run_id = c.run_id
            ) r
             WHERE (CAST({status} AS text) IS NULL OR r.status = CAST({status} AS text))
               AND (CAST(:since AS timestamptz) IS NULL
                    OR r.created_at >= CAST(:since AS timestamptz))
               AND (CAST(:until AS timestamptz) IS NULL
                    OR r.created_at < CAST(:until AS timestamptz))
             ORDER BY c.run_id {order}
             LIMIT :limit""")

    @cached_property
    def list_runs(self) -> TextClause:
        """The newest :limit runs below run id :before (NULL: the newest), optionally only
        those whose derived status is :status, of :task, with a step on :queue, created in
        [:since, :until); one row each, with the status `flowq.ops.runs.run_status` derives
        from its steps (see `_runs_page` for the cost)."""
        return self._runs_page(newest_first=True, status=":status")

    @cached_property
    def select_dead_runs(self) -> TextClause:
        """The oldest :limit dead runs above run id :after (NULL: the oldest), filtered like
        `list_runs`: a batch of a bulk redrive, read without locks (`lock_runs_jobs` and
        `retry_dead_runs` then check each one again)."""
        return self._runs_page(newest_first=False, status="'dead'")

    @cached_property
    def select_now(self) -> TextClause:
        """The database's clock: relative times (`--since 1h`) are measured on it, once."""
        return sa.text("SELECT now()")

    @cached_property
    def lock_runs_jobs(self) -> TextClause:
        """`lock_run_jobs` for the runs :run_ids: lock every row, in id order (the order
        every run lock takes, so two redrives never deadlock), returning the ids; repeat
        until the set stops growing."""
        return self._t("""
            SELECT id FROM {s}.jobs WHERE run_id = ANY(CAST(:run_ids AS bigint[]))
             ORDER BY id FOR UPDATE""")

    @cached_property
    def retry_dead_runs(self) -> TextClause:
        """`retry_dead_jobs` for those of the runs :run_ids (locked first) that are still
        dead: the others changed since they were picked and are left alone. Returns the
        run ids retried (one row each), and wakes the queues of the steps due now."""
        return self._t(f"""
            WITH dead AS (
                SELECT run_id FROM {{s}}.jobs
                 WHERE run_id = ANY(CAST(:run_ids AS bigint[]))
                 GROUP BY run_id
                HAVING {self._RUN_STATUS} = 'dead'
            ), retried AS (
                UPDATE {{s}}.jobs j
                   SET status = CASE WHEN g.run_id IS NULL THEN 'pending' ELSE 'waiting' END,
                       attempts = 0, finished_at = NULL,
                       run_at = now() + make_interval(secs => COALESCE(g.timeout_s, 0))
                  FROM {{s}}.jobs d
                  LEFT JOIN {{s}}.signals g
                         ON g.run_id = d.run_id AND g.step = d.step AND g.sent_at IS NULL
                 WHERE d.run_id IN (SELECT run_id FROM dead) AND d.status = 'dead'
                   AND j.id = d.id
                RETURNING j.run_id, j.queue, j.status)
            SELECT DISTINCT r.run_id,
                   (SELECT count(pg_notify(:channel, w.queue))
                      FROM (SELECT DISTINCT queue FROM retried WHERE status = 'pending') w)
              FROM retried r""")

    # -- uniqueness while active (flowq.session, flowq.aio) -----------------------------------

    _ACTIVE = "('pending', 'running', 'waiting')"

    def _unique_claim(self) -> str:
        """The CTEs every unique enqueue starts with (see `insert_job_unique` for why they
        are race-free): `existing`, the run holding :idempotency_key (NULL: none); `held`,
        the active run holding :unique_key in the statement's snapshot, as (id, run_id,
        created = false); `claimed`, the new run's id when the key was free, or held by a
        run visible here and finished."""
        active = f"x.run_id = u.run_id AND x.status IN {self._ACTIVE}"
        return f"""
            WITH existing AS ({self.find_run_by_key.text}),
            held AS (
                SELECT f.id, u.run_id, false AS created
                  FROM {{s}}.uniques u
                 CROSS JOIN LATERAL (SELECT id FROM {{s}}.jobs WHERE run_id = u.run_id
                                      ORDER BY id LIMIT 1) f
                 WHERE u.key = CAST(:unique_key AS text)
                   AND EXISTS (SELECT 1 FROM {{s}}.jobs x WHERE {active})
                   AND NOT EXISTS (SELECT 1 FROM existing)
            ), claimed AS (
                INSERT INTO {{s}}.uniques AS u (key, run_id)
                SELECT CAST(:unique_key AS text), nextval('{{s}}.run_id_seq')
                 WHERE NOT EXISTS (SELECT 1 FROM existing) AND NOT EXISTS (SELECT 1 FROM held)
                ON CONFLICT (key) DO UPDATE
                   SET run_id = excluded.run_id, created_at = excluded.created_at
                 WHERE EXISTS (SELECT 1 FROM {{s}}.uniques v
                                WHERE v.key = u.key AND v.run_id = u.run_id)
                   AND NOT EXISTS (SELECT 1 FROM {{s}}.jobs x WHERE {active})
                RETURNING run_id
            )"""

    @cached_property
    def insert_job_unique(self) -> TextClause:
        """The unique enqueue (`unique=True` or `unique_key=`): the run of :task active under
        :unique_key (a key of the task and its arguments, or of the caller's key), else a
        new one (notified) that holds the key in `flowq.uniques`. With an :idempotency_key
        too, the run holding that key comes first, whatever its state.

        A duplicate reads, and locks nothing: `held` finds the key's run in the statement's
        snapshot, active there. Otherwise the key is claimed by an upsert on its primary key,
        with a run id drawn first: PostgreSQL arbitrates the conflict on the newest version
        of the row (waiting for a transaction that inserted or updated it until it ends),
        and under READ COMMITTED evaluates the DO UPDATE's WHERE on that version, while its
        sub-selects still read the statement's snapshot. So the WHERE takes the key over only
        if the claim it finds is one this snapshot sees (`v`: the visible version names the
        same run, each run id being claimed once), and then reads that run's rows in a
        snapshot in which they are all there: none active means it has finished (a finished
        row stays finished, unless `flowq runs retry` revives a dead run). A claim committed
        after our snapshot (a concurrent enqueuer we waited for) is not taken over: no row
        comes back, and the caller sends the statement again, whose new snapshot sees that
        run (active: it is returned, with no lock). A claim whose run is gone (its rows
        deleted by hand) is taken over, never stuck. The job is inserted only with the run
        id `claimed` returned, so two enqueuers can never both insert.

        The row lock a claim takes (insert or update) is held until the caller's transaction
        ends: a concurrent enqueue of the same key waits for it, then returns its run, or
        takes the key if it rolled back. Under REPEATABLE READ or SERIALIZABLE, PostgreSQL
        refuses to arbitrate against a row version the transaction's snapshot cannot see:
        the race raises a serialization failure (SQLSTATE 40001; retry the transaction).

        If an :idempotency_key insert loses its race (DO NOTHING), the key claimed here
        names a run without rows, which the next enqueue of the key takes over; the caller
        sends the statement again and gets the run holding the idempotency key."""
        return self._t(f"""{self._unique_claim()},
            inserted AS (
                INSERT INTO {{s}}.jobs (run_id, {_CALL_COLUMNS}, args, run_at, concurrency_key,
                                        idempotency_key)
                SELECT c.run_id, {_CALL}, CAST(:args AS jsonb), {_DUE},
                       CAST(:concurrency_key AS text), CAST(:idempotency_key AS text)
                  FROM claimed c
                ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
                RETURNING id, run_id, queue, run_at)
            SELECT id, run_id, true AS created, pg_notify(:channel, {_wake("queue", "run_at")})
              FROM inserted
            UNION ALL
            SELECT id, run_id, created, NULL FROM existing
            UNION ALL
            SELECT id, run_id, created, NULL FROM held""")

    @cached_property
    def insert_run_unique(self) -> TextClause:
        """`insert_run` (a workflow whose run starts with several rows) under a unique key, as
        `insert_job_unique`: the roots are inserted with the run id `claimed` returned."""
        return self._t(self._start_run(
            self._unique_claim(), "claimed c CROSS JOIN {roots}", "true", "c.run_id",
            """UNION ALL SELECT id, run_id, created, NULL FROM existing
            UNION ALL SELECT id, run_id, created, NULL FROM held"""))

    # -- periodic schedules (flowq.schedules, flowq.worker.scheduler) -------------------------

    @cached_property
    def select_schedules(self) -> TextClause:
        """The cursor of each of :names (the last tick it enqueued, or when it was first seen;
        NULL: not yet entered) with the database's clock, one row per name."""
        return self._t("""
            SELECT n.name, s.last_tick, clock_timestamp() AS now
              FROM unnest(CAST(:names AS text[])) AS n(name)
              LEFT JOIN {s}.schedules s ON s.name = n.name""")

    @cached_property
    def start_schedules(self) -> TextClause:
        """Enter the schedules :names (:tasks, :specs) that are not in the table yet, with
        their cursor at :now: a new schedule starts from now, it does not backfill."""
        return self._t("""
            INSERT INTO {s}.schedules (name, task, spec, last_tick)
            SELECT n.name, n.task, n.spec, CAST(:now AS timestamptz)
              FROM unnest(CAST(:names AS text[]), CAST(:tasks AS text[]),
                          CAST(:specs AS text[])) AS n(name, task, spec)
             ORDER BY n.name
            ON CONFLICT (name) DO UPDATE SET last_tick = excluded.last_tick
             WHERE schedules.last_tick IS NULL""")

    @cached_property
    def stamp_scheduled_run(self) -> TextClause:
        """Record on the rows of run :run_id the tick :tick it runs for (`ctx.scheduled_at`),
        in the transaction that enqueued it, so no worker ever sees the run without it."""
        return self._t("""
            UPDATE {s}.jobs SET scheduled_at = CAST(:tick AS timestamptz)
             WHERE run_id = :run_id""")

    @cached_property
    def advance_schedule(self) -> TextClause:
        """Record that schedule :name (:task, :spec) enqueued its tick :tick as run :run_id.
        The cursor never moves back: a slower pass may commit an older tick after a newer
        one."""
        return self._t("""
            INSERT INTO {s}.schedules (name, task, spec, last_tick, last_run_id)
            VALUES (:name, :task, :spec, CAST(:tick AS timestamptz), :run_id)
            ON CONFLICT (name) DO UPDATE
               SET task = excluded.task, spec = excluded.spec, updated_at = now(),
                   last_run_id = CASE WHEN schedules.last_tick IS NULL
                                        OR excluded.last_tick >= schedules.last_tick
                                      THEN excluded.last_run_id
                                      ELSE schedules.last_run_id END,
                   last_tick = greatest(schedules.last_tick, excluded.last_tick)""")

    @cached_property
    def list_schedules(self) -> TextClause:
        """Every recorded schedule by name, each with the database's clock (one row of NULLs
        and the clock when there is none)."""
        return self._t("""
            SELECT c.now, s.name, s.task, s.spec, s.last_tick, s.last_run_id, s.updated_at
              FROM (SELECT now() AS now) c LEFT JOIN {s}.schedules s ON true
             ORDER BY s.name""")

    # -- status and doctor (flowq.status, flowq.doctor) -------------------------------------

    @cached_property
    def select_completions(self) -> TextClause:
        """Per queue, the jobs that ended in the last hour: succeeded in the last minute and
        hour, dead in the last hour. Reads `jobs_finished_idx` from an hour ago on (its
        predicate written out, so the planner can use it): never the older retained rows."""
        return self._t("""
            SELECT queue,
                   count(*) FILTER (WHERE status = 'succeeded'
                                      AND finished_at >= now() - interval '1 minute')
                       AS succeeded_last_minute,
                   count(*) FILTER (WHERE status = 'succeeded') AS succeeded_last_hour,
                   count(*) FILTER (WHERE status = 'dead') AS dead_last_hour
              FROM {s}.jobs
             WHERE status IN ('succeeded', 'dead', 'cancelled')
               AND finished_at >= now() - interval '1 hour'
             GROUP BY queue""")

    @cached_property
    def select_dead_by_task(self) -> TextClause:
        """Dead jobs by task, most first, up to :limit tasks (`jobs_dead_idx`)."""
        return self._t("""
            SELECT task, count(*) AS jobs FROM {s}.jobs WHERE status = 'dead'
             GROUP BY task ORDER BY count(*) DESC, task LIMIT :limit""")

    @cached_property
    def select_dead_errors(self) -> TextClause:
        """For each run of :run_ids, its first dead step (lowest id) and that step's error
        (the run_id index, then only the runs' rows)."""
        return self._t("""
            SELECT DISTINCT ON (run_id) run_id, step, map_index, last_error FROM {s}.jobs
             WHERE run_id = ANY(CAST(:run_ids AS bigint[])) AND status = 'dead'
             ORDER BY run_id, id""")

    @cached_property
    def select_live_workers(self) -> TextClause:
        """The registered workers whose heartbeat is younger than :stale seconds, by name."""
        return self._t("""
            SELECT name, host, pid, queues, concurrency, version, started_at,
                   -- now() is the transaction's start: a beat committed since is younger
                   GREATEST(extract(epoch FROM now() - heartbeat_at), 0)::float8
                       AS heartbeat_age_s
              FROM {s}.workers
             WHERE heartbeat_at >= now() - make_interval(secs => :stale)
             ORDER BY name""")

    @cached_property
    def select_table_health(self) -> TextClause:
        """`flowq.jobs`' statistics (live and dead tuples, last vacuum and analyze, size, the
        average row width of its last analyze, reloptions), its pending index's size, and the
        pending jobs (counted through that index)."""
        return self._t("""
            SELECT s.n_live_tup, s.n_dead_tup,
                   extract(epoch FROM now() - GREATEST(s.last_vacuum, s.last_autovacuum))::float8
                       AS vacuum_age_s,
                   extract(epoch FROM now() - GREATEST(s.last_analyze, s.last_autoanalyze))::float8
                       AS analyze_age_s,
                   pg_table_size(c.oid) AS table_bytes, pg_relation_size(c.oid) AS heap_bytes,
                   c.reloptions,
                   (SELECT sum(avg_width) FROM pg_stats
                     WHERE schemaname = '{s}' AND tablename = 'jobs')::float8 AS row_width,
                   pg_relation_size(i.oid) AS pending_index_bytes,
                   i.reltuples AS pending_index_entries,
                   (SELECT count(*) FROM {s}.jobs WHERE status = 'pending') AS pending
              FROM pg_class c
              LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
              LEFT JOIN pg_class i ON i.oid = to_regclass('{s}.jobs_pending_idx')
             WHERE c.oid = to_regclass('{s}.jobs')""")

    @cached_property
    def select_long_transactions(self) -> TextClause:
        """Sessions of this database (other than this one) whose transaction began more than
        :age seconds ago and holds back the xmin horizon (a snapshot, or a transaction id):
        oldest first, up to 10. Other roles' sessions are visible with pg_read_all_stats
        (pg_monitor) or as a superuser."""
        return self._t("""
            SELECT pid, COALESCE(application_name, '') AS application_name,
                   COALESCE(usename::text, '') AS usename, COALESCE(state, '') AS state,
                   extract(epoch FROM now() - xact_start)::float8 AS age_s,
                   age(COALESCE(backend_xmin, backend_xid)) AS xmin_age,
                   left(regexp_replace(COALESCE(query, ''), '\\s+', ' ', 'g'), 80) AS query
              FROM pg_stat_activity
             WHERE (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
               AND datname = current_database() AND pid <> pg_backend_pid()
               AND xact_start < now() - make_interval(secs => :age)
             ORDER BY xact_start LIMIT 10""")

    @cached_property
    def select_backend(self) -> TextClause:
        """This session's backend pid and server port, and whether autovacuum is on."""
        return self._t("""
            SELECT pg_backend_pid() AS pid, inet_server_port() AS port,
                   current_setting('autovacuum') AS autovacuum""")

    @cached_property
    def send_probe(self) -> TextClause:
        """NOTIFY :channel with :payload (the doctor's LISTEN round trip)."""
        return self._t("SELECT pg_notify(:channel, :payload)")

    @cached_property
    def select_clock(self) -> TextClause:
        """The database's clock (not the transaction's start), as seconds since the epoch."""
        return self._t("SELECT extract(epoch FROM clock_timestamp())::float8")

    # -- metrics (flowq.metrics) ------------------------------------------------------------

    @cached_property
    def metrics_collector_lock(self) -> TextClause:
        """Whether this session collects the queue metrics: it still is the backend :pid that
        took the session-level advisory lock :name, or it takes it now. CASE, so a holder
        never takes it twice (a session lock is re-entrant and counts its holds)."""
        return sa.text("""
            SELECT CASE WHEN pg_backend_pid() = CAST(:pid AS int) THEN true
                        ELSE pg_try_advisory_lock(hashtext(CAST(:name AS text))) END,
                   pg_backend_pid()""")

    @cached_property
    def metrics_queue_stats(self) -> TextClause:
        """Per queue with pending or running jobs: due, scheduled and running jobs, and the
        age of the oldest due job in seconds (the partial pending and running indexes)."""
        return self._t("""
            SELECT queue,
                   count(*) FILTER (WHERE status = 'pending' AND run_at <= now()) AS due,
                   count(*) FILTER (WHERE status = 'pending' AND run_at > now()) AS scheduled,
                   count(*) FILTER (WHERE status = 'running') AS running,
                   COALESCE(extract(epoch FROM now() - min(run_at) FILTER (
                       WHERE status = 'pending' AND run_at <= now())), 0)::float8 AS oldest_s
              FROM {s}.jobs
             WHERE status IN ('pending', 'running')
             GROUP BY queue ORDER BY queue""")

    # -- the test kit (flowq.testing) -------------------------------------------------------

    @cached_property
    def select_pending_jobs(self) -> TextClause:
        """Pending jobs of :task and of :queue (NULL: any), oldest first: what the test kit's
        `assert_enqueued` looks at, sent through the caller's own transaction."""
        return self._t("""
            SELECT * FROM {s}.jobs
             WHERE status = 'pending'
               AND (CAST(:task AS text) IS NULL OR task = CAST(:task AS text))
               AND (CAST(:queue AS text) IS NULL OR queue = CAST(:queue AS text))
             ORDER BY id""")

    @cached_property
    def claim_any_jobs(self) -> TextClause:
        """`claim_jobs` without regard to pauses and limits: the test kit's `drain`, which runs
        one job at a time in the test's own transaction."""
        return self._claim()

    @cached_property
    def claim_run_jobs(self) -> TextClause:
        """`claim_jobs` restricted to the runs :run_ids (`flowq.testing.drain(runs=...)`);
        the same statement, written once."""
        return self._claim(" AND run_id = ANY(CAST(:run_ids AS bigint[]))")


@cache
def queries(schema: str) -> Queries:
    """The statements of `schema`, built once per process (each compiles once, on first use)."""
    return Queries(schema)
