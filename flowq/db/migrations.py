"""Applying flowq's alembic migrations with flowq's own version table.

The revisions live in the top-level `alembic/` of the repository and ship inside the wheel as
`flowq/_migrations`. They are applied with a version table in the flowq schema
(`flowq.alembic_version`), so flowq's history never collides with the application's own
`alembic_version`. Concurrent `migrate` calls (several workers starting at once) are
serialised by an advisory lock, taken here and again in `env.py`.

The schema: `migrate` creates it when it does not exist and marks it so with a comment
(`SCHEMA_COMMENT`). `downgrade` to base drops flowq's tables, then its version table, then
the schema itself, but only when the schema carries that mark and holds nothing else: a
schema someone else created, or one holding objects flowq did not create, stays.

Migrating under running workers: every DDL statement waits at most `LOCK_TIMEOUT` (0.5 s) for
its lock (`SET LOCAL lock_timeout`), because a claim queued behind a waiting `ALTER TABLE`
waits as long as it does. When one times out (a long transaction holds a lock on a flowq
table), the whole migration is rolled back and tried again with backoff (`RETRY_FIRST` 0.25 s,
doubling up to `RETRY_CAP` 2 s), `LOCK_ATTEMPTS` (30) times, about a minute; then
`MigrationBlockedError` names the oldest transaction holding a lock on flowq's tables. There
is no statement_timeout: a legitimate long statement (an index on a big table) must not be
cut, and keeping revisions to cheap, additive DDL is the rule of docs/operations.md,
checked by tests/unit/test_migration_rules.py. A migration that joins the caller's open
transaction cannot be rolled back and retried by flowq: it waits the same bounded time once,
then raises.

alembic is imported inside the functions that run it, not with this module: the constants
(`HEAD_REVISION`, ...) are read by commands that never migrate, which should start at once.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import sqlalchemy as sa

from flowq.db.schema import HISTORY_PARTITION
from flowq.errors import ConfigurationError, MigrationBlockedError
from flowq.names import DEFAULT_SCHEMA, validate_schema_name

if TYPE_CHECKING:
    from alembic.config import Config

__all__ = ["HEAD_REVISION", "LOCK_ATTEMPTS", "LOCK_TIMEOUT", "MIGRATE_LOCK", "RETRY_CAP",
           "RETRY_FIRST", "SCHEMA_COMMENT", "VERSION_TABLE", "Migrated", "alembic_config",
           "current_revision", "downgrade", "is_known_revision", "migrate", "migrations_dir",
           "revision_schema", "sql_script"]

T = TypeVar("T")

VERSION_TABLE = "alembic_version"
# The revision this flowq needs (a test checks it is the migrations' head): a worker refuses
# to start on a schema behind it, with one sentence instead of failing statements.
HEAD_REVISION: Final = "0020"
# The advisory lock serialising migrations; env.py takes the same key (any constant would do,
# as long as every flowq process uses it).
MIGRATE_LOCK: Final = 0x666C6F77  # "flow"
# The mark of a schema `migrate` created, so that `downgrade` to base may drop it.
SCHEMA_COMMENT: Final = "created by flowq migrate"
# Seconds one DDL statement may wait for its lock: claims queued behind it wait as long.
LOCK_TIMEOUT: Final = 0.5
# Tries of a whole migration whose DDL timed out on a lock, and the backoff between them.
LOCK_ATTEMPTS: Final = 30
RETRY_FIRST: Final = 0.25
RETRY_CAP: Final = 2.0
_DEPENDENT_OBJECTS_STILL_EXIST: Final = "2BP01"
_LOCK_NOT_AVAILABLE: Final = "55P03"
# The oldest transaction holding a lock on a table of the flowq schema: the likeliest blocker
# once a DDL statement timed out (after the rollback nothing waits, so pg_blocking_pids is
# empty). Read through pg_locks, so it needs no privilege beyond pg_stat_activity's.
_BLOCKER_SQL: Final = """
SELECT a.pid, a.application_name, a.state, l.mode, c.relname,
       extract(epoch FROM now() - coalesce(a.xact_start, a.query_start)) AS age
