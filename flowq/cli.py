"""The `flowq` command: migrate, worker, reap, prune, runs, demo, bench.

Every command takes `--database-url` (else FLOWQ_DATABASE_URL, else DATABASE_URL). Errors a
user can fix are printed as one sentence on stderr with exit code 2, never as a traceback.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import click
import sqlalchemy as sa

from flowq.app import FlowQ, validate_queue
from flowq.db import create_engine, ensure_schema, resolve_url
from flowq.errors import ConfigurationError, FlowqError, InvalidQueueError
from flowq.schema import DEFAULT_SCHEMA

__all__ = ["main"]

F = TypeVar("F", bound=Callable[..., Any])

url_option = click.option(
    "--database-url", "database_url", metavar="URL", default=None,
    help="PostgreSQL URL (default: $FLOWQ_DATABASE_URL, then $DATABASE_URL).")
schema_option = click.option("--schema", default=DEFAULT_SCHEMA, show_default=True,
                             help="PostgreSQL schema holding flowq's tables.")


def friendly_errors(fn: F) -> F:
    """Turn flowq and connection errors into one sentence and exit code 2."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FlowqError as exc:
            raise click.ClickException(str(exc)) from None
        except sa.exc.OperationalError as exc:
            first = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
            raise click.ClickException(
                f"cannot reach the database: {first}. Check --database-url and that "
                "PostgreSQL is running.") from None

    return wrapper  # type: ignore[return-value]


click.ClickException.exit_code = 2


def require_url(database_url: str | None) -> str:
    url = resolve_url(database_url)
    if not url:
        raise FlowqError("no database given: pass --database-url postgresql://... or set "
                         "FLOWQ_DATABASE_URL.")
    return url


def load_app(spec: str) -> FlowQ:
    """Import `module:attribute` (the cwd on sys.path) and return the FlowQ app it names."""
    module_name, _, attr = spec.partition(":")
    if not module_name:
        raise ConfigurationError(f"expected MODULE:APP (e.g. myapp.jobs:app), got {spec!r}")
    if module_name.startswith(".") or "/" in module_name or module_name.endswith(".py"):
        raise ConfigurationError(f"expected MODULE:APP with a dotted module name, not a path "
                                 f"(e.g. myapp.jobs:app), got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only when the missing module is the spec's module or one of its parents: a module
        # that exists but imports a missing dependency must show that real error.
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ConfigurationError(
                f"cannot import {module_name!r}: no such module (run from the directory that "
                "contains it, or install it)") from None
        raise
    if attr:
        app = getattr(module, attr, None)
    else:
        found = [v for v in vars(module).values() if isinstance(v, FlowQ)]
        app = found[0] if len(found) == 1 else None
    if not isinstance(app, FlowQ):
        raise ConfigurationError(f"{spec!r} is not a flowq.FlowQ app (expected MODULE:APP)")
    return app


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="flowq")
def main() -> None:
    """flowq: durable jobs and pipelines on PostgreSQL."""


@main.command()
@url_option
@schema_option
@click.option("--sql", is_flag=True, help="Print the DDL instead of running it.")
@friendly_errors
def migrate(database_url: str | None, schema: str, sql: bool) -> None:
    """Create or upgrade flowq's tables (idempotent)."""
    from flowq.migrations import migrate as run_migrate
    from flowq.migrations import sql_script

    if sql:
        click.echo(sql_script(schema=schema))
        return
    engine = create_engine(require_url(database_url))
    try:
        run_migrate(engine, schema=schema)
    finally:
        engine.dispose()
    click.echo(f"flowq schema {schema!r} is up to date.")


def _queues(value: str | None) -> list[str] | None:
    if value is None:
        return None
    names = [validate_queue(q.strip()) for q in value.split(",") if q.strip()]
    if not names:
        # An empty list would silently mean "every queue": refuse it instead.
        raise InvalidQueueError(f"--queues {value!r} names no queue: pass a,b or leave it out.")
    return names


