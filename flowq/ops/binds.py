"""Engine or Connection: how every operation of `flowq.ops` takes the database.

An Engine gives the operation a connection (and a transaction) of its own. A Connection is
joined: a write joins its open transaction, which the caller commits; on a Connection not in
a transaction the write begins one and commits it itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import sqlalchemy as sa

__all__ = ["Bind", "read", "transaction"]

T = TypeVar("T")
Bind = sa.Engine | sa.Connection



@contextmanager
def transaction(bind: Bind) -> Iterator[sa.Connection]:
    """A connection in a transaction for a write (see the module docstring)."""
    if isinstance(bind, sa.Engine):
        with bind.begin() as conn:
            yield conn
        return
    # The caller's open transaction stays theirs to commit; one begun here is committed here.
    began_here = not bind.in_transaction()
    yield bind
    if began_here and bind.in_transaction():
        bind.commit()


def read(bind: Bind, fn: Callable[[sa.Connection], T]) -> T:
    """`fn(connection)` on a connection of `bind` (an Engine's own, or the Connection)."""
    if isinstance(bind, sa.Engine):
        with bind.connect() as conn:
            return fn(conn)
    return fn(bind)
