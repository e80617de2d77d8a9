"""The worker: `Worker(app, url, WorkerConfig(...)).run()`, or `flowq worker MODULE:APP`."""

from __future__ import annotations

from flowq.worker.config import WorkerConfig
from flowq.worker.heartbeat import Heartbeat
from flowq.worker.pruner import Pruner
from flowq.worker.reaper import Reaper
from flowq.worker.registry import WorkerExpirer
from flowq.worker.services import Service
from flowq.worker.waits import WaitExpirer
from flowq.worker.worker import Worker

__all__ = ["Heartbeat", "Pruner", "Reaper", "Service", "WaitExpirer", "Worker", "WorkerConfig",
           "WorkerExpirer"]
