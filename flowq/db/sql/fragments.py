"""The pieces flowq's statements are built from, and the base every statement set extends.

One templating style for every statement: an f-string in which the schema is written `{S}`
and a shared piece by its name here; `Statements.sql` puts the schema in (a validated
identifier, so formatting it in is safe) and makes the `TextClause`. The pieces that carry a
hazard say so: the fence (`FENCE`, written so that no partial index can serve it), the rows
of a fenced write (`rows`: one-row VALUES for a single row, so the planner makes it a
primary-key lookup), the claim's UPDATE (`take`, the tail of a CTE: see `claims.claim_jobs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.sql.elements import TextClause

from flowq.db.runstatus import run_status_sql
from flowq.db.schema import JOB_COLUMNS, run_end_channel
from flowq.names import validate_schema_name

__all__ = [
    "ACTIVE",
    "ATTEMPT_ERROR_CHARS",
    "ATTEMPT_LOG_LENGTH",
    "AWAITED",
    "CALL",
    "CALL_COLUMNS",
    "CANCELLABLE",
    "CLAIMED",
    "CLAIM_KEY",
    "CLAIM_ORDER",
    "CONTROLLED",
    "DEADLINE",
    "DUE",
    "FENCE",
    "RUN_STATUS",
    "SPAWN",
    "SUCCESSOR",
    "TRACE",
    "UNLOCK",
    "Columns",
    "R",
    "S",
    "Statements",
    "bind_rows",
    "cancel",
    "copy_rows",
    "fence",
    "log_attempt",
    "mark_keyed",
    "notify_ended",
    "notify_ended_row",
    "notify_new",
    "registered_without",
    "rows",
    "stale",
    "take",
    "wake",
]

# Where the schema goes in a statement's text (an f-string writes `{S}`).
S: Final = "{s}"
# Where the schema's run-end channel goes, as the text of a literal (`'{R}'`): see
# `flowq.db.schema.run_end_channel` (its characters need no quoting) and `notify_ended`.
R: Final = "{r}"


class Statements:
    """A set of named statements for one flowq schema: each a `cached_property` returning a
    `TextClause`, named verb_noun, whose docstring opens with a one-line description."""

    def __init__(self, schema: str) -> None:
        self.schema = validate_schema_name(schema)
        self.run_channel = run_end_channel(self.schema)

    def sql(self, text: str) -> TextClause:
        """`text` (written with `{S}` for the schema, `{R}` for its run-end channel) for
        this schema."""
        return sa.text(text.replace(S, self.schema).replace(R, self.run_channel))


# The columns a worker needs of a claimed row: `flowq.db.rows.ClaimedJob` reads them by name
# (computed ones are named with AS), so their order here is free. `run_at` (the claimer's
# cursor) is raised to year 1, a day in: a run_at before it ('-infinity', a BC date, year 1
# read in a zone west of UTC; only a row written by hand, enqueue refuses what precedes
# `flowq.define.options.MIN_RUN_AT`) does not load into a datetime, and that error came after
# the claim committed, losing every row of it (and before PostgreSQL 17 `now() - run_at`
# fails the claim). Such a row sorts before its cursor key, so only a claim from the head
# takes it, and it is at the head.
_DUE = "GREATEST(j.run_at, '0001-01-02 00:00:00+00')"
CLAIMED = f"""j.id, j.lease, j.run_id, j.task, j.step, j.step_index, j.queue, j.priority,
    j.attempts, j.max_attempts, j.args::text AS args, j.cancel_requested,
    extract(epoch FROM now() - j.created_at)::float8 AS age, j.map_index, j.joined,
    j.scheduled_at,
    extract(epoch FROM now() - {_DUE})::float8 AS pickup_delay,
    j.trace_context::text AS trace_context, j.created_at AS enqueued_at,
    j.locked_at AS claimed_at, j.fingerprint,
    {_DUE} AS run_at"""

# The order in which a claim picks due rows and returns them: most urgent first, then the
# earliest due, then the oldest. The pending index (`jobs_pending_idx`) is in this order within
# a queue. `run_at` of a claimed row is the clamped due time (`_DUE`): the same order, except
# that rows due before year 1 tie and fall back to their ids.
CLAIM_ORDER = "priority, run_at, id"

# The fence's status check, written so that no partial index can serve it (the planner cannot
# prove `status = 'running'` from `... IS TRUE`). A fenced write must find its rows through the
# primary key. Given the plain condition, a planner misled by a table analyzed empty (a queue
# that drained, then a burst) chose a scan of `jobs_running_idx`, which holds an entry for
# every job that ran since the last vacuum: each completion batch then cost O(jobs run), and
# a drain stalled (seen in `flowq bench`).
FENCE = "j.id = c.id AND j.lease = c.lease AND (j.status = 'running') IS TRUE"


def fence(single: bool) -> str:
    """`FENCE` for the claims of `rows("c", ..., single=single)`. A batch's rows are also
    bounded by their ids (`j.id = ANY(:ids)`, an index condition on the primary key), so no
    plan can read more of `flowq.jobs` than the batch: analyzed while its rows were dead and
    not yet vacuumed (an open snapshot holds them), the table has no live tuple per page in
    the planner's eyes, whatever it holds since, and the batch was hash-joined to a walk over
    the whole primary key (`tests/integration/test_queries.py`, "dead-rows"). A single row's
    VALUES is pulled up into constants: already a lookup."""
    if single:
        return FENCE
    return f"{FENCE} AND j.id = ANY(CAST(:ids AS bigint[]))"

# Clears the claim on a row that goes back to pending or ends. The lease stays: it is the
# last claim's token, and the next claim draws a new one.
UNLOCKED: Final[dict[str, str]] = {"locked_by": "NULL", "locked_at": "NULL",
                                   "heartbeat_at": "NULL"}
UNLOCK = ", ".join(f"{name} = {value}" for name, value in UNLOCKED.items())

# Attempt history (revision 0008): at most this many earlier attempts per row (the latest
# kept), each error cut to this many characters, so a step retried without end stays small.
ATTEMPT_LOG_LENGTH: Final = 20
ATTEMPT_ERROR_CHARS: Final = 2000


def log_attempt(error: str) -> str:
    """The SET items that record a failed attempt as it ends (before `UNLOCK` clears the
    claim: the right-hand sides read the row as it was): its start in `started_at`, and an
    entry appended to `attempt_log`, which keeps the latest `ATTEMPT_LOG_LENGTH`. `error` is
    an SQL expression for the attempt's error text."""
    return f"""started_at = j.locked_at, attempt_log = (
                   SELECT CASE WHEN jsonb_array_length(a.log) > {ATTEMPT_LOG_LENGTH}
                               THEN a.log - 0 ELSE a.log END
                     FROM (SELECT COALESCE(j.attempt_log, '[]'::jsonb) || jsonb_build_array(
                               jsonb_build_object('attempt', j.attempts,
                                                  'started_at', j.locked_at,
                                                  'finished_at', now(), 'worker', j.locked_by,
                                                  'error', left({error},
                                                                {ATTEMPT_ERROR_CHARS})))
                           AS log) a)"""


