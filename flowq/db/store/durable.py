"""The verbs of a step's durable state: checkpoints, child runs, batches, run waiters."""

from __future__ import annotations

from flowq.db.store.base import Verbs

__all__ = ["DurableVerbs"]


class DurableVerbs(Verbs):
    """Checkpoints, children, batches and waiters."""
