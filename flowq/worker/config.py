"""Worker configuration: `WorkerConfig`, every knob of a worker with its default, validated.

The defaults, one home for each (the services and the CLI read them from here):

- `DEFAULT_CONCURRENCY` 10 handlers at once.
- `DEFAULT_POLL_INTERVAL` 5 s: a due job starts within 5 s even without NOTIFY.
- `DEFAULT_HEARTBEAT_INTERVAL` 5 s between heartbeats of a worker (its registry entry, and
  the jobs it holds).
- `DEFAULT_STALE_AFTER` 30 s: a running job whose heartbeat and whose worker's registry entry
  are both older is reaped; an entry older is removed.
- `DEFAULT_REAP_INTERVAL` 10 s between reaper passes (and the waits' and registry's expiry),
  so with the defaults a job whose worker died is running again well within 60 s.
- `DEFAULT_PRUNE_INTERVAL` 60 s between pruner passes, which delete runs finished more than
  `DEFAULT_RETENTION` (3 days) ago, `DEFAULT_DEAD_RETENTION` (14 days) for a run with a dead
  step.
- `DEFAULT_SHUTDOWN_GRACE` 25 s for running handlers to finish after SIGTERM.
- `DEFAULT_START_TIMEOUT` 10 s: how long a starting worker tries again (with backoff) to
  reach a database that is unreachable, before it stops with one sentence (0: once only).
"""

from __future__ import annotations

import math
import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Final

from flowq.errors import ConfigurationError

__all__ = ["DEFAULT_CONCURRENCY", "DEFAULT_DEAD_RETENTION", "DEFAULT_HEARTBEAT_INTERVAL",
           "DEFAULT_POLL_INTERVAL", "DEFAULT_PRUNE_INTERVAL", "DEFAULT_REAP_INTERVAL",
           "DEFAULT_RETENTION", "DEFAULT_SHUTDOWN_GRACE", "DEFAULT_STALE_AFTER",
           "DEFAULT_START_TIMEOUT", "WorkerConfig"]

DEFAULT_CONCURRENCY: Final = 10
DEFAULT_POLL_INTERVAL: Final = 5.0
DEFAULT_HEARTBEAT_INTERVAL: Final = 5.0
DEFAULT_STALE_AFTER: Final = 30.0
DEFAULT_REAP_INTERVAL: Final = 10.0
DEFAULT_PRUNE_INTERVAL: Final = 60.0
DEFAULT_RETENTION: Final = 3 * 86400.0
DEFAULT_DEAD_RETENTION: Final = 14 * 86400.0
DEFAULT_SHUTDOWN_GRACE: Final = 25.0
DEFAULT_START_TIMEOUT: Final = 10.0

# Knobs that are intervals (positive) and durations (zero allowed), in seconds.
_INTERVALS: Final = ("poll_interval", "heartbeat_interval", "stale_after", "reap_interval",
                     "prune_interval")
_DURATIONS: Final = ("shutdown_grace", "retention", "dead_retention", "start_timeout")


def _default_name() -> str:
    return f"{socket.gethostname()[:24]}:{os.getpid()}:{uuid.uuid4().hex[:4]}"


@dataclass
class WorkerConfig:
    """Every knob of a worker, with its default."""

    queues: list[str] | None = None  # None: every queue the app's tasks and steps use
    concurrency: int = DEFAULT_CONCURRENCY
    poll_interval: float = DEFAULT_POLL_INTERVAL
    listen: bool = True
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    stale_after: float = DEFAULT_STALE_AFTER
    reap_interval: float = DEFAULT_REAP_INTERVAL
    prune_interval: float = DEFAULT_PRUNE_INTERVAL
    retention: float = DEFAULT_RETENTION
    dead_retention: float = DEFAULT_DEAD_RETENTION
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE
    start_timeout: float = DEFAULT_START_TIMEOUT
    job_log: bool = True
    maintenance: bool = True
    schedules: bool = True  # run the app's periodic schedules (every worker may: no leader)
    # Prometheus metrics (flowq.worker.metrics, extra flowq[metrics]): served on the first free port
    # of metrics_port .. metrics_port + metrics_ports - 1 (0: any free port); None: off.
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    metrics_ports: int = 1
    # PgBouncer in transaction pooling mode between the worker and PostgreSQL (see
    # flowq.worker.worker); listen_url: a direct (or session-pooled) URL to LISTEN on, since
    # LISTEN cannot go through such a pooler (None: with pgbouncer, poll only).
    pgbouncer: bool = False
    listen_url: str | None = None
    # Jobs claimed beyond the free handlers: None sizes it from the measured rate (see
    # flowq.worker.producer), 0 turns it off, N caps it at N.
    claim_ahead: int | None = None
    name: str = field(default_factory=_default_name)

    def validate(self) -> None:
        """Raise a one-sentence `ConfigurationError` naming the first knob out of range."""
        if self.concurrency < 1:
            raise ConfigurationError("concurrency must be at least 1")
        if self.claim_ahead is not None and (
                isinstance(self.claim_ahead, bool) or not isinstance(self.claim_ahead, int)
                or self.claim_ahead < 0):
            raise ConfigurationError(f"claim_ahead must be None (automatic) or an integer of "
                                     f"at least 0, got {self.claim_ahead!r}")
        for knob in _INTERVALS:
            value = getattr(self, knob)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigurationError(f"{knob} must be a positive number of seconds, got "
                                         f"{value!r}")
        for knob in _DURATIONS:
            value = getattr(self, knob)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ConfigurationError(f"{knob} must be a number of seconds, got {value!r}")
        if self.stale_after <= 2 * self.heartbeat_interval:
            raise ConfigurationError(
                "stale_after must exceed twice heartbeat_interval, or live jobs get reaped")
        if self.metrics_port is not None and not (
                self.metrics_port >= 0 and self.metrics_ports >= 1
                and self.metrics_port + self.metrics_ports - 1 <= 65535):
            raise ConfigurationError(f"metrics_port must be a TCP port (0 to 65535), got "
                                     f"{self.metrics_port!r}")