# The W3C trace context an enqueue stores with its rows (JSON text, NULL: not traced; see
# flowq.tracing). The steps a run creates later copy it from the row that creates them.
TRACE = "CAST(:trace_context AS jsonb)"
# The run's deadline (revision 0013): :deadline_at, else now + :deadline_in (both NULL: none).
# Every row of the run carries it: the steps a run creates later copy it from the row that
# creates them, and the reaper cancels the unfinished ones once it passes (`deadlines`).
DEADLINE = ("COALESCE(CAST(:deadline_at AS timestamptz), "
            "now() + CAST(:deadline_in AS interval))")
# What every enqueued row takes from the call, typed (a driver that prepares statements, such
# as asyncpg, must know each parameter's type), and its due time: :run_at, else now + :delay.
CALL = f"""CAST(:task AS text), CAST(:step AS text), CAST(:queue AS text),
                    CAST(:priority AS smallint), CAST(:max_attempts AS int),
                    CAST(:key_limit AS int), {TRACE}, {DEADLINE}, CAST(:fingerprint AS text)"""
# The columns `CALL` fills, in its order. `fingerprint` (revision 0014): of the definition
# the run starts under (`flowq.define.shape`), copied to the steps it creates like the trace.
CALL_COLUMNS = ("task, step, queue, priority, max_attempts, key_limit, trace_context, "
                "deadline, fingerprint")
DUE = "COALESCE(CAST(:run_at AS timestamptz), now() + CAST(:delay AS interval))"



def mark_keyed(when: str) -> str:
    """A CTE `marked` of an enqueue that marks its queue :queue keyed in `flowq.queues` when
    `when` (the call carries a concurrency key).

    Claims of a keyed queue count its running jobs per key (`claim_limited_jobs`). A key
    follows its job into whatever queue it is enqueued in: marking only the task's own queue
    (at worker start) let a `queue=` elsewhere run unlimited. The job and the mark commit
    together, in the caller's transaction, so no claim sees the job without the mark. Once
    the queue is keyed this reads one row by primary key and writes nothing, taking no lock;
    only the first keyed enqueue into a queue inserts (or updates) the queue's row, which
    stays locked until the caller's transaction ends: claims of that queue, a pause and a
    worker's start-up wait for it, that once."""
    return f"""marked AS (
                INSERT INTO {S}.queues AS q (name, keyed)
                SELECT CAST(:queue AS text), true
                 WHERE {when} AND NOT EXISTS (
                       SELECT 1 FROM {S}.queues k
                        WHERE k.name = CAST(:queue AS text) AND k.keyed)
                ON CONFLICT (name) DO UPDATE SET keyed = true WHERE NOT q.keyed)"""



