"""The memory scenario (opt-in): worker RSS over a drain of a million no-op jobs.

The jobs (`Options.memory_n`: 1,000,000 unless `--jobs` is given) are enqueued first, in
chunks of `memory_chunk` rows per `enqueue_many` statement, then real `flowq worker`
processes (P from the options) drain them while a sampler reads each worker process's resident
set size every `memory_sample_every` seconds, along with how many jobs are done. Reported:
RSS once 10% of the jobs are done (warm: imports, pools, prepared statements and thread
stacks all in place) against RSS at the end and the peak, per process; the ratio end/warm
should stay ~1.0 (the issue's target: no growth beyond noise).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

import flowq
from flowq_bench.app import noop
from flowq_bench.drains import DRAIN_TIMEOUT, engine_for, wait_drained
from flowq_bench.harness import Server, WorkerGroup
from flowq_bench.options import Options
from flowq_bench.report import Figure, Row

__all__ = ["memory", "rss_mb"]

WARM_FRACTION: Final = 0.10
# Live rows are in flowq.jobs; finished ones (with their finished_at) in flowq.job_history.
_LEFT = sa.text("SELECT (SELECT count(*) FROM flowq.jobs WHERE status = 'pending') "
                "+ (SELECT count(*) FROM flowq.jobs WHERE status = 'running')")
_SPAN = sa.text("SELECT extract(epoch FROM max(finished_at) - min(finished_at))::float8 "
                "FROM flowq.job_history")


def rss_mb(pid: int) -> float | None:
    """Resident set size of `pid` in MiB (/proc on Linux, `ps` elsewhere); None if gone."""
    status = Path(f"/proc/{pid}/status")
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except FileNotFoundError:
        if Path("/proc/self/status").exists():
            return None  # Linux, and the process is gone
    except OSError:
        return None
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True,
                         check=False).stdout.strip()
    return int(out) / 1024 if out else None


def _enqueue(engine: sa.Engine, n: int, chunk: int) -> float:
    """`n` noop jobs, `chunk` rows per enqueue_many (one transaction each); seconds taken."""
    make = sessionmaker(engine, class_=flowq.Session)
    t = time.perf_counter()
    for lo in range(0, n, chunk):
        with make.begin() as s:
            s.enqueue_many(noop, [{"n": i} for i in range(lo, min(n, lo + chunk))])
    return time.perf_counter() - t


def _sample(engine: sa.Engine, workers: WorkerGroup, n: int, start: float
            ) -> dict[str, Any]:
    with engine.connect() as c:
        left = int(c.execute(_LEFT).scalar_one())
    rss = {pid: mb for pid in workers.pids() if (mb := rss_mb(pid)) is not None}
    return {"t": round(time.monotonic() - start, 2), "done": n - left,
            "rss_mb": {str(pid): round(mb, 2) for pid, mb in rss.items()}}


def memory(server: Server, o: Options) -> list[Row]:
    n = o.memory_n
    samples: list[dict[str, Any]] = []
    with server.fresh_database() as url:
        engine = engine_for(url)
        try:
            enqueue_s = _enqueue(engine, n, o.memory_chunk)
            with WorkerGroup(url, processes=o.processes, concurrency=o.concurrency) as workers:
                start = time.monotonic()
                workers.wait_ready(engine)
                deadline = time.monotonic() + DRAIN_TIMEOUT
                while True:
                    samples.append(_sample(engine, workers, n, start))
                    if samples[-1]["done"] >= n:
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"timed out after {DRAIN_TIMEOUT:.0f}s waiting "
                                           f"for {n:,} jobs to drain")
                    time.sleep(o.memory_sample_every)
                wait_drained(engine, n, 0.0)
                time.sleep(min(1.0, o.memory_sample_every))  # the last batch settled
                samples.append(_sample(engine, workers, n, start))
            with engine.connect() as c:
                span = float(c.execute(_SPAN).scalar_one() or 0.0)
        finally:
            engine.dispose()
    warm = next((s for s in samples if s["done"] >= WARM_FRACTION * n and s["rss_mb"]),
                samples[-1])
    end = samples[-1]
    pids = sorted(set(warm["rss_mb"]) & set(end["rss_mb"]))
    restarted = sorted({p for s in samples for p in s["rss_mb"]} - set(pids))
    peak = {p: max(s["rss_mb"].get(p, 0.0) for s in samples) for p in pids}
    per_process = [{"pid": int(p), "warm_mb": warm["rss_mb"][p], "end_mb": end["rss_mb"][p],
                    "max_mb": peak[p], "end_over_warm": end["rss_mb"][p] / warm["rss_mb"][p]}
                   for p in pids]
    # The largest process stands for all P (they do the same work); every one is in `extra`.
    worst = max(per_process, key=lambda r: float(r["end_over_warm"]), default=None)
    warm_mb = [float(worst["warm_mb"])] if worst else []
    pc = f"P={o.processes} C={o.concurrency}"
    extra = {"jobs": n, "enqueue_s": round(enqueue_s, 1), "drain_s": round(span, 1),
             "jobs_per_s": round(n / span) if span else None, "warm_at_done": warm["done"],
             "processes": per_process, "restarted_pids": restarted, "series": samples}
    note = (f"{n:,} no-op jobs through `flowq worker` {pc}, drained in {span:.1f}s; "
            f"RSS sampled every {o.memory_sample_every:g}s; target: end/warm ~1.0 (flat)")
    if restarted:
        note += f"; worker pids changed during the run: {restarted}"
    return [
        Row("memory", Figure(f"worker RSS at the end of {n:,} jobs ({pc})", "MB",
                             [float(worst["end_mb"])] if worst else [], False),
            [Figure(f"RSS after the first {WARM_FRACTION:.0%} (warm)", "MB", warm_mb, False)],
            note=note, extra=extra),
        Row("memory", Figure("worker RSS peak during the drain", "MB",
                             [float(worst["max_mb"])] if worst else [], False),
            [Figure(f"RSS after the first {WARM_FRACTION:.0%} (warm)", "MB", warm_mb, False)]),
    ]
