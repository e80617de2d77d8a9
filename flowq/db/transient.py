"""Which database errors are transient: the transaction can be tried again, as a whole, later.

One rule for the whole project: the worker's completer keeps an outcome to write again, its
loops report an outage once (`flowq.worker.connection.Outage`), and a producer's own retry loop
asks the same question (`flowq.db.is_transient`, see docs/operations.md, "High availability"):

- the connection failed or broke (psycopg's OperationalError/InterfaceError; SQLSTATE class 08);
- the server is shutting down, restarting or cancelled the statement (class 57), is out of
  resources (53) or failed internally (58);
- the transaction lost a serialization or deadlock race (class 40);
- the transaction is read-only (25006): the server is a standby, or a primary demoted in place
  (`default_transaction_read_only`), as during a failover. `is_read_only` tells it apart:
  such a connection must be left, not reused, so that `target_session_attrs=read-write`
  finds the new primary (`leave_read_only_servers(engine)` does that for a SQLAlchemy pool;
  `flowq.db.create_engine` and the worker's engines have it).

Anything else (a constraint violated, a value the server refuses, a missing table) would fail
again the same way, and is not transient.
"""

from __future__ import annotations

from typing import Final

import psycopg
import sqlalchemy as sa
from sqlalchemy import event

__all__ = ["is_read_only", "is_transient", "leave_read_only_servers"]

_TRANSIENT_CLASSES: Final = frozenset({"08", "57", "53", "40", "58"})
READ_ONLY: Final = "25006"


def _orig(exc: BaseException) -> BaseException:
    """The driver's exception under SQLAlchemy's wrapper (or `exc` itself)."""
    orig = getattr(exc, "orig", None)
    return orig if isinstance(orig, BaseException) else exc


def is_transient(exc: BaseException) -> bool:
    """True when `exc` means "try the transaction again later", not "this is refused"."""
    orig = _orig(exc)
    if isinstance(orig, psycopg.OperationalError | psycopg.InterfaceError):
        return True
    if isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError):
        return True
    sqlstate = getattr(orig, "sqlstate", None)
    if not sqlstate:
        return False  # refused before it was sent (psycopg cannot adapt a value)
    return sqlstate[:2] in _TRANSIENT_CLASSES or sqlstate == READ_ONLY


def is_read_only(exc: BaseException) -> bool:
    """True when `exc` says the server takes no writes (a standby, or a demoted primary)."""
    return getattr(_orig(exc), "sqlstate", None) == READ_ONLY


def leave_read_only_servers(engine: sa.Engine) -> None:
    """Treat "read-only transaction" like a lost connection on `engine`: SQLAlchemy then
    discards the pool's connections, and new ones (with `target_session_attrs=read-write`)
    reach the new primary instead of failing on the old one until the pool recycles."""

    @event.listens_for(engine, "handle_error")
    def _read_only_is_a_disconnect(context: sa.engine.ExceptionContext) -> None:
        if is_read_only(context.original_exception):
            context.is_disconnect = True
