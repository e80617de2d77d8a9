"""The maintenance loops a worker runs with `WorkerConfig.maintenance` (default on), built
from its options by `maintenance_loops`: the `Reaper` (stale heartbeats, run deadlines,
batches), the `WaitExpirer` (signal waits past their timeout) and the `WorkerExpirer`
(registry entries), every `reap_interval`, and the `Pruner` (retention, history's day
partitions) every `prune_interval`. Each pass takes its own advisory lock, so across all
workers one pass of a kind runs at a time; each loop sends through the maintenance pool.

They first run soon after a start (a worker that restarts after a crash reaps its
predecessor's jobs), the prune a little later; staggered (`FIRST_REAP` 1 s, `FIRST_WAITS`
1.2 s, `FIRST_EXPIRY` 1.4 s, `FIRST_PRUNE` 5 s), so that passes of the same interval take
turns on one pooled connection rather than open one each.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Final

import sqlalchemy as sa

from flowq.worker.config import WorkerConfig
from flowq.worker.pruner import Pruner
from flowq.worker.reaper import Reaper
from flowq.worker.registry import WorkerExpirer
from flowq.worker.waits import WaitExpirer

__all__ = ["FIRST_EXPIRY", "FIRST_PRUNE", "FIRST_REAP", "FIRST_WAITS", "MaintenanceLoops",
           "maintenance_loops"]

FIRST_REAP: Final = 1.0
FIRST_WAITS: Final = 1.2
FIRST_EXPIRY: Final = 1.4
FIRST_PRUNE: Final = 5.0


@dataclass(frozen=True)
class MaintenanceLoops:
    """A worker's maintenance loops, in the order they start."""

    reaper: Reaper
    waits: WaitExpirer
    expirer: WorkerExpirer
    pruner: Pruner


def maintenance_loops(engine: sa.Engine, schema: str, c: WorkerConfig,
                      stopping: threading.Event) -> MaintenanceLoops:
    """The loops of worker options `c` on `engine` for `schema`, stopped by `stopping`."""
    return MaintenanceLoops(
        Reaper(engine, schema, stale_after=c.stale_after, interval=c.reap_interval,
               first_delay=FIRST_REAP, stopping=stopping),
        WaitExpirer(engine, schema, interval=c.reap_interval, first_delay=FIRST_WAITS,
                    stopping=stopping),
        # The reaper's limit: a running job is alive while its worker's entry beats.
        WorkerExpirer(engine, schema, stale=c.stale_after, interval=c.reap_interval,
                      first_delay=FIRST_EXPIRY, stopping=stopping),
        Pruner(engine, schema, retention=c.retention, dead_retention=c.dead_retention,
               interval=c.prune_interval, first_delay=FIRST_PRUNE, stopping=stopping))
