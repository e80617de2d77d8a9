"""`python -m flowq_bench.worker`: one bench worker whose pruner retention can be set (soak).

`flowq worker` does not expose the pruner's retention (days, by default), so the soak runs
this instead: the same `Worker` class `flowq worker` runs, on `flowq_bench.app:app`, with
`--retention` and `--prune-interval`. It accepts the options `WorkerGroup` passes
(`--queues` included).
"""

from __future__ import annotations

import argparse

from flowq.worker import Worker, WorkerConfig
from flowq.worker.logs import configure_logging
from flowq_bench.app import app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flowq_bench.worker")
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--processes", type=int, default=1, choices=[1])
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--queues", default=None)
    parser.add_argument("--no-job-log", action="store_true")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--retention", type=float, default=60.0)
    parser.add_argument("--prune-interval", type=float, default=10.0)
    ns = parser.parse_args(argv)
    configure_logging("text", ns.log_level)
    queues = [q for q in ns.queues.split(",") if q] if ns.queues else None
    config = WorkerConfig(queues=queues, concurrency=ns.concurrency, job_log=not ns.no_job_log,
                          retention=ns.retention, prune_interval=ns.prune_interval)
    Worker(app, ns.database_url, config).run()


if __name__ == "__main__":
    main()