def wake(queue: str, run_at: str) -> str:
    """The NOTIFY payload of new jobs: the queue, and for jobs due later `queue@seconds`, the
    wait measured from the transaction's start (`now()`). A worker receives it at commit or
    later, so waking that many seconds after receipt is never early."""
    return (f"CASE WHEN {run_at} > now() THEN {queue} || '@' || "
            f"extract(epoch FROM {run_at} - now())::text ELSE {queue} END")


def notify_new(rows: str) -> str:
    """An expression waking the workers of the new jobs in `rows` (a FROM item with `queue`
    and `run_at`, and optionally a WHERE): one notification per distinct payload."""
    return (f"(SELECT count(pg_notify(:channel, w)) FROM (SELECT DISTINCT "
            f"{wake('queue', 'run_at')} AS w FROM {rows}) x)")


# A NOTIFY payload must stay under 8000 bytes (an error inside the completion otherwise).
_MAX_ENDED_PAYLOAD: Final = 7900


# The runs somebody waits for (`flowq.run_waiters`, written by `flowq.wait_run`): only their
# ends are announced. A NOTIFY's commit takes a lock that every notifying transaction of the
# database queues on, so a notification nobody hears is not free: measured at 1.5x the drain
# rate of no-op jobs with it gone (docs/benchmarks.md, "Before and after durable execution").
AWAITED: Final = f"SELECT w.run_id FROM {S}.run_waiters w"


def notify_ended(run_ids: str) -> str:
    """An expression telling `flowq.wait_run` that runs it waits for may have ended (a row of
    each reached a state that creates nothing after it): ONE notification on the run-end
    channel for the whole statement, its payload the ids of `run_ids` (a query of one column,
    `run_id`) that a waiter registered (`AWAITED`), joined by ',', or '' ("look at every run
    you wait for") when they would not fit a payload; nothing when none is awaited. Not
    DISTINCT: a repeated id is harmless, and the sort cost more than the notification
    (measured on a batch of 100 completions). Written as an uncorrelated scalar subquery (an
    InitPlan: run once, and only when the statement returns a row). A waiter reads the run
    again to decide (`flowq.ops.runinfo.run_status`): a notification is a hint, never the
    run's end itself."""
    return f"""(SELECT count(pg_notify('{R}', CASE WHEN length(e.ids) < {_MAX_ENDED_PAYLOAD}
                                                  THEN e.ids ELSE '' END))
                  FROM (SELECT string_agg(x.run_id::text, ',') AS ids
                          FROM ({run_ids}) x
                         WHERE x.run_id IN ({AWAITED})) e
                 WHERE e.ids IS NOT NULL)"""


def notify_ended_row(ended: str, run_id: str = "j.run_id") -> str:
    """`notify_ended` for one row of a RETURNING list: a notification naming `run_id` when
    `ended` (an SQL condition on the row as written) holds and a waiter registered the run.
    Identical notifications of one transaction are delivered once."""
    return (f"CASE WHEN {ended} AND {run_id} IN ({AWAITED}) "
            f"THEN pg_notify('{R}', {run_id}::text) END")


Columns = tuple[tuple[str, str], ...]
CLAIM_KEY: Columns = (("id", "bigint"), ("lease", "bigint"))
# A successor names the claim it follows, (id, lease): a worker may hold two claims of one
# step (an attempt lost to the reaper, and its own re-claim), and only the claim that landed
# may create the next step, once.
SUCCESSOR: Columns = (("id", "bigint"), ("lease", "bigint"), ("task", "text"),
                        ("step", "text"), ("step_index", "smallint"), ("queue", "text"),
                        ("max_attempts", "int"), ("args", "jsonb"), ("map_index", "int"),
                        ("delay", "float8"))
# What a success spawns in a workflow (`flowq.worker.model.Spawn`): a successor's columns,
# the signal it waits for (and how long), and its share in a join (`parents` > 0).
SPAWN: Columns = (*SUCCESSOR, ("signal", "text"), ("wait", "float8"), ("parents", "int"),
                    ("delta", "int"), ("source", "text"), ("input", "jsonb"),
                    ("mapped", "text"), ("items", "int"))


def _plural(name: str) -> str:
    """The bind parameter of column `name` in a batch (`rows(..., single=False)`): `id` ->
    `ids`. Only `rows` and `bind_rows` name them, so the two always agree."""
    if name.endswith("s"):
        return name
    return name + ("es" if name.endswith("x") else "s")


