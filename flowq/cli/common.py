"""What the `flowq` commands share: the options, finding the database and the app, tables.

- `url_option`, `schema_option`: `--database-url` (default: FLOWQ_DATABASE_URL, then
  DATABASE_URL, via `require_url`) and `--schema` (default "flowq").
- `load_app("module:attr")`, `open_engine(url, schema)`.
- `table`, `age_cell`, `limits_cell`: tables for people (every command also has --json).
- `Phase`: the one line on stderr that says what a long command is doing.

The error handler (`user_errors`, `UserError`) lives in `flowq.cli.group`, with the root
group that runs it around every command. Command modules import this one; it imports none of
them, and it imports `flowq.app` (the whole API) only when `load_app` runs, so that a read
command such as `flowq status` imports what it reads with and no more; the database layer
(and so SQLAlchemy) is imported only when a command reaches the database, so that every
command's `--help` starts at once (tests/unit/test_cli_startup.py).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING

import click

from flowq.errors import ConfigurationError, DatabaseURLError
from flowq.names import DEFAULT_SCHEMA

if TYPE_CHECKING:
    import sqlalchemy as sa

    from flowq.define.app import FlowQ

__all__ = ["Phase", "age_cell", "limits_cell", "load_app", "open_engine", "require_url",
           "schema_option", "table", "url_option"]

url_option = click.option(
    "--database-url", "database_url", metavar="URL", default=None,
    help="PostgreSQL URL (default: $FLOWQ_DATABASE_URL, then $DATABASE_URL).")
schema_option = click.option("--schema", default=DEFAULT_SCHEMA, show_default=True,
                             help="PostgreSQL schema holding flowq's tables.")


def require_url(database_url: str | None) -> str:
    """`--database-url`, else FLOWQ_DATABASE_URL, else DATABASE_URL; a UserError if none."""
    from flowq.db import resolve_url

    url = resolve_url(database_url)
    if not url:
        raise DatabaseURLError("no database given: pass --database-url postgresql://... or set "
                         "FLOWQ_DATABASE_URL.")
    return url


def open_engine(database_url: str | None, schema: str) -> sa.Engine:
    """An engine on the command's database, checked to be reachable and migrated."""
    from flowq.db import create_engine
    from flowq.db.checks import ensure_schema

    engine = create_engine(require_url(database_url))
    try:
        ensure_schema(engine, schema)
    except BaseException:
        engine.dispose()
        raise
    return engine


def load_app(spec: str) -> FlowQ:
    """Import `module:attribute` (the cwd on sys.path) and return the FlowQ app it names.

    `module` alone names the module's one FlowQ app (the choice is said on stderr); a module
    with none or several is refused with the names it has."""
    from flowq.define.app import FlowQ, did_you_mean

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
    apps = sorted(name for name, value in vars(module).items() if isinstance(value, FlowQ))
    has = (f"{module_name} has {len(apps)} FlowQ app(s): "
           + ", ".join(f"{module_name}:{name}" for name in apps)) if apps else (
        f"{module_name} has no FlowQ app at its top level")
    if not attr:
        if len(apps) != 1:
            raise ConfigurationError(f"{spec!r} names a module, not an app: {has}; name one "
                                     "as MODULE:APP")
        click.echo(f"flowq: using {module_name}:{apps[0]}, the module's only FlowQ app.",
                   err=True)
        attr = apps[0]
    app = getattr(module, attr, None)
    if not isinstance(app, FlowQ):
        hint = did_you_mean(attr, apps)
        raise ConfigurationError(f"{spec!r} is not a flowq.FlowQ app: "
                                 f"{hint + ' ' if hint else ''}({has})")
    return app


# -- progress -------------------------------------------------------------------------------


class Phase:
    """One phase of a long command, said on stderr (stdout keeps the result, for scripts):
    its line when it starts (`flowq: retrying the dead runs that match, …`), redrawn in
    place with the count so far on a terminal (`update(n)`), ended by `done()`. Off a
    terminal (a log, a pipe, CliRunner) only the start line is written: one line per phase."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tty = sys.stderr.isatty()
        click.echo(f"flowq: {text} …", err=True, nl=not self.tty)

    def update(self, count: int, unit: str) -> None:
        if self.tty:
            click.echo(f"\rflowq: {self.text} … {count:,} {unit} so far\033[K", err=True,
                       nl=False)

    def done(self) -> None:
        if self.tty:
            click.echo("", err=True)


# -- formatting (tables for people; --json for scripts) -----------------------------------


def table(headers: list[str], rows: list[list[str]], indent: str = "") -> str:
    """`rows` under `headers`, each column as wide as its widest cell."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    return "\n".join(indent + "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True))
                     .rstrip() for line in [headers, *rows])


def age_cell(seconds: float | None) -> str:
    """A duration in seconds for a table cell, or '-'."""
    return "-" if seconds is None else f"{seconds:,.1f}s"


def limits_cell(concurrency: int | None, rate_limit: int | None,
                rate_period_s: float | None) -> str:
    """A queue's limits for a table cell: 'concurrency 5, 100/60s', or '-'."""
    parts = []
    if concurrency is not None:
        parts.append(f"concurrency {concurrency}")
    if rate_limit is not None and rate_period_s is not None:
        parts.append(f"{rate_limit}/{rate_period_s:g}s")
    return ", ".join(parts) or "-"
