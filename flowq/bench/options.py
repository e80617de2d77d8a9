"""What `flowq bench` was asked to do: sizes, process counts, repeats; defaults and --quick."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Final

__all__ = ["DEFAULT_SCENARIOS", "SCENARIOS", "Options"]

SCENARIOS: Final = ("drain", "drain-session", "pipeline", "enqueue", "latency", "scale", "soak")
# soak runs for --duration (default 10 minutes), so it is opt-in: --scenario soak.
DEFAULT_SCENARIOS: Final = SCENARIOS[:-1]


@dataclass
class Options:
    """Every knob of a bench run, with its default (see `quick()` for the tiny sizes)."""

    jobs: int = 50_000            # drain, drain-session, pipeline (steps), scale drains
    processes: int = 2
    # No-op handlers finish at once, so the claim batch (about half the slots) sets the pace:
    # 128 slots per process measured best on a 2-core machine (32: 10.5k jobs/s, 128: 21k).
    concurrency: int = 128
    repeat: int = 3
    bulk: int = 100_000           # enqueue: rows of the bulk enqueue_many
    transactions: int = 2_000     # enqueue: business transactions, with and without the job
    latency_jobs: int = 500       # latency: jobs enqueued one at a time ...
    rate: float = 50.0            # ... at this many per second (also the soak producer's rate)
    retained: int = 1_000_000     # scale: finished rows retained
    pending: int = 100_000        # scale: pending rows to claim from
    claims: int = 20_000          # scale: jobs claimed per measurement
    scale_processes: tuple[int, ...] = (1, 2, 4)
    duration: float = 600.0       # soak
    soak_retention: float = 60.0  # soak: pruner retention (seconds)
    sample_every: float = 10.0    # soak: seconds between samples

    @classmethod
    def quick(cls) -> Options:
        return cls(jobs=300, processes=2, concurrency=8, repeat=1, bulk=1_000,
                   transactions=50, latency_jobs=20, rate=50.0, retained=5_000, pending=1_000,
                   claims=300, scale_processes=(1, 2), duration=10.0, soak_retention=2.0,
                   sample_every=1.0)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
