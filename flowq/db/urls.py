"""Database URLs and engines: which URL to use, how to parse it, how to print it safely.

URLs come from `--database-url`, else `FLOWQ_DATABASE_URL`, else `DATABASE_URL` (`flowq demo`
and `flowq bench` take only the option). Any PostgreSQL URL works: `postgresql://`,
`postgres://` and every `+driver` variant mean psycopg 3 (`normalize_url`); `create_engine`
makes an engine of one, with pre-ping, optionally safe behind PgBouncer.

No message flowq prints or raises carries a password: `mask_secrets` hides them in any text
(URLs, malformed ones included, libpq `password=` settings, `?password=` parameters), and
`normalize_url`, `describe_url`, `flowq.db.checks.ensure_schema` and the CLI's error handler
go through it.
"""

from __future__ import annotations

import os
import re
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

from flowq.errors import FlowqError

__all__ = [
    "MASK",
    "PGBOUNCER_CONNECT_ARGS",
    "URL_ENV_VARS",
    "create_engine",
    "describe_url",
    "mask_secrets",
    "normalize_url",
    "resolve_url",
]

URL_ENV_VARS = ("FLOWQ_DATABASE_URL", "DATABASE_URL")

MASK: Final = "***"  # what SQLAlchemy's render_as_string(hide_password=True) shows


# `scheme://user:` and the password up to the last '@' of its whitespace-free run: printed
# URLs are the malformed ones, whose password may hold '@', ':' or '/', so the mask errs
# towards hiding a host too.
_URL_PASSWORD: Final = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/?#]*:)\S*@")
# The same with a password holding spaces: up to the next '@' of the line.
_URL_PASSWORD_SPACES: Final = re.compile(
    r"(\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/?#]*:)(?!\*\*\*@)(?:(?!://)[^@\n])*@")
_QUERY_PASSWORD: Final = re.compile(r"([?&;](?:ssl)?password=)[^&#\s]*", re.IGNORECASE)
# libpq key/value conninfo (`password=secret`, `password = 'se cret'`) and PGPASSWORD=;
# a value already masked is left alone, or masking twice would eat a closing `"`.
_KEYWORD_PASSWORD: Final = re.compile(
    r"(?<![?&;\w])((?:ssl|pg)?password\s*=\s*)(?!\*\*\*(?:[\s\"]|$))"
    r"(?:'(?:[^'\\]|\\.)*'?|(?:[^\s'\\]|\\.)+)",
    re.IGNORECASE)
# A mapping's repr or JSON: 'password': 'secret'.
_MAPPING_PASSWORD: Final = re.compile(
    r"""(['"](?:ssl|pg)?password['"]\s*:\s*)(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^\s,}]+)""",
    re.IGNORECASE)
# The user-info part exactly as SQLAlchemy's URL parser takes it (`make_url`).
_SA_USERINFO: Final = re.compile(r"[\w+]+://(?:[^:/]*(?::[^@]*)?@)?")


def mask_secrets(text: str) -> str:
    """`text` with every password in it replaced by `***`: in URLs (malformed ones too), in
    libpq key/value settings (`password=...`) and in `?password=` query parameters."""
    text = _URL_PASSWORD.sub(rf"\1{MASK}@", text)
    text = _URL_PASSWORD_SPACES.sub(rf"\1{MASK}@", text)
    text = _QUERY_PASSWORD.sub(rf"\1{MASK}", text)
    text = _KEYWORD_PASSWORD.sub(rf"\1{MASK}", text)
    return _MAPPING_PASSWORD.sub(rf"\1{MASK}", text)


def normalize_url(url: str | URL) -> URL:
    """Parse `url`, mapping every PostgreSQL driver (`postgresql://`, `postgres://`,
    `+asyncpg`, `+psycopg2`, ...) to psycopg 3. A URL that is not one raises a FlowqError
    whose message shows it with its password hidden."""
    if isinstance(url, URL):
        u = url
    else:
        shown = mask_secrets(repr(url))
        userinfo = _SA_USERINFO.match(url)
        if userinfo and "@" in url[userinfo.end():].split("?", 1)[0]:
            # A second '@' (in a password, usually): the parser would take what follows the
            # first one for the host, and connection errors would print it.
            raise FlowqError(f"not a database URL: {shown} (write an '@' in a user name, "
                             "password or database name as %40)")
        try:
            u = make_url(url)
        except Exception as exc:
            # Safe to quote now: the password was split off where the user meant it to end.
            raise FlowqError(f"not a database URL: {shown} ({mask_secrets(str(exc))})"
                             ) from None
    driver = u.drivername.partition("+")[0]
    if driver not in ("postgresql", "postgres"):
        raise FlowqError(f"flowq needs PostgreSQL, not {u.drivername!r}: pass a postgresql:// URL")
    if u.drivername != "postgresql+psycopg":
        u = u.set(drivername="postgresql+psycopg")
    return u


def resolve_url(explicit: str | None) -> str | None:
    """The URL to use: the explicit one, else the environment's, else None."""
    if explicit:
        return explicit
    for var in URL_ENV_VARS:
        if os.environ.get(var):
            return os.environ[var]
    return None


def describe_url(url: str | URL) -> str:
    """The URL with its password hidden, for logs and messages."""
    try:
        return mask_secrets(normalize_url(url).render_as_string(hide_password=True))
    except FlowqError:
        return "<invalid URL>"


# What a psycopg connection through PgBouncer in transaction pooling mode needs: no
# server-side prepared statements, which psycopg otherwise makes of a statement run 5 times
# on a connection (they would stay on a server session that other clients get next).
PGBOUNCER_CONNECT_ARGS: Final = {"prepare_threshold": None}


def create_engine(url: str | URL, *, pgbouncer: bool = False, **kwargs: Any) -> sa.Engine:
    """A SQLAlchemy engine on psycopg 3, with pre-ping so a restarted server is survived;
    with `pgbouncer`, safe through PgBouncer in transaction mode (`PGBOUNCER_CONNECT_ARGS`)."""
    kwargs.setdefault("pool_pre_ping", True)
    if pgbouncer:
        kwargs["connect_args"] = {**kwargs.get("connect_args", {}), **PGBOUNCER_CONNECT_ARGS}
    return sa.create_engine(normalize_url(url), **kwargs)