@main.command()
@click.argument("app_spec", metavar="MODULE:APP")
@url_option
@click.option("--queues", default=None, help="Comma-separated queues (default: all the app's).")
@click.option("--concurrency", "-c", default=10, show_default=True, type=click.IntRange(1, 1000),
              help="Handlers run at once per process.")
@click.option("--processes", "-p", default=1, show_default=True, type=click.IntRange(1, 256),
              help="Worker processes to run under this command.")
@click.option("--poll-interval", default=5.0, show_default=True, type=click.FloatRange(0.01),
              help="Seconds between polls, the safety net for missed notifications.")
@click.option("--no-listen", is_flag=True, help="Poll only (e.g. behind PgBouncer in "
              "transaction mode, which cannot LISTEN).")
@click.option("--shutdown-grace", default=25.0, show_default=True, type=click.FloatRange(0),
              help="Seconds running handlers get to finish after SIGTERM.")
@click.option("--stale-after", default=30.0, show_default=True, type=click.FloatRange(0.1),
              help="Heartbeat age after which a running job is requeued by the reaper.")
@click.option("--heartbeat-interval", default=5.0, show_default=True,
              type=click.FloatRange(0.05))
@click.option("--reap-interval", default=10.0, show_default=True, type=click.FloatRange(0.05))
@click.option("--no-maintenance", is_flag=True, help="Do not reap or prune from this worker.")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text",
              show_default=True)
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.option("--job-log/--no-job-log", default=True, show_default=True,
              help="Log a line per succeeded job (failures are always logged).")
@friendly_errors
def worker(app_spec: str, database_url: str | None, queues: str | None, concurrency: int,
           processes: int, poll_interval: float, no_listen: bool, shutdown_grace: float,
           stale_after: float, heartbeat_interval: float, reap_interval: float,
           no_maintenance: bool, log_format: str, log_level: str, job_log: bool) -> None:
    """Run the jobs of MODULE:APP until SIGTERM/SIGINT."""
    from flowq.worker import Worker, WorkerConfig
    from flowq.worker.logs import configure_logging

    configure_logging("json" if log_format == "json" else "text", log_level)
    url = require_url(database_url)
    app = load_app(app_spec)
    config = WorkerConfig(queues=_queues(queues), concurrency=concurrency,
                          poll_interval=poll_interval, listen=not no_listen,
                          shutdown_grace=shutdown_grace, stale_after=stale_after,
                          heartbeat_interval=heartbeat_interval, reap_interval=reap_interval,
                          maintenance=not no_maintenance, job_log=job_log)
    w = Worker(app, url, config)
    ensure_schema(w.engines["claim"], app.schema)
    if processes > 1:
        # Checked above, once: a bad app, option or database would otherwise make every child
        # exit at start and the supervisor restart them forever.
        from flowq.worker.supervisor import supervise

        for engine in w.engines.values():
            engine.dispose()
        sys.exit(supervise(processes))
    w.run()


@main.command()
@url_option
@schema_option
@click.option("--stale-after", default=30.0, show_default=True, type=click.FloatRange(0.0))
@friendly_errors
def reap(database_url: str | None, schema: str, stale_after: float) -> None:
    """Requeue (or bury) running jobs whose worker stopped heartbeating; one pass."""
    from flowq.queries import Queries
    from flowq.worker.maintenance import Reaper

    engine = create_engine(require_url(database_url))
    ensure_schema(engine, schema)
    n = Reaper(engine, Queries(schema), stale_after=stale_after).run_once()
    click.echo(f"reaped {n} job(s).")


@main.command()
@url_option
@schema_option
@click.option("--retention", default=3 * 86400.0, show_default=True,
              type=click.FloatRange(0.0), help="Seconds to keep finished runs.")
@click.option("--dead-retention", default=14 * 86400.0, show_default=True,
              type=click.FloatRange(0.0), help="Seconds to keep runs with a dead step.")
