"""flowq's data access: the only layer that knows SQL, bind parameters and column order.

- `urls`: which database URL to use, parsing it (any PostgreSQL URL means psycopg 3),
  printing it without its password, its libpq conninfo (`to_conninfo`), and engines (`create_engine`);
- `schema`: the tables, defined once; `migrations`: applying them (alembic, flowq's own
  version table); `checks`: whether a database is reachable, migrated and current;
- `sql`: every statement, split by table (`queries(schema).claim_jobs`, ...);
- `runner`: the one way to send a statement, on a psycopg or a SQLAlchemy connection;
- `rows` and `store`: typed verbs over the statements, rows read by column name;
- `transient`: which database errors are worth trying again (`is_transient`).

The package itself exposes what users of flowq write in their own code (`flowq.db.create_engine`,
`flowq.db.normalize_url`, ...): the URL and engine functions of `urls`, and `is_transient` for
a producer's retry loop.
"""

from __future__ import annotations

from flowq.db.transient import is_transient, leave_read_only_servers
from flowq.db.urls import (
    PGBOUNCER_CONNECT_ARGS,
    create_engine,
    describe_url,
    mask_secrets,
    normalize_url,
    resolve_url,
    to_conninfo,
)

__all__ = ["PGBOUNCER_CONNECT_ARGS", "create_engine", "describe_url", "is_transient",
           "leave_read_only_servers", "mask_secrets", "normalize_url", "resolve_url",
           "to_conninfo"]