FROM pg_locks l
JOIN pg_class c ON c.oid = l.relation
JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'relation' AND l.granted AND n.nspname = :schema
  AND l.pid <> pg_backend_pid()
ORDER BY a.xact_start NULLS LAST, a.pid
LIMIT 1
"""


@dataclass(frozen=True)
class Migrated:
    """What `migrate` did: the revision before and after (None: no flowq tables), and
    whether it created the schema."""

    before: str | None
    after: str | None
    created_schema: bool

    @property
    def changed(self) -> bool:
        return self.before != self.after


def compared(schema: str) -> Callable[[str | None, str, object], bool]:
    """Alembic's `include_name` for comparing `schema` with flowq's tables: that schema
    only, without the version table or the day partitions of `job_history` (created by
    maintenance, not declared: `flowq.db.history`)."""

    def include(name: str | None, type_: str, parent_names: object) -> bool:
        if type_ == "schema":
            return name == schema
        if type_ == "table":
            return name != VERSION_TABLE and not (name or "").startswith(HISTORY_PARTITION)
        if type_ == "index" and isinstance(parent_names, dict):
            return not str(parent_names.get("table_name") or "").startswith(HISTORY_PARTITION)
        return True

    return include


def revision_schema() -> str:
    """The schema a revision applies its DDL to, for use inside `upgrade()`/`downgrade()`: read
    when the revision runs, not at import, since one process may migrate several schemas."""
    from alembic import context

    return validate_schema_name(context.config.attributes.get("flowq_schema", DEFAULT_SCHEMA))


def migrations_dir() -> Path:
    """Where the revisions are: inside the installed package, else the repository's alembic/."""
    package = Path(__file__).resolve().parent.parent  # flowq/, from flowq/db/
    for candidate in (package / "_migrations", package.parent / "alembic"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError("flowq's migrations are missing from this installation")


def alembic_config(connection: sa.Connection | None = None, *, schema: str = DEFAULT_SCHEMA,
                   url: str | None = None, output: Any = None) -> Config:
    """An alembic Config for flowq's migrations, bound to `connection` (or `url` for --sql)."""
    from alembic.config import Config

    cfg = Config(output_buffer=output) if output is not None else Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["connection"] = connection
    cfg.attributes["flowq_schema"] = validate_schema_name(schema)
    return cfg


def _in_transaction(bind: sa.Engine | sa.Connection, work: Callable[[sa.Connection], T]) -> T:
    if isinstance(bind, sa.Engine):
        with bind.begin() as conn:
            return work(conn)
    # A transaction the caller already had open stays theirs to commit (the DDL commits
    # with their work); one that only migrating began is committed here, or closing the
    # connection would silently roll the migration back.
    began_here = not bind.in_transaction()
    result = work(bind)
    if began_here and bind.in_transaction():
        bind.commit()
    return result


def _lock(conn: sa.Connection, lock_timeout: float) -> None:
    """Take the migration lock (waiting for another migrate is unbounded: it stalls no claim),
    then bound every later lock wait of this transaction to `lock_timeout`."""
    conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATE_LOCK})
    conn.execute(sa.text("SELECT set_config('lock_timeout', :t, true)"),
                 {"t": f"{max(1, round(lock_timeout * 1000))}ms"})


def _is_lock_timeout(exc: BaseException) -> bool:
    return getattr(getattr(exc, "orig", None), "sqlstate", None) == _LOCK_NOT_AVAILABLE


def _blocker(engine: sa.Engine, schema: str) -> str:
    """Who most likely blocks the migration, as a clause: 'pid 42 (application_name ..., state
    ..., in a transaction for 12 s, AccessShareLock on flowq.jobs)', or a vaguer clause when
    no such lock is visible (it ended, or the role cannot see other sessions)."""
    try:
        with engine.connect() as probe:
            row = probe.execute(sa.text(_BLOCKER_SQL), {"schema": schema}).first()
    except sa.exc.DBAPIError:
        row = None
    if row is None:
        return "a transaction that no longer holds it (or that this role cannot see)"
    # application_name is whatever the other client set: shown quoted and cut short.
    name = (row.application_name or "")[:64]
    table = row.relname if row.relname.isidentifier() else repr(row.relname[:64])
    age = f"{row.age:.0f} s" if row.age is not None else "an unknown time"
    return (f"pid {row.pid} (application_name {name!r}, state {row.state or 'unknown'}, "
            f"in a transaction for {age}, {row.mode} on {schema}.{table})")