@friendly_errors
def prune(database_url: str | None, schema: str, retention: float, dead_retention: float
          ) -> None:
    """Delete runs that finished longer ago than the retention; one pass."""
    from flowq.queries import Queries
    from flowq.worker.maintenance import Pruner

    engine = create_engine(require_url(database_url))
    ensure_schema(engine, schema)
    n = Pruner(engine, Queries(schema), retention=retention,
               dead_retention=dead_retention, max_batches=1_000_000).run_once()
    click.echo(f"pruned {n} row(s).")


@main.command()
@url_option
@click.option("--jobs", "n_jobs", default=2000, show_default=True, type=click.IntRange(10))
@friendly_errors
def demo(database_url: str | None, n_jobs: int) -> None:
    """Show transactional enqueue and a worker on an embedded PostgreSQL (or --database-url)."""
    from flowq.demo import run_demo

    run_demo(resolve_url(database_url), n_jobs=n_jobs)


def _register_subcommands() -> None:
    from flowq.cli_runs import runs

    main.add_command(runs)


_register_subcommands()


@click.command()
@url_option
@click.option("--scenario", "scenarios", multiple=True, metavar="NAME",
              help="Run only this scenario (repeatable): drain, drain-session, pipeline, "
              "enqueue, latency, scale, soak, memory. Default: all but soak and memory.")
@click.option("--jobs", "n_jobs", type=click.IntRange(1), default=None,
              help="Jobs per drain (pipeline: steps; memory: the whole drain) "
              "[default: 50000, memory 1000000; --quick: 300].")
@click.option("--processes", "-p", type=click.IntRange(1, 64), default=None,
              help="Worker processes (and raw loop processes) [default: 2].")
@click.option("--concurrency", "-c", type=click.IntRange(1, 1000), default=None,
              help="Handlers per worker process [default: 128, drain-session 8; --quick: 8].")
@click.option("--repeat", type=click.IntRange(1), default=None,
              help="Runs per figure; the table shows median and min-max [default: 3].")
@click.option("--duration", type=click.FloatRange(1.0), default=None,
              help="Seconds the soak runs [default: 600].")
@click.option("--quick", is_flag=True, help="Tiny sizes and one run: checks it works.")
@click.option("--json", "json_out", is_flag=True, help="Print JSON instead of the table.")
@click.option("--json-file", type=click.Path(dir_okay=False), default=None,
              help="Also write the JSON to this file.")
@friendly_errors
def bench(database_url: str | None, scenarios: tuple[str, ...], n_jobs: int | None,
          processes: int | None, concurrency: int | None, repeat: int | None,
          duration: float | None, quick: bool, json_out: bool, json_file: str | None) -> None:
    """Benchmark flowq against raw-SQL references on --database-url or an embedded server.

    Every figure is measured beside its reference in the same run, on the same database;
    the embedded server (the default) is durable (fsync on). Creates and drops one database
    per scenario, so the role needs CREATEDB.
    """
    import json

    from flowq.bench import DEFAULT_SCENARIOS, SCENARIOS, Options, run_bench

    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise click.UsageError(f"unknown scenario {unknown[0]!r}; choose from "
                               f"{', '.join(SCENARIOS)}")
    options = Options.quick() if quick else Options()
    for knob, value in (("jobs", n_jobs), ("processes", processes),
                        ("concurrency", concurrency), ("repeat", repeat),
                        ("duration", duration)):
        if value is not None:
            setattr(options, knob, value)
    table, doc = run_bench(resolve_url(database_url), scenarios or DEFAULT_SCENARIOS, options,
                           progress=lambda m: click.echo(m, err=True))
    if json_file:
        with open(json_file, "w") as f:
            json.dump(doc, f, indent=2)
    click.echo(json.dumps(doc, indent=2) if json_out else table)


main.add_command(bench)
