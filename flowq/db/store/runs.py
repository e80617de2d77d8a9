"""The verbs of runs and their history: inspection, listing, cancel, retry, fork, redrive."""

from __future__ import annotations

from flowq.db.store.base import Verbs

__all__ = ["RunVerbs"]


class RunVerbs(Verbs):
    """Runs as operators read and act on them."""
