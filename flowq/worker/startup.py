"""A worker's start against a database that may be briefly unreachable (a restart, a
failover, a pooler dropping backends): `ride_out` runs the start-up statements again with
backoff, from `START_RETRY_FIRST` (0.1 s) doubling up to `DB_BACKOFF_MAX` (5 s), for
`WorkerConfig.start_timeout` seconds (default 10) in all; then it stops with one sentence
(`DatabaseUnavailableError`). A server that answered and said no (`REFUSALS`: a wrong
password, a missing database) is not tried again, nor is a statement the database refused.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Final

from sqlalchemy.engine import URL

from flowq.db import describe_url, mask_secrets
from flowq.db.transient import is_transient
from flowq.errors import DatabaseUnavailableError
from flowq.storable import first_line
from flowq.worker.connection import DB_BACKOFF_MAX, DB_ERRORS
from flowq.worker.logs import WARNING, log_event

__all__ = ["REFUSALS", "START_RETRY_FIRST", "ride_out"]

# The first wait before a starting worker tries an unreachable database again (doubling, up
# to DB_BACKOFF_MAX, for WorkerConfig.start_timeout seconds in all).
START_RETRY_FIRST: Final = 0.1
# libpq's words for a server that answered and said no (not worth trying again), unlike "the
# database system is starting up" or a refused TCP connection.
REFUSALS: Final = ("password authentication failed", "no pg_hba.conf entry", "does not exist",
                   "authentication failed", "SSL is not enabled", "permission denied")


def _reason(exc: BaseException) -> str:
    """The driver's first line for a failed connection (ensure_schema's error wraps it)."""
    if isinstance(exc, DatabaseUnavailableError) and exc.__context__ is not None:
        exc = exc.__context__
    orig = getattr(exc, "orig", None)
    return first_line(orig if isinstance(orig, BaseException) else exc)


def ride_out(start: Callable[[], None], url: URL, timeout: float,
             stopping: threading.Event) -> None:
    """Run `start`, again with backoff while the database at `url` cannot be reached, for
    `timeout` seconds (or until `stopping` is set); then one sentence
    (`DatabaseUnavailableError`). One log line says it is waiting."""
    deadline = time.monotonic() + timeout
    delay = START_RETRY_FIRST
    while True:
        try:
            start()
            return
        except (DatabaseUnavailableError, *DB_ERRORS) as exc:
            if not isinstance(exc, DatabaseUnavailableError) and not is_transient(exc):
                raise  # a statement refused: trying again would not change that
            reason = _reason(exc)
            if any(fragment in reason for fragment in REFUSALS):
                # The server answered: trying again would not change its mind.
                raise DatabaseUnavailableError(mask_secrets(
                    f"the database at {describe_url(url)} refused the connection "
                    f"({reason}): check the user, password and database name in the URL"
                )) from None
            left = deadline - time.monotonic()
            if left <= 0 or stopping.is_set():
                within = f" within {timeout:g} s of starting" if timeout else ""
                raise DatabaseUnavailableError(mask_secrets(
                    f"cannot reach the database at {describe_url(url)}{within} "
                    f"({reason}): check the URL (--database-url or FLOWQ_DATABASE_URL) "
                    "and that PostgreSQL is running")) from None
            if delay == START_RETRY_FIRST:
                log_event(WARNING, "database unreachable at start; trying again",
                          error=mask_secrets(reason), for_s=timeout)
            stopping.wait(min(delay, left))
            delay = min(delay * 2, DB_BACKOFF_MAX)
