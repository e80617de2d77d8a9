"""What every family of verbs stands on: a runner, the schema's statements, its channel.

`Verbs` holds the three; each family module (`claims`, `enqueue`, `runs`, ...) extends it
with the verbs of its tables, and `flowq.db.store.Store` is all of them at once.
"""

from __future__ import annotations

from flowq.db.runner import Runner
from flowq.db.schema import notify_channel
from flowq.db.sql import Queries, queries
from flowq.names import DEFAULT_SCHEMA

__all__ = ["Verbs"]


class Verbs:
    """Typed verbs sending through `run` for the flowq schema `schema`."""

    def __init__(self, run: Runner, schema: str = DEFAULT_SCHEMA) -> None:
        self.run = run
        self.q: Queries = queries(schema)
        self.channel = notify_channel(self.q.schema)

    @property
    def schema(self) -> str:
        """The flowq schema these verbs send to."""
        return self.q.schema
