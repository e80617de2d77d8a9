"""The verbs of `flowq.queues` outside a claim: declarations, pauses, listings, metrics."""

from __future__ import annotations

from flowq.db.store.base import Verbs

__all__ = ["QueueVerbs"]


class QueueVerbs(Verbs):
    """Queues as configuration and as counts."""
