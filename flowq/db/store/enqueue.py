"""The enqueue's verbs: runs and jobs inserted, idempotency and unique keys, signals, batches."""

from __future__ import annotations

from flowq.db.store.base import Verbs

__all__ = ["EnqueueVerbs"]


class EnqueueVerbs(Verbs):
    """Enqueue, signals and batches: what a producer's transaction writes."""
