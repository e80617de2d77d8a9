"""The root of the `flowq` command: commands loaded on first use, and the error handler.

- `FlowqGroup`: a click group that knows its commands as `name -> ("module:attr", short
  help)` and imports a command's module only when that command runs, completes or shows its
  own help. `flowq --help` lists the commands from the table's short help, so `--help` and
  `--version` import no command module, and with them no SQLAlchemy, psycopg or alembic
  (tests/unit/test_cli_startup.py holds both to that, and the table's help to the real commands').
  Parsing and every command (subcommands included) run in `user_errors`.
- `user_errors`: a flowq error or a failed connection becomes `UserError`, one sentence on
  stderr with exit code 2 and no traceback. Every message click prints goes through
  `flowq.db.mask_secrets`, so none carries a password: not ours, not a driver's passed
  through, not click's own usage errors (which echo a misplaced value, a URL say).

At import time this module needs only click, the standard library and `flowq.errors`:
`flowq.db` (SQLAlchemy) is imported when there is a message to mask (a usage error too, so a
bare `flowq`, whose help click prints as one, pays for it), and a database error can only
have been raised once a command has imported SQLAlchemy itself.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import sys
from collections.abc import Iterator, Mapping
from gettext import gettext
from typing import IO, Any, Final

import click

from flowq.errors import FlowqError

__all__ = ["USER_ERROR_EXIT", "FlowqGroup", "UserError", "user_errors"]

USER_ERROR_EXIT: Final = 2


def _mask_secrets(text: str) -> str:
    """`flowq.db.mask_secrets`, imported when a message is printed rather than at start-up."""
    from flowq.db import mask_secrets as mask

    return mask(text)


class UserError(click.ClickException):
    """An error the user can fix: one sentence on stderr, passwords hidden, exit code 2."""

    exit_code = USER_ERROR_EXIT

    def __init__(self, message: str) -> None:
        super().__init__(_mask_secrets(message))


class _RenderedError(UserError):
    """A click error as click would print it (usage line and hint too), passwords hidden."""

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(self.message, file=file, err=file is None, nl=False)


def _database_error(exc: BaseException) -> str | None:
    """What to print for a failed connection, or None if `exc` is no such error.

    Any operational failure, and whatever the driver refused before a statement was sent (a
    bad connection option in the URL); a failing statement keeps its traceback."""
    sa_exc = sys.modules.get("sqlalchemy.exc")
    if sa_exc is None or not isinstance(exc, sa_exc.DBAPIError):
        return None  # SQLAlchemy never imported: no database error can have happened
    if exc.statement is not None and not isinstance(exc, sa_exc.OperationalError):
        return None
    from flowq.storable import first_line

    return (f"cannot reach the database: {first_line(exc.orig or exc)}. Check --database-url "
            "and that PostgreSQL is running.")


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn flowq errors and failed connections into `UserError`; mask every click message."""
    try:
        yield
    except click.ClickException as exc:
        # click's usage errors quote the offending value: a URL given as an argument, say.
        rendered = io.StringIO()
        exc.show(file=rendered)
        if _mask_secrets(rendered.getvalue()) == rendered.getvalue():
            raise
        raise _RenderedError(rendered.getvalue()) from None
    except FlowqError as exc:
        raise UserError(str(exc)) from None
    except Exception as exc:
        message = _database_error(exc)
        if message is None:
            raise
        raise UserError(message) from None


class FlowqGroup(click.Group):
    """A click group whose commands load on first use and run in `user_errors`.

    `lazy_commands` maps each command name to `("module:attr", short help)`: the module is
    imported when the command is looked up to run (or to show its own help), and the short
    help is what `--help` lists without importing anything."""

    def __init__(self, *args: Any,
                 lazy_commands: Mapping[str, tuple[str, str]] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands: dict[str, tuple[str, str]] = dict(lazy_commands or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.lazy_commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy_commands:
            self.add_command(self.load_command(cmd_name), cmd_name)
        return self.commands.get(cmd_name)

    def load_command(self, name: str) -> click.Command:
        """Import the module of the lazy command `name` and return its click command."""
        spec = self.lazy_commands[name][0]
        module_name, _, attr = spec.partition(":")
        command = getattr(importlib.import_module(module_name), attr)
        if not isinstance(command, click.Command):
            raise TypeError(f"{spec} is not a click command")
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The commands and their short help, as click lists them, without loading any."""
        names = self.list_commands(ctx)
        rows: list[tuple[str, str]] = []
        limit = formatter.width - 6 - max((len(n) for n in names), default=0)
        for name in names:
            loaded = self.commands.get(name)
            if loaded is not None:
                if not loaded.hidden:
                    rows.append((name, loaded.get_short_help_str(limit)))
            else:
                # Shortened by click's own rule: a stand-in command carrying the table's help.
                stand_in = click.Command(name, help=self.lazy_commands[name][1])
                rows.append((name, stand_in.get_short_help_str(limit)))
        if rows:
            with formatter.section(gettext("Commands")):
                formatter.write_dl(rows)

    def make_context(self, info_name: str | None, args: list[str],
                     parent: click.Context | None = None, **extra: Any) -> click.Context:
        with user_errors():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        with user_errors():
            return super().invoke(ctx)
