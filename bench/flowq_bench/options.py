"""What `flowq bench` was asked to do: sizes, process counts, repeats; defaults and --quick.

Also the bounds of the options given on the command line as numbers of seconds, rates and
rows (`BOUNDS`), and `bounded`, which holds a value a user typed to them: NaN, infinities,
zero, negatives, denormals such as 1e-320 and sizes no run could finish are refused with one
sentence, before anything starts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Final

from flowq.define.workflows import MAX_MAP_ITEMS

__all__ = ["BOUNDS", "DEFAULT_SCENARIOS", "OPT_IN", "SCENARIOS", "Bound", "Options", "bounded"]

SCENARIOS: Final = ("drain", "drain-session", "pipeline", "dag", "map", "map-session",
                    "limit", "rate", "enqueue", "latency", "scale", "soak", "memory",
                    "pressure", "overload", "checkpoint", "sleep", "indexes")
# soak runs for --duration (default 10 minutes) and memory drains a million jobs, so both are
# opt-in: --scenario soak, --scenario memory. limit and rate take 1.5-2 minutes each at default
# size (three drains or windows of each kind, one kind being a 15 s cap or a 10 s window, and
# their worker start-ups), so they are opt-in too.
# pressure runs four phases of --pressure-phase (30 s) and then drains what piled up;
# overload eight phases of --overload-phase (20 s) and the backlogs they leave (5-10 min).
# checkpoint (ten commits per job: flowq's and a raw loop's) is opt-in, a durable-execution
# figure beside the throughput ones; so is sleep (N runs of one durable sleep each, beside N
# delayed no-op jobs).
# indexes fills 10,000,000 rows (--rows) before its EXPLAINs: minutes, and gigabytes.
OPT_IN: Final = ("limit", "rate", "soak", "memory", "pressure", "overload", "checkpoint",
                 "sleep", "indexes")
DEFAULT_SCENARIOS: Final = tuple(s for s in SCENARIOS if s not in OPT_IN)


@dataclass(frozen=True)
class Bound:
    """What a command-line number may be: `unit` from `low` to `high`, both included."""

    unit: str
    low: float
    high: float
    integer: bool = False

    def describe(self) -> str:
        def num(x: float) -> str:
            return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"

        return f"{self.unit} from {num(self.low)} to {num(self.high)}"


# Phases of at least half a second (the producer enqueues every 20 ms and each phase's edges
# are read from the database), of at most an hour (the open snapshot is held for 2
# and 10 minutes); rates one worker could be offered; business tables that fit on a laptop
# (10,000,000 rows are about 1.3 GB).
BOUNDS: Final = {
    "--pressure-phase": Bound("seconds", 0.5, 3_600.0),
    "--pressure-rate": Bound("jobs per second", 1.0, 100_000.0),
    "--pressure-rows": Bound("rows", 1, 10_000_000, integer=True),
    "--overload-phase": Bound("seconds", 0.5, 3_600.0),
    "--duration": Bound("seconds", 1.0, 86_400.0),
    # A sleep long enough to be one (the worker's timers are in milliseconds), and at most
    # an hour: the scenario waits for it twice per repeat.
    "--sleep-seconds": Bound("seconds", 0.1, 3_600.0),
}


def bounded(option: str, text: str) -> float:
    """`text`, typed to `option`, as a number within `BOUNDS[option]` (an int for rows); a
    ValueError saying in one sentence what the option takes otherwise."""
    bound = BOUNDS[option]
    wanted = f"expected {'a whole number of ' if bound.integer else ''}{bound.describe()}"
    try:
        value = float(text.strip().replace("_", ""))
    except (ValueError, AttributeError):
        raise ValueError(f"{wanted}, got {text!r}.") from None
    # NaN compares false with everything: test that the value is inside, never outside.
    if not (bound.low <= value <= bound.high) or (bound.integer and not value.is_integer()):
        raise ValueError(f"{wanted}, got {text!r}.")
    return int(value) if bound.integer else value


@dataclass
class Options:
    """Every knob of a bench run, with its default (see `quick()` for the tiny sizes)."""

    jobs: int = 50_000            # drain, drain-session, pipeline and dag (steps), scale drains
    processes: int = 2
    # No-op handlers finish at once, so the claim batch (about half the slots) sets the pace:
    # 128 slots per process measured best on a 2-core machine (32: 10.5k jobs/s, 128: 21k).
    concurrency: int = 128
    # drain: flowq at each of these concurrencies, beside the same references (C=128 is what
    # suits no-op handlers, C=16 what people run); -c, when given, replaces the list.
    drain_concurrency: tuple[int, ...] = (16, 128)
    # drain-session holds one ctx.session connection per running handler (2 x 128 would be
    # ~270 server connections) and each job is its own transaction, so fewer threads do
    # better: P=2, 30k jobs: C=4 1,099 jobs/s, C=8 1,653, C=16 1,456, C=32 1,349.
    session_concurrency: int = 8
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
    memory_jobs: int = 1_000_000  # memory: jobs drained (an explicit --jobs overrides it)
    memory_chunk: int = 50_000    # memory: rows per enqueue_many statement
    memory_sample_every: float = 2.0  # memory: seconds between RSS samples
    map_items: int = 10_000       # map: items of the one run (an explicit --jobs overrides it)
    queue_limit: int = 50         # limit: the queue's global concurrency (drains of `jobs`)
    # limit: a drain still running after this many seconds is cut there and its rate is the
    # jobs done by then / the cap (a limited queue's workers wait for their next poll, 5 s,
    # between claims: at N = 50,000 the drain would otherwise take about 40 minutes).
    limit_timeout: float = 15.0
    rate_limit: int = 200         # rate: the queue's Rate(rate_limit, per=1s) ...
    rate_window: float = 10.0     # ... drained for this many seconds
    pressure_rate: float = 2_000.0  # pressure: jobs/s offered to one worker ...
    pressure_c: int = 16          # ... of this concurrency,
    pressure_phase: float = 30.0  # ... for this many seconds per phase,
    pressure_rows: int = 300_000  # ... beside a business table of this many rows
    # overload: one worker's peak drain of this many no-op jobs (P=1, C=16: -c overrides),
    overload_peak_jobs: int = 20_000
    overload_concurrency: int = 16
    # ... then these multiples of that peak offered by a fixed-rate producer, for this
    # many seconds each, with the worker in its own process and in the producer's.
    overload_multiples: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
    overload_phase: float = 20.0
    # sleep: this many runs (an explicit --jobs overrides it) each ctx.sleep(sleep_seconds)
    # once, on one worker process of sleep_concurrency slots (-c overrides it), beside as
    # many no-op jobs delayed by sleep_seconds.
    sleep_runs: int = 2_000
    sleep_seconds: float = 1.0
    sleep_concurrency: int = 8
    index_rows: int = 10_000_000  # indexes: finished rows retained (issue 21's size)
    # `jobs` and `concurrency` as built: memory and drain-session follow them once changed
    # (--jobs, -c), and otherwise use their own defaults above.
    _initial: tuple[int, int] = field(default=(0, 0), init=False, repr=False, compare=False)
    _drain_explicit: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._initial = (self.jobs, self.concurrency)

    @property
    def memory_n(self) -> int:
        """Jobs the memory scenario drains: `--jobs` if it was given, else `memory_jobs`."""
        return self.jobs if self.jobs != self._initial[0] else self.memory_jobs

    @property
    def map_n(self) -> int:
        """Items the map scenario maps over: `--jobs` if it was given, else `map_items`; at
        most `flowq.define.workflows.MAX_MAP_ITEMS` (what one `flowq.each` may hold)."""
        n = self.jobs if self.jobs != self._initial[0] else self.map_items
        return max(1, min(n, MAX_MAP_ITEMS))

    @property
    def session_c(self) -> int:
        """drain-session's concurrency: `-c` if it was given, else `session_concurrency`."""
        return (self.concurrency if self.concurrency != self._initial[1]
                else self.session_concurrency)

    @property
    def overload_c(self) -> int:
        """overload's concurrency: `-c` if it was given, else `overload_concurrency`."""
        return (self.concurrency if self.concurrency != self._initial[1]
                else self.overload_concurrency)

    @property
    def sleep_n(self) -> int:
        """Runs the sleep scenario sleeps: `--jobs` if it was given, else `sleep_runs`."""
        return self.jobs if self.jobs != self._initial[0] else self.sleep_runs

    @property
    def sleep_c(self) -> int:
        """sleep's concurrency: `-c` if it was given, else `sleep_concurrency`."""
        return (self.concurrency if self.concurrency != self._initial[1]
                else self.sleep_concurrency)

    def set_drain_concurrency(self, cs: tuple[int, ...]) -> None:
        """`--drain-c`: the drain runs flowq at each of `cs`, whatever `-c` says."""
        self.drain_concurrency = cs
        self._drain_explicit = True

    @property
    def drain_cs(self) -> tuple[int, ...]:
        """The drain's concurrencies: `--drain-c` if given, else `-c` alone if it was given,
        else `drain_concurrency`."""
        if self._drain_explicit:
            return tuple(dict.fromkeys(self.drain_concurrency))
        if self.concurrency != self._initial[1] or not self.drain_concurrency:
            return (self.concurrency,)
        return tuple(dict.fromkeys(self.drain_concurrency))

    @classmethod
    def quick(cls) -> Options:
        return cls(jobs=300, processes=2, concurrency=8, drain_concurrency=(4, 8), repeat=1,
                   bulk=1_000, transactions=50, latency_jobs=20, rate=50.0, retained=5_000, pending=1_000,
                   claims=300, scale_processes=(1, 2), duration=10.0, soak_retention=2.0,
                   sample_every=1.0, session_concurrency=8, memory_jobs=2_000,
                   memory_chunk=500, memory_sample_every=0.2, map_items=300,
                   queue_limit=4, limit_timeout=5.0, rate_limit=50, rate_window=3.0,
                   pressure_rate=200.0, pressure_c=8, pressure_phase=2.0, pressure_rows=20_000,
                   overload_peak_jobs=300, overload_concurrency=8, overload_phase=1.0,
                   sleep_runs=50, sleep_seconds=0.5, sleep_concurrency=4,
                   index_rows=20_000)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["_initial"]
        del d["_drain_explicit"]
        return {**d, "memory_n": self.memory_n, "session_c": self.session_c,
                "map_n": self.map_n, "drain_cs": list(self.drain_cs),
                "overload_c": self.overload_c, "sleep_n": self.sleep_n,
                "sleep_c": self.sleep_c}
