"""What the `flowq` commands share: the options, finding the database and the app, tables.

- `url_option`, `schema_option`: `--database-url` (default: FLOWQ_DATABASE_URL, then
  DATABASE_URL, via `require_url`) and `--schema` (default "flowq").
- `app_parameters`: the one way every command that uses an app names it: `MODULE:APP` after
  the command (where a command has no other argument), `--app MODULE:APP` on every such
  command, else the environment variable FLOWQ_APP. The command receives `app_spec`.
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

import functools
import importlib
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

import click

from flowq.errors import ConfigurationError, DatabaseURLError
from flowq.names import DEFAULT_SCHEMA

if TYPE_CHECKING:
    import sqlalchemy as sa

    from flowq.define.app import FlowQ

__all__ = ["APP_ENV", "Phase", "age_cell", "app_parameters", "limits_cell", "load_app",
           "open_engine", "require_url", "resolve_app", "schema_option", "table", "url_option"]

# The environment variable that names the app when the command line does not.
APP_ENV: Final = "FLOWQ_APP"

F = TypeVar("F", bound=Callable[..., Any])

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


def resolve_app(positional: str | None, option: str | None, *, required: bool,
                command: str) -> str | None:
    """The app a command names: its `MODULE:APP` argument or `--app` (the same one if both),
    else FLOWQ_APP; None if none and not `required`, else one sentence naming each way."""
    if positional is not None and option is not None and positional != option:
        raise ConfigurationError(f"the app is named twice, as {positional!r} and as --app "
                                 f"{option!r}: name it once")
    spec = positional or option or os.environ.get(APP_ENV) or None
    if spec is None and required:
        raise ConfigurationError(f"no app given: name it as `flowq {command} MODULE:APP` (e.g. "
                                 f"myapp.jobs:app), with --app MODULE:APP, or in {APP_ENV}")
    return spec


def app_parameters(purpose: str, *, positional: bool = True,
                   required: bool = False) -> Callable[[F], F]:
    """Add the app's parameters to a command: `[MODULE:APP]` (when `positional`) and `--app
    MODULE:APP`, resolved by `resolve_app` into the keyword `app_spec` the command receives.

    One decorator for every command, so that each names the app the same three ways and says
    so in the same words; `purpose` opens the `--app` help (what the command does with it)."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)  # keeps the params the decorators below it declared
        def command(*args: Any, app_argument: str | None = None,
                    app_option: str | None = None, **kwargs: Any) -> Any:
            name = click.get_current_context().info_name or "COMMAND"
            return fn(*args, app_spec=resolve_app(app_argument, app_option, required=required,
                                                  command=name), **kwargs)

        wrapped = click.option(
            "--app", "app_option", metavar="MODULE:APP", default=None,
            help=f"{purpose}: MODULE:APP, e.g. myapp.jobs:app (MODULE alone: its only FlowQ "
                 f"app) [env {APP_ENV}].")(command)
        if positional:
            wrapped = click.argument("app_argument", metavar="[MODULE:APP]",
                                     required=False)(wrapped)
        return cast(F, wrapped)

    return decorate


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