def _check_budget(lock_timeout: float, attempts: int) -> None:
    if isinstance(lock_timeout, bool) or not (
            isinstance(lock_timeout, (int, float)) and math.isfinite(lock_timeout)
            and 0 < lock_timeout <= 60):
        raise ConfigurationError(f"lock_timeout must be seconds in (0, 60], not {lock_timeout!r}")
    if isinstance(attempts, bool) or not (isinstance(attempts, int) and 1 <= attempts <= 1000):
        raise ConfigurationError(f"attempts must be an integer from 1 to 1000, not {attempts!r}")


def _bounded(bind: sa.Engine | sa.Connection, schema: str, work: Callable[[sa.Connection], T],
             *, lock_timeout: float, attempts: int,
             on_retry: Callable[[str], None] | None) -> T:
    """Run `work` in a transaction (as `_in_transaction`), again from the start while one of
    its lock waits times out, `attempts` times in all; then `MigrationBlockedError`."""
    _check_budget(lock_timeout, attempts)
    engine = bind if isinstance(bind, sa.Engine) else bind.engine
    # A caller's open transaction is theirs: flowq cannot roll it back to try again.
    owned = isinstance(bind, sa.Engine) or not bind.in_transaction()

    def restoring(conn: sa.Connection) -> T:
        # The bound is for flowq's DDL only: a caller's transaction gets its own back.
        previous = conn.execute(sa.text("SELECT current_setting('lock_timeout')")).scalar()
        result = work(conn)
        conn.execute(sa.text("SELECT set_config('lock_timeout', :p, true)"), {"p": previous})
        return result

    delay = RETRY_FIRST
    for attempt in range(1, attempts + 1):
        try:
            return _in_transaction(bind, restoring)
        except sa.exc.OperationalError as exc:
            if not _is_lock_timeout(exc):
                raise
            if isinstance(bind, sa.Connection) and owned:
                bind.rollback()
            who = _blocker(engine, schema)
            if not owned or attempt == attempts:
                tries = f"{attempt} tries: each time" if attempt > 1 else "one try:"
                raise MigrationBlockedError(
                    f"the flowq migration gave up after {tries} a statement waited "
                    f"more than {lock_timeout:g} s for a lock on the {schema!r} schema's "
                    f"tables, held by {who}; end that transaction (or let it finish), then "
                    "run `flowq migrate` again.") from None
            if on_retry is not None:
                on_retry(f"a migration statement waited more than {lock_timeout:g} s for a "
                         f"lock held by {who}: rolled back, trying again in {delay:g} s "
                         f"(try {attempt + 1} of {attempts}).")
            time.sleep(delay)
            delay = min(delay * 2, RETRY_CAP)
    raise AssertionError("unreachable")  # pragma: no cover


def current_revision(conn: sa.Connection, schema: str = DEFAULT_SCHEMA) -> str | None:
    """The flowq revision of `schema` in this database, or None when it has no flowq tables."""
    from alembic.runtime.migration import MigrationContext

    ctx = MigrationContext.configure(conn, opts={
        "version_table": VERSION_TABLE, "version_table_schema": validate_schema_name(schema)})
    return ctx.get_current_revision()


def is_known_revision(revision: str | None) -> bool:
    """Whether `revision` is one of the revisions this flowq ships (so a schema at it is this
    flowq's head or behind it); False for a revision of a newer flowq, or any other text."""
    from alembic.script import ScriptDirectory

    if revision is None:
        return False
    script = ScriptDirectory.from_config(alembic_config())
    # Compared as ids, never resolved: 'head' or a prefix written into the version table
    # must not pass for a revision.
    return revision in {rev.revision for rev in script.walk_revisions()}


