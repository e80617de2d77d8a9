"""The `flowq` command: migrate, worker, reap, prune, runs, queues, schedules, demo, bench,
status, doctor, dashboard.

One module per group of commands: `migrate`, `worker`, `maintenance` (reap, prune), `runs`
and `demo` (demo, bench), each importing only `common` (options, the error handler,
helpers). Imports go one way: this package imports the command modules and assembles
`main` (the `flowq` entry point and `python -m flowq`); nothing imports it back.

Every command takes `--database-url` (else FLOWQ_DATABASE_URL, else DATABASE_URL), except
`demo` and `bench`, which use only the option, else an embedded server. Errors a user can fix
are printed as one sentence on stderr with exit code 2, never as a traceback, and no message
carries a password.
"""

from __future__ import annotations

import click

from flowq.cli import dashboard as dashboard_cli
from flowq.cli import demo, maintenance, migrate, queues, runs, schedules, worker
from flowq.cli import doctor as doctor_cli
from flowq.cli import status as status_cli
from flowq.cli.common import FlowqGroup

__all__ = ["main"]


@click.group(cls=FlowqGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="flowq")
def main() -> None:
    """flowq: durable jobs and pipelines on PostgreSQL."""


for _command in (migrate.migrate, worker.worker, maintenance.reap, maintenance.prune,
                 runs.runs, queues.queues, schedules.schedules, demo.demo, demo.bench,
                 status_cli.status_command, doctor_cli.doctor, dashboard_cli.dashboard):
    main.add_command(_command)
