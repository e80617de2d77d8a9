"""The `flowq` command: migrate, worker, reap, prune, runs, signal, queues, schedules, demo,
bench, status, doctor, deploy-check, dashboard.

One module per group of commands: `migrate`, `worker`, `maintenance` (reap, prune), `runs`,
`signals` (signal), `queues`, `schedules`, `status`, `doctor`, `deploy`, `dashboard`, `demo`,
and `bench` (which runs the separate flowq-bench distribution, or says how to get it), each
importing `common` (options, helpers) and `group` (the error handler). Imports go one way: this package names the
command modules and assembles `main` (the `flowq` entry point and `python -m flowq`); nothing
imports it back.

`COMMANDS` names each command's module and its one-line help; `FlowqGroup` imports a
command's module only when that command runs or shows its own help, so `flowq --version` and
`flowq --help` import neither SQLAlchemy nor psycopg (tests/unit/test_cli_startup.py checks both,
and that each line of help here is the command's own).

Every command that uses an app names it the same way (`flowq.cli.common.app_parameters`):
`MODULE:APP` after the command where it takes no other argument, `--app MODULE:APP` on every
one, else FLOWQ_APP; `worker` and `deploy-check` need one, the others use it when given.

Every command takes `--database-url` (else FLOWQ_DATABASE_URL, else DATABASE_URL), except
`demo` and `bench`, which use only the option, else an embedded server. Errors a user can fix
are printed as one sentence on stderr with exit code 2, never as a traceback, and no message
carries a password.
"""

from __future__ import annotations

from typing import Final

import click

from flowq import __version__
from flowq.cli.group import FlowqGroup

__all__ = ["COMMANDS", "main"]

# name -> ("module:attr", the command's short help as `flowq --help` lists it).
COMMANDS: Final[dict[str, tuple[str, str]]] = {
    "bench": ("flowq.cli.bench:bench",
              "Benchmark flowq against raw-SQL references on --database-url or an embedded "
              "server."),
    "dashboard": ("flowq.cli.dashboard:dashboard",
                  "Serve the web dashboard: queues, workers, runs, dead letters (read-only by "
                  "default)."),
    "demo": ("flowq.cli.demo:demo",
             "Show transactional enqueue and a worker on an embedded PostgreSQL (or "
             "--database-url)."),
    "deploy-check": ("flowq.cli.deploy:deploy_check",
                     "Check that MODULE:APP's code can continue every run in flight; exit 1 "
                     "if not."),
    "doctor": ("flowq.cli.doctor:doctor",
               "Check schema version, table health, long transactions, autovacuum, LISTEN, "
               "pooler and clock skew; say what to do about each finding."),
    "migrate": ("flowq.cli.migrate:migrate", "Create or upgrade flowq's tables (idempotent)."),
    "prune": ("flowq.cli.maintenance:prune",
              "Delete runs that finished longer ago than the retention; one pass."),
    "queues": ("flowq.cli.queues:queues",
               "List queues (depth, running, limits, paused); pause or resume one."),
    "reap": ("flowq.cli.maintenance:reap",
             "Requeue (or bury) running jobs whose worker stopped heartbeating; one pass."),
    "runs": ("flowq.cli.runs:runs",
             "Inspect and control runs (a run is a task's or pipeline's chain of steps)."),
    "schedules": ("flowq.cli.schedules:schedules",
                  "List periodic schedules: spec, time zone, next tick, last run."),
    "signal": ("flowq.cli.signals:signal_command",
               "Send signal NAME to run RUN_ID: the step waiting for it runs with --payload."),
    "status": ("flowq.cli.status:status_command",
               "Show queues, live workers, dead jobs by task and due jobs no worker serves."),
    "worker": ("flowq.cli.worker:worker",
               "Run the jobs of MODULE:APP until SIGTERM/SIGINT (MODULE alone: its only FlowQ "
               "app)."),
}


@click.group(cls=FlowqGroup, lazy_commands=COMMANDS,
             context_settings={"help_option_names": ["-h", "--help"]})
# flowq.__version__ rather than the installed metadata: importlib.metadata costs a third of
# a light start-up, and tests/unit/test_cli_startup.py checks the two agree.
@click.version_option(__version__, package_name="flowq")
def main() -> None:
    """flowq: durable jobs and pipelines on PostgreSQL."""
