"""The names and values flowq's tables, statements and workers agree on, beside the tables.

`flowq.db.schema` declares the tables; this module holds what is not a table but is read
with them: the `metadata` every table is declared in, the closed set of a step's statuses, the capabilities a worker registers (what
its code understands of the shared tables), the notify channels of a schema and its
schema map, and the constants the statements share with the declarations (the history
partitions' prefix, the jobs table's storage parameters, the join shards, the map index of
an unmapped step, the arguments a batch's callback gets). `flowq.db.schema` re-exports them
all, where the rest of flowq imports them from.
"""

from __future__ import annotations

import hashlib
from typing import Final, Literal

import sqlalchemy as sa

from flowq.names import DEFAULT_SCHEMA, validate_schema_name

__all__ = [
    "ACTIVE_STATUSES",
    "BATCH_ARGUMENTS",
    "CAPABILITIES",
    "HISTORY_CAPABILITY",
    "HISTORY_PARTITION",
    "JOBS_STORAGE_PARAMETERS",
    "JOIN_SHARDS",
    "JOIN_SHARDS_CAPABILITY",
    "LIVENESS_CAPABILITY",
    "NO_MAP_INDEX",
    "PERMITS_CAPABILITY",
    "STATUSES",
    "TERMINAL_STATUSES",
    "Status",
    "metadata",
    "notify_channel",
    "run_end_channel",
    "schema_map",
]

# The catalogue every flowq table and sequence is declared in (`flowq.db.schema`,
# `flowq.db.workflow_tables`), in the default schema: another is applied by `schema_map`.
metadata = sa.MetaData(schema=DEFAULT_SCHEMA)

# `waiting`: a step waiting for a signal (see flowq.workflows), until `run_at`, its timeout.
Status = Literal["pending", "running", "succeeded", "dead", "cancelled", "waiting"]
STATUSES: Final[tuple[Status, ...]] = ("pending", "running", "succeeded", "dead", "cancelled",
                                       "waiting")
ACTIVE_STATUSES: Final[tuple[Status, ...]] = ("pending", "running", "waiting")
TERMINAL_STATUSES: Final[tuple[Status, ...]] = ("succeeded", "dead", "cancelled")

# The name of every partition of `job_history` starts with this: a day's is
# `job_history_YYYYMMDD` (UTC), and the DEFAULT partition `job_history_default`.
HISTORY_PARTITION: Final = "job_history_"

# The storage parameters of `flowq.jobs` (reloptions, which the autogenerate comparison does
# not see; `flowq doctor` checks them), suited to a queue table: revision 0006's autovacuum
# settings, and revision 0020's fillfactor (pages filled to half, so a claim's new row version
# lands on the page of the old one: a smaller WAL record, no second lock record).
JOBS_STORAGE_PARAMETERS: Final[dict[str, str]] = {
    "autovacuum_vacuum_scale_factor": "0.01",
    "autovacuum_vacuum_insert_scale_factor": "0.01",
    "autovacuum_analyze_scale_factor": "0.02",
    "autovacuum_vacuum_cost_delay": "0",
    "fillfactor": "50",
}

# What this release's workers understand, registered with each (`workers.capabilities`):
# - `JOIN_SHARDS_CAPABILITY`: it counts the instances of a large map in `join_shards` (an
#   older worker would count them on the join's own row);
# - `PERMITS_CAPABILITY`: it counts the permits held in `permits` when it claims a limited
#   queue (an older worker counts running jobs only);
# - `LIVENESS_CAPABILITY`: its reaper takes a running job for alive while the registry entry
#   its `locked_by` names beats and lists its lease (`workers.leases`; an older reaper reads
#   the job's own `heartbeat_at` only, so until none is registered every worker still beats
#   each job it holds).
# - `HISTORY_CAPABILITY`: it reads finished rows from `job_history` too (revision 0018; an
#   older worker reads `jobs` only: a join's mapped results, a child's end, a batch's runs),
#   so rows move to history only while every registered worker has it (`completions.succeed`,
#   the trigger `jobs_retire`, the mover); until then they end in `jobs` as before.
JOIN_SHARDS_CAPABILITY: Final = "join_shards"
PERMITS_CAPABILITY: Final = "permits"
LIVENESS_CAPABILITY: Final = "worker_liveness"
HISTORY_CAPABILITY: Final = "job_history"
CAPABILITIES: Final[tuple[str, ...]] = (JOIN_SHARDS_CAPABILITY, PERMITS_CAPABILITY,
                                        LIVENESS_CAPABILITY, HISTORY_CAPABILITY)

# How many rows a large map's instances count down on, per join (`flowq.db.schema.join_shards`).
JOIN_SHARDS: Final = 32

# `map_index` of a checkpoint or a child run outside a mapped step: a primary key column
# cannot be NULL (`flowq.db.schema.checkpoints`, `children`); the reads give NULL back.
NO_MAP_INDEX: Final = -1

# The arguments a batch's callback gets besides its own (`flowq.db.schema.batches`).
BATCH_ARGUMENTS: Final[tuple[str, ...]] = ("batch_id", "succeeded", "dead", "cancelled")


def schema_map(schema: str) -> dict[str | None, str] | None:
    """Execution option mapping flowq's tables to `schema`; None for the default schema."""
    validate_schema_name(schema)
    return None if schema == DEFAULT_SCHEMA else {DEFAULT_SCHEMA: schema}


def notify_channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel for a flowq schema: the schema's own name."""
    return validate_schema_name(schema)


# A channel name is an identifier: at most 63 bytes, or pg_notify raises.
_MAX_CHANNEL: Final = 63


def run_end_channel(schema: str) -> str:
    """The channel on which ended runs are announced (`flowq.wait_run` LISTENs on it; the
    workers do not, so their wake-ups never see it): `<schema>:runs`, which no schema's own
    channel can equal (a schema name has no ':'), or for a schema name too long for that,
    `flowq:runs:` and a digest of it. Only [a-z0-9_:] characters: safe inside a literal."""
    name = validate_schema_name(schema)
    channel = f"{name}:runs"
    if len(channel) <= _MAX_CHANNEL:
        return channel
    return "flowq:runs:" + hashlib.sha256(name.encode()).hexdigest()[:32]