def bind_rows(columns: Columns, values: Sequence[object], *, single: bool,
              prefix: str = "") -> dict[str, Any]:
    """The bind parameters of `rows(alias, columns, single=single, prefix=prefix)` for
    `values`, each column read from every value by its name (a dataclass of the row: a
    value without one of the columns is an AttributeError, never a shifted column)."""
    if single:
        (value,) = values
        return {f"{prefix}{name}": getattr(value, name) for name, _ in columns}
    return {f"{prefix}{_plural(name)}": [getattr(v, name) for v in values]
            for name, _ in columns}


def rows(alias: str, columns: Columns, *, single: bool, prefix: str = "") -> str:
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
    arrays = ", ".join(f"CAST(:{prefix}{_plural(name)} AS {type_}[])" for name, type_ in columns)
    return f"unnest({arrays}) AS {alias}({names})"


def take(picked: str) -> str:
    """The UPDATE that claims the rows of CTE `picked` (ids) for :worker, each under a new
    lease, returning what `ClaimedJob` holds. Bounded by the picked ids (`= ANY`, an index
    condition on the primary key), as every fenced write is (`fence`): a plan cannot read
    more of `flowq.jobs` than the claim, whatever the statistics say. Its rows come back in
    no stated order: a statement that returns them sorts them (`CLAIM_ORDER`)."""
    return f"""UPDATE {S}.jobs j
               SET status = 'running', attempts = j.attempts + 1,
                   lease = nextval('{S}.lease_seq'), locked_by = :worker,
                   locked_at = now(), heartbeat_at = now()
              FROM {picked}
             WHERE j.id = {picked}.id AND j.id = ANY(ARRAY(SELECT id FROM {picked}))
            RETURNING {CLAIMED}"""


def registered_without(capability: str) -> str:
    """Whether a worker whose code lacks `capability` (`flowq.db.schema.CAPABILITIES`; NULL:
    an earlier release) is registered: the one test of every change of how workers share a
    table, which is used only while none is."""
    return f"""EXISTS (SELECT 1 FROM {S}.workers w
                        WHERE w.capabilities IS NULL OR NOT '{capability}' = ANY(w.capabilities))"""


def stale(heartbeat: str) -> str:
    """Whether `heartbeat` (a timestamp column) is older than :stale seconds: the one limit
    past which a running job's claim and a worker's registry entry are presumed dead. The
    reaper reaps a job only when its own heartbeat is stale and its worker's entry is stale
    too, gone, or does not list its lease; the registry's expiry removes entries by this
    same test and limit: removing an entry never ends a job that the reaper would have
    kept."""
    return f"{heartbeat} < now() - make_interval(secs => :stale)"


# The queues a plain claim must leave alone: paused, or limited (claimed under their lock).
CONTROLLED = f"""SELECT 1 AS one, q.name, q.paused FROM {S}.queues q
    WHERE (q.paused OR q.keyed OR q.concurrency IS NOT NULL OR q.rate_limit IS NOT NULL)"""


def copy_rows(into: str, source: str, ends: dict[str, str]) -> str:
    """An INSERT writing job rows into table `into` (`jobs` or `job_history`) from `source`
    (FROM items whose job row is aliased `g`, e.g. the RETURNING rows of a DELETE), with the
    columns of `ends` (name -> SQL expression) replaced: every column listed by name
    (`JOB_COLUMNS`), so none is ever shifted. How a row moves between the live table and
    history (a success, a retry of a dead step)."""
    items = ", ".join(ends.get(name, f"g.{name}") for name in JOB_COLUMNS.split(", "))
    return f"""INSERT INTO {S}.{into} ({JOB_COLUMNS})
                SELECT {items} FROM {source}"""



# The job states in which a run is active (holds its unique key).
ACTIVE: Final = "('pending', 'running', 'waiting')"

# The rows a run's cancellation still changes: those not yet ended, or running and not yet
# asked to stop. `CANCEL` is what it does to them (pending and waiting steps end
# `cancelled` with `error`, an SQL expression; running ones get `cancel_requested`: they
# finish, but create no successor and count towards no join, and their handler sees
# `ctx.cancelled` at its worker's next heartbeat). One rule for `flowq runs cancel` and a
# run's deadline.
CANCELLABLE: Final = ("(status IN ('pending', 'waiting') "
                      "OR (status = 'running' AND NOT cancel_requested))")


def cancel(error: str) -> str:
    """The SET items of a run's cancellation (see `CANCELLABLE`) for rows of alias `j`."""
    return f"""status = CASE WHEN j.status = 'running' THEN j.status ELSE 'cancelled' END,
                   finished_at = CASE WHEN j.status = 'running' THEN j.finished_at
                                      ELSE now() END,
                   last_error = CASE WHEN j.status = 'running' THEN j.last_error
                                     ELSE {error} END,
                   cancel_requested = true"""

# A run's status from its rows, as an aggregate (the one rule: `flowq.db.runstatus`).
RUN_STATUS: Final = run_status_sql()