def migrate(bind: sa.Engine | sa.Connection, *, schema: str = DEFAULT_SCHEMA,
            revision: str = "head", lock_timeout: float = LOCK_TIMEOUT,
            attempts: int = LOCK_ATTEMPTS,
            on_retry: Callable[[str], None] | None = None) -> Migrated:
    """Bring the flowq schema up to `revision` (default: the latest); safe to call repeatedly.

    With an Engine, migrating is one transaction of its own. With a Connection, it joins the
    connection's open transaction if there is one (commit it yourself), else commits.
    Each lock wait is bounded by `lock_timeout` seconds so running workers' claims never
    queue longer behind the DDL; a migration whose wait timed out is rolled back and tried
    again, `attempts` times in all (`on_retry` gets one sentence per retry), then raises
    `MigrationBlockedError`. Returns what it did (`Migrated`: the revisions before and after).
    """
    from alembic import command

    schema = validate_schema_name(schema)

    def work(conn: sa.Connection) -> Migrated:
        _lock(conn, lock_timeout)
        created = conn.execute(sa.text("SELECT 1 FROM pg_namespace WHERE nspname = :s"),
                               {"s": schema}).scalar() is None
        if created:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
            conn.execute(sa.text(f"COMMENT ON SCHEMA \"{schema}\" IS '{SCHEMA_COMMENT}'"))
        before = current_revision(conn, schema)
        command.upgrade(alembic_config(conn, schema=schema), revision)
        return Migrated(before, current_revision(conn, schema), created)

    return _bounded(bind, schema, work, lock_timeout=lock_timeout, attempts=attempts,
                    on_retry=on_retry)


def downgrade(bind: sa.Engine | sa.Connection, *, schema: str = DEFAULT_SCHEMA,
              revision: str = "base", lock_timeout: float = LOCK_TIMEOUT,
              attempts: int = LOCK_ATTEMPTS,
              on_retry: Callable[[str], None] | None = None) -> None:
    """Undo flowq's migrations down to `revision`.

    Down to base (the default), it also drops flowq's version table, and the schema when
    `migrate` created it and nothing else is in it; a schema that holds anything flowq did
    not create (or that flowq did not create) is left in place, empty of flowq's objects.
    Transactions and lock waits as for `migrate`.
    """
    from alembic import command

    schema = validate_schema_name(schema)

    def work(conn: sa.Connection) -> None:
        _lock(conn, lock_timeout)
        command.downgrade(alembic_config(conn, schema=schema), revision)
        if current_revision(conn, schema) is not None:
            return
        conn.execute(sa.text(f'DROP TABLE IF EXISTS "{schema}".{VERSION_TABLE}'))
        comment = conn.execute(sa.text(
            "SELECT obj_description(oid, 'pg_namespace') FROM pg_namespace WHERE nspname = :s"),
            {"s": schema}).scalar()
        if comment != SCHEMA_COMMENT:
            return
        try:
            with conn.begin_nested():
                # RESTRICT (the default) refuses a schema that holds any object at all: that
                # refusal, not a catalogue query of ours, is what protects other objects.
                conn.execute(sa.text(f'DROP SCHEMA "{schema}" RESTRICT'))
        except sa.exc.DBAPIError as exc:
            if getattr(exc.orig, "sqlstate", None) != _DEPENDENT_OBJECTS_STILL_EXIST:
                raise

    _bounded(bind, schema, work, lock_timeout=lock_timeout, attempts=attempts,
             on_retry=on_retry)


def sql_script(*, schema: str = DEFAULT_SCHEMA, revision: str = "head") -> str:
    """The DDL `migrate` would run on an empty database, for review (`flowq migrate --sql`)."""
    from alembic import command

    buf = io.StringIO()
    cfg = alembic_config(schema=schema, url="postgresql+psycopg://", output=buf)
    command.upgrade(cfg, revision, sql=True)
    return buf.getvalue()
