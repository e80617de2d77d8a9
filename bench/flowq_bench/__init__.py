"""`flowq bench`: flowq's throughput and latency beside raw-SQL references, in one invocation.

The flowq-bench distribution (the repository's `bench/` folder), kept out of the flowq wheel;
`make bench` installs it beside flowq, whose `flowq bench` command then runs `cli.bench`.

Scenarios (see `options.SCENARIOS`): drain (flowq at C=16 and C=128 beside raw 1/tx, raw
batched-100 and raw batched-100 on a minimal table of its own, with WAL bytes per job),
drain-session, pipeline, dag (diamond runs with a join), map (one run mapping N items, then a join), map-session (a map whose instances
write through ctx.session, beside the same rows as plain tasks), limit (a drain under a queue's global
concurrency limit beside the same drain unlimited), rate (a rate-limited queue's achieved
start rate and burst), enqueue, latency, scale, and the opt-in
soak (it runs for `--duration`), memory (worker RSS over a 1M-job drain), pressure (a
steady load beside an open snapshot and a scanning reader, phase by phase) and overload (one
worker offered 0.5x to 4x its peak, in its own process and in the producer's), checkpoint
(jobs of ten checkpoints beside a raw loop) and sleep (N runs of one durable sleep beside N
delayed no-op jobs, on one worker) and indexes (every feature statement EXPLAINed over
10,000,000 retained rows: exits 1 when one is not index-served).
Each runs in a fresh database on one server: the one at `--database-url`, or a fresh
embedded PostgreSQL with durable defaults (fsync on); FLOWQ_DATABASE_URL and DATABASE_URL are
never read. The bench drops only the databases it created (see `harness`).
flowq's side always goes through real `flowq worker` processes running `flowq_bench.app:app`;
the references are hand-written psycopg loops on the same table, same process count, measured
in the same run, because absolute numbers drift from machine to machine and ratios do not.

Modules: `options` (sizes and defaults), `harness` (server, databases, worker processes),
`baselines` (raw loops), `drains` (timing a drain), `scenarios`, `limits`, `rate`, `producers`,
`memory`, `pressure`, `overload` and `sleep` (the scenarios), `load` (fixed-rate load in phases, read
back from the job rows: pressure's and overload's), `report` (table and JSON), `app` (the bench's handlers),
`worker` (soak worker), `progress` (each scenario and repeat as it starts), `cli` (the
command's options).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from flowq_bench.options import DEFAULT_SCENARIOS, SCENARIOS, Options

if TYPE_CHECKING:
    from flowq_bench.harness import Server
    from flowq_bench.report import Row

__all__ = ["DEFAULT_SCENARIOS", "SCENARIOS", "Options", "run_bench"]


# Everything but the options is imported when a run starts, so that `flowq bench --help`
# (which imports this package for its command) loads neither SQLAlchemy nor psycopg.


def _registry() -> dict[str, Callable[[Server, Options], list[Row]]]:
    from flowq_bench import (
        indexes,
        limits,
        memory,
        overload,
        pressure,
        producers,
        rate,
        scenarios,
        sleep,
    )

    return {"drain": scenarios.drain, "drain-session": scenarios.drain_session,
            "pipeline": scenarios.pipeline, "dag": scenarios.dag, "map": scenarios.map_run,
            "map-session": scenarios.map_session,
            "limit": limits.limit, "rate": rate.rate, "enqueue": producers.enqueue,
            "latency": producers.latency, "scale": scenarios.scale, "soak": producers.soak,
            "memory": memory.memory, "pressure": pressure.pressure,
            "overload": overload.overload, "checkpoint": scenarios.checkpoint,
            "sleep": sleep.sleep, "indexes": indexes.indexes}


def run_bench(url: str | None, names: Sequence[str], options: Options,
              progress: Callable[[str], None] = lambda _: None,
              server_settings: dict[str, str] | None = None, *,
              tty: bool = False) -> tuple[str, dict[str, Any]]:
    """Run the scenarios `names` on the server at `url` (None: a fresh embedded one); the
    printable table and the JSON document. `progress` is given each scenario and each repeat
    as they start (text with its line ends: `flowq_bench.progress`; `tty`: a bar redrawn in
    place)."""
    from flowq import tracing
    from flowq_bench.harness import open_server
    from flowq_bench.progress import Progress, reporting
    from flowq_bench.report import render_table, to_json

    registry = _registry()
    rows: list[Row] = []
    # Tracing off here too (enqueue scenarios), as in the workers (see `WorkerGroup`).
    traced, tracing.ENABLED = tracing.ENABLED, False
    try:
        with reporting(Progress(progress, tty=tty, scenarios=len(names))) as said, \
                open_server(url, server_settings) as server:
            machine = server.machine()
            for name in names:
                said.scenario(name)
                rows.extend(registry[name](server, options))
    finally:
        tracing.ENABLED = traced
    return (render_table(machine, rows, options.repeat),
            to_json(machine, {**options.as_dict(), "scenarios": list(names)}, rows))
