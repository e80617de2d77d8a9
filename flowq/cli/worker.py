"""`flowq worker MODULE:APP`: run an app's jobs until SIGTERM/SIGINT.

The app is named as for every command (`flowq.cli.common.app_parameters`): `MODULE:APP`,
`--app MODULE:APP`, or FLOWQ_APP.

Options and defaults are those of `flowq.worker.WorkerConfig` (`--concurrency 10`,
`--processes 1`, `--poll-interval 5`, `--shutdown-grace 25`, `--stale-after 30`, ...), with
`--database-url` (default: FLOWQ_DATABASE_URL, then DATABASE_URL). The app, the options and
the database are checked before anything starts, so a mistake is one sentence, not a crash
loop of `--processes` children.

`--metrics-port PORT` (extra `flowq[metrics]`) serves Prometheus metrics on `--metrics-addr`
(default 127.0.0.1); with `--processes N` each child serves its own on the first free port of
PORT .. PORT+N-1 (all N are checked before any child starts). See docs/observability.md.

`--pgbouncer` makes every connection safe behind PgBouncer in transaction pooling mode (no
startup options, no prepared statements, no LISTEN, no session advisory lock); it polls,
unless `--listen-url URL` names a direct connection to LISTEN on. See docs/operations.md.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Final

import click

from flowq.cli.common import app_parameters, load_app, require_url, url_option
from flowq.cli.group import UserError
from flowq.errors import InvalidQueueError
from flowq.names import validate_queue

if TYPE_CHECKING:
    from flowq.define.app import FlowQ

__all__ = ["worker"]

# Set by a `--processes N` command for its children: how many metrics ports they share.
METRICS_PORTS_ENV: Final = "FLOWQ_METRICS_PORTS"


def _metrics_ports(processes: int) -> int:
    """How many consecutive metrics ports this process may pick from: a `--processes N`
    child (started by a supervisor) any of the N; otherwise its own one."""
    from flowq.worker.supervisor import SUPERVISOR_ENV

    shared = os.environ.get(METRICS_PORTS_ENV, "")
    if processes == 1 and os.environ.get(SUPERVISOR_ENV) and shared.isdigit():
        return max(1, int(shared))
    return 1


def _queues(value: str | None) -> list[str] | None:
    if value is None:
        return None
    names = [validate_queue(q.strip()) for q in value.split(",") if q.strip()]
    if not names:
        # An empty list would silently mean "every queue": refuse it instead.
        raise InvalidQueueError(f"--queues {value!r} names no queue: pass a,b or leave it out.")
    return names


def _warn_unused_queues(app: FlowQ, queues: list[str] | None) -> None:
    """Say so when --queues names a queue none of the app's tasks and steps use: legitimate
    (a job enqueued with queue=), but more often a typo, which would serve nothing."""
    from flowq.define.app import did_you_mean

    for name in queues or ():
        if name not in app.queues:
            hint = did_you_mean(name, app.queues)
            click.echo(f"flowq: warning: no task or step of the app uses queue {name!r}"
                       f"{': ' + hint if hint else ''} (the app's queues: "
                       f"{', '.join(app.queues) or 'none'})", err=True)


@click.command()
@app_parameters("The app whose jobs to run", required=True)
@url_option
@click.option("--queues", default=None, help="Comma-separated queues (default: all the app's).")
@click.option("--concurrency", "-c", default=10, show_default=True, type=click.IntRange(1, 1000),
              help="Handlers run at once per process.")
@click.option("--claim-ahead", default=None, type=click.IntRange(0), metavar="N",
              help="Claim at most N jobs beyond the free handlers (default: sized from the "
              "rate handlers finish at, to what starts within 20 ms; 0: off).")
@click.option("--processes", "-p", default=1, show_default=True, type=click.IntRange(1, 256),
              help="Worker processes to run under this command.")
@click.option("--poll-interval", default=5.0, show_default=True, type=click.FloatRange(0.01),
              help="Seconds between polls, the safety net for missed notifications.")
@click.option("--no-listen", is_flag=True, help="Poll only (e.g. behind PgBouncer in "
              "transaction mode, which cannot LISTEN).")
@click.option("--pgbouncer", is_flag=True, help="The database URL goes through PgBouncer in "
              "transaction pooling mode: no session state on any connection; poll only "
              "unless --listen-url.")
@click.option("--listen-url", default=None, metavar="URL",
              help="LISTEN on this URL (a direct connection to PostgreSQL) instead of the "
              "database URL; with --pgbouncer it also collects the queue metrics.")
@click.option("--shutdown-grace", default=25.0, show_default=True, type=click.FloatRange(0),
              help="Seconds running handlers get to finish after SIGTERM.")
@click.option("--start-timeout", default=10.0, show_default=True, type=click.FloatRange(0),
              help="Seconds a starting worker keeps trying to reach an unreachable database "
              "(with backoff) before it stops with an error; 0: try once.")
@click.option("--stale-after", default=30.0, show_default=True, type=click.FloatRange(0.1),
              help="Heartbeat age after which a running job is requeued by the reaper.")
@click.option("--heartbeat-interval", default=5.0, show_default=True,
              type=click.FloatRange(0.05),
              help="Seconds between heartbeats of the jobs this worker holds (--stale-after "
              "must exceed twice it).")
@click.option("--reap-interval", default=10.0, show_default=True, type=click.FloatRange(0.05),
              help="Seconds between passes of the reaper (and of the waits' and the worker "
              "registry's expiry).")
@click.option("--no-maintenance", is_flag=True, help="Do not reap or prune from this worker.")
@click.option("--no-schedules", is_flag=True,
              help="Do not enqueue the app's periodic schedules from this worker.")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text",
              show_default=True, help="Log lines as key=value text or as JSON objects.")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              help="The flowq logger's level.")
@click.option("--job-log/--no-job-log", default=True, show_default=True,
              help="Log a line per succeeded job (failures are always logged).")
@click.option("--metrics-port", default=None, type=click.IntRange(1, 65535),
              help="Serve Prometheus metrics on this port (needs flowq[metrics]; with "
              "--processes N, ports PORT to PORT+N-1).")
@click.option("--metrics-addr", default="127.0.0.1", show_default=True,
              help="Address the metrics port binds to.")
def worker(app_spec: str, database_url: str | None, queues: str | None, concurrency: int,
           processes: int, poll_interval: float, no_listen: bool, shutdown_grace: float,
           stale_after: float, heartbeat_interval: float, reap_interval: float,
           no_maintenance: bool, no_schedules: bool, log_format: str, log_level: str,
           job_log: bool, metrics_port: int | None, metrics_addr: str, pgbouncer: bool,
           listen_url: str | None, claim_ahead: int | None, start_timeout: float) -> None:
    """Run the jobs of MODULE:APP until SIGTERM/SIGINT (MODULE alone: its only FlowQ app)."""
    from flowq.worker import Worker, WorkerConfig
    from flowq.worker.logs import configure_logging

    configure_logging("json" if log_format == "json" else "text", log_level)
    if listen_url and no_listen:
        raise UserError("--listen-url and --no-listen contradict each other: pass one of them.")
    url = require_url(database_url)
    app = load_app(app_spec)
    _warn_unused_queues(app, _queues(queues))
    config = WorkerConfig(queues=_queues(queues), concurrency=concurrency,
                          poll_interval=poll_interval, listen=not no_listen,
                          shutdown_grace=shutdown_grace, start_timeout=start_timeout,
                          stale_after=stale_after,
                          heartbeat_interval=heartbeat_interval, reap_interval=reap_interval,
                          maintenance=not no_maintenance, schedules=not no_schedules,
                          job_log=job_log, metrics_port=metrics_port,
                          metrics_addr=metrics_addr, metrics_ports=_metrics_ports(processes),
                          pgbouncer=pgbouncer, listen_url=listen_url, claim_ahead=claim_ahead)
    w = Worker(app, url, config)
    w.check_database()
    if processes > 1:
        # Checked above, once: a bad app, option or database would otherwise make every child
        # exit at start and the supervisor restart them forever.
        from flowq.worker.supervisor import supervise

        for engine in w.engines.values():
            engine.dispose()
        if metrics_port is not None:
            from flowq.worker.metrics import check_ports_free

            check_ports_free(metrics_addr, range(metrics_port, metrics_port + processes))
            os.environ[METRICS_PORTS_ENV] = str(processes)  # the children inherit it
        sys.exit(supervise(processes))
    w.run()
