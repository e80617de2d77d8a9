"""The verbs of `flowq.workers` and the definitions they serve: registry, deploys, stranded jobs."""

from __future__ import annotations

from flowq.db.store.base import Verbs

__all__ = ["WorkerVerbs"]


class WorkerVerbs(Verbs):
    """Workers, their registry and what they serve."""
