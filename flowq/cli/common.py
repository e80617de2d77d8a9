"""What every `flowq` command shares: the options, the error handler, and the small helpers.

- `url_option`, `schema_option`: `--database-url` (default: FLOWQ_DATABASE_URL, then
  DATABASE_URL, via `require_url`) and `--schema` (default "flowq").
- The error handler (`user_errors`, run around every command by `FlowqGroup`, the class of
  the root command): a flowq error or a failed connection becomes `UserError`, one sentence
  on stderr with exit code 2 and no traceback. Every message click prints goes through
  `flowq.db.mask_secrets`, so none carries a password: not ours, not a driver's passed
  through, not click's own usage errors (which echo a misplaced value, a URL say).
- `load_app("module:attr")`, `open_engine(url, schema)`.

Command modules import this one; it imports none of them.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys
from collections.abc import Iterator
from typing import IO, Any, Final

import click
import sqlalchemy as sa

from flowq.app import FlowQ
from flowq.db import create_engine, mask_secrets, resolve_url
from flowq.db.checks import ensure_schema
from flowq.db.schema import DEFAULT_SCHEMA
from flowq.errors import ConfigurationError, FlowqError
from flowq.storable import first_line

__all__ = ["FlowqGroup", "UserError", "load_app", "open_engine", "require_url",
           "schema_option", "url_option", "user_errors"]

USER_ERROR_EXIT: Final = 2

url_option = click.option(
    "--database-url", "database_url", metavar="URL", default=None,
    help="PostgreSQL URL (default: $FLOWQ_DATABASE_URL, then $DATABASE_URL).")
schema_option = click.option("--schema", default=DEFAULT_SCHEMA, show_default=True,
                             help="PostgreSQL schema holding flowq's tables.")


class UserError(click.ClickException):
    """An error the user can fix: one sentence on stderr, passwords hidden, exit code 2."""

    exit_code = USER_ERROR_EXIT

    def __init__(self, message: str) -> None:
        super().__init__(mask_secrets(message))


class _RenderedError(UserError):
    """A click error as click would print it (usage line and hint too), passwords hidden."""

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(self.message, file=file, err=file is None, nl=False)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn flowq errors and failed connections into `UserError`; mask every click message."""
    try:
        yield
    except click.ClickException as exc:
        # click's usage errors quote the offending value: a URL given as an argument, say.
        rendered = io.StringIO()
        exc.show(file=rendered)
        if mask_secrets(rendered.getvalue()) == rendered.getvalue():
            raise
        raise _RenderedError(rendered.getvalue()) from None
    except FlowqError as exc:
        raise UserError(str(exc)) from None
    except sa.exc.DBAPIError as exc:
        # Any operational failure, and whatever the driver refused before a statement was
        # sent (a bad connection option in the URL); a failing statement keeps its traceback.
        if exc.statement is not None and not isinstance(exc, sa.exc.OperationalError):
            raise
        raise UserError(f"cannot reach the database: {first_line(exc.orig or exc)}. Check --database-url and that "
                        "PostgreSQL is running.") from None


class FlowqGroup(click.Group):
    """A click group whose parsing and commands (subcommands included) run in `user_errors`."""

    def make_context(self, info_name: str | None, args: list[str],
                     parent: click.Context | None = None, **extra: Any) -> click.Context:
        with user_errors():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        with user_errors():
            return super().invoke(ctx)


def require_url(database_url: str | None) -> str:
    """`--database-url`, else FLOWQ_DATABASE_URL, else DATABASE_URL; a UserError if none."""
    url = resolve_url(database_url)
    if not url:
        raise FlowqError("no database given: pass --database-url postgresql://... or set "
                         "FLOWQ_DATABASE_URL.")
    return url


def open_engine(database_url: str | None, schema: str) -> sa.Engine:
    """An engine on the command's database, checked to be reachable and migrated."""
    engine = create_engine(require_url(database_url))
    try:
        ensure_schema(engine, schema)
    except BaseException:
        engine.dispose()
        raise
    return engine


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
