"""The worker: `Worker(app, url, WorkerConfig(...)).run()`, or `flowq worker MODULE:APP`."""

from __future__ import annotations

from flowq.worker.core import Worker, WorkerConfig
from flowq.worker.maintenance import Heartbeat, Pruner, Reaper

__all__ = ["Heartbeat", "Pruner", "Reaper", "Worker", "WorkerConfig"]
