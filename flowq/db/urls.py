"""Database URLs and engines: which URL to use, how to parse it, how to print it safely.

URLs come from `--database-url`, else `FLOWQ_DATABASE_URL`, else `DATABASE_URL` (`flowq demo`
and `flowq bench` take only the option). Any PostgreSQL URL works: `postgresql://`,
`postgres://` and every `+driver` variant mean psycopg 3 (`normalize_url`); `create_engine`
makes an engine of one, with pre-ping, optionally safe behind PgBouncer. Several hosts are
written either SQLAlchemy's way (`postgresql://user@/db?host=h1:5432&host=h2:5433`) or libpq's
(`postgresql://user@h1:5432,h2:5433/db`, rewritten to the former); `to_conninfo` turns any of
them into the libpq conninfo every psycopg connection flowq opens itself is given
(`host=h1,h2 port=5432,5433`; IPv6 `[::1]:5432` and unix-socket directories too).

No message flowq prints or raises carries a password: `mask_secrets` hides them in any text
(URLs, malformed ones included, libpq `password=` settings, `?password=` parameters), and
`normalize_url`, `describe_url`, `flowq.db.checks.ensure_schema` and the CLI's error handler
go through it. A URL that cannot be parsed is never quoted back, not even masked: the error
says what is wrong with it in flowq's own words.
"""

from __future__ import annotations

import os
import re
from typing import Any, Final
from urllib.parse import quote

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

from flowq.db.transient import leave_read_only_servers
from flowq.errors import DatabaseURLError, FlowqError

__all__ = [
    "MASK",
    "PGBOUNCER_CONNECT_ARGS",
    "URL_ENV_VARS",
    "create_engine",
    "describe_url",
    "mask_secrets",
    "normalize_url",
    "resolve_url",
    "to_conninfo",
]

URL_ENV_VARS = ("FLOWQ_DATABASE_URL", "DATABASE_URL")

MASK: Final = "***"  # what SQLAlchemy's render_as_string(hide_password=True) shows


# `scheme://user:` and the password up to the last '@' of its whitespace-free run: printed
# URLs are the malformed ones, whose password may hold '@', ':' or '/', so the mask errs
# towards hiding a host too.
# Schemes are short: bounding them keeps a long run of scheme-like text from being rescanned
# from each of its positions. Applied to a whitespace-free token up to its last '@' only
# (`_mask_url_password`), so that `\S*@` never scans a token's tail that holds no '@'.
_URL_PASSWORD: Final = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.\-]{0,31}://[^\s:/?#]*:)\S*@")
_TOKEN: Final = re.compile(r"\S+")
# The same with a password holding spaces: up to the next '@' of the line.
_URL_PASSWORD_SPACES: Final = re.compile(
    r"(\b[A-Za-z][A-Za-z0-9+.\-]{0,31}://[^\s:/?#]*:)(?!\*\*\*@)(?:(?!://)[^@\n])*@")
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
# The same with a password holding spaces after a scheme written wrong (`postgresql:`,
# `postgresql:/`, `postgresql//`): up to the next '@' of the line, within 256 characters
# (unbounded, a long line of colons would take quadratic time).
_CREDENTIALS_SPACES: Final = re.compile(
    r"(\b[A-Za-z][A-Za-z0-9+.\-]{0,31}(?::/{0,3}|//)[^\s:/?#@]+:)(?!\*\*\*@)[^@\n]{0,256}@")
_RUN: Final = re.compile(r"[^\s'\"]+")
# Where a user name may begin inside a run (besides its start).
_USER_START: Final = frozenset("(=,/")


def _mask_credentials(run: str) -> str:
    """Anything shaped like credentials, `user:password@`, in a whitespace-free run, whatever
    is left of a malformed URL (`postgresql//bob:pw@h`, `postgresql:bob:pw@h`, `bob:pw@h`):
    from the first ':' that ends a user name (no ':' or '@' in it) and does not start `://`, to
    the run's last '@'. It errs towards hiding: a host:port followed by an '@' later in a
    query string is masked too. One pass: a regex would backtrack quadratically."""
    at = run.rfind("@")
    if at < 0:
        return run
    user = True  # the characters since the user name's start hold no ':' or '@'
    for i in range(at):
        ch = run[i]
        if ch in _USER_START:
            user = True
        elif ch == "@":
            user = False
        elif ch == ":":
            if user and not run.startswith("//", i + 1) and not run.startswith(MASK + "@", i + 1):
                return run[:i + 1] + MASK + run[at:]
            user = False
    return run


# The user-info part exactly as SQLAlchemy's URL parser takes it (`make_url`).
_SA_USERINFO: Final = re.compile(r"[\w+]+://(?:[^:/]*(?::[^@]*)?@)?")


def _mask_url_password(token: re.Match[str]) -> str:
    """A URL's password in one whitespace-free token, masked up to the token's last '@'."""
    text = token.group()
    at = text.rfind("@") + 1
    if not at:
        return text
    return _URL_PASSWORD.sub(rf"\1{MASK}@", text[:at]) + text[at:]


def mask_secrets(text: str) -> str:
    """`text` with every password in it replaced by `***`: in URLs (malformed ones too), in
    libpq key/value settings (`password=...`) and in `?password=` query parameters."""
    text = _TOKEN.sub(_mask_url_password, text)
    text = _URL_PASSWORD_SPACES.sub(rf"\1{MASK}@", text)
    text = _CREDENTIALS_SPACES.sub(rf"\1{MASK}@", text)
    text = _RUN.sub(lambda m: _mask_credentials(m.group()), text)
    text = _QUERY_PASSWORD.sub(rf"\1{MASK}", text)
    text = _KEYWORD_PASSWORD.sub(rf"\1{MASK}", text)
    return _MAPPING_PASSWORD.sub(rf"\1{MASK}", text)


# What a malformed URL's error says instead of quoting it.
_URL_SHAPE: Final = "postgresql://user@host:port/database"
# scheme://[userinfo@]netloc[/database][?query], the netloc being what libpq allows: one host
# or a comma-separated list of them, each with its own port.
_LIBPQ_NETLOC: Final = re.compile(r"(?P<head>[\w+]+://(?:[^:/@]*(?::[^@]*)?@)?)"
                                  r"(?P<netloc>[^/?]*,[^/?]*)(?P<tail>[/?].*)?\Z", re.DOTALL)


def _sqlalchemy_hosts(url: str) -> str:
    """`url` with libpq's host list (`h1:5432,h2:5433`), which SQLAlchemy cannot parse,
    moved to SQLAlchemy's form of it (`?host=h1:5432&host=h2:5433`); other URLs unchanged."""
    m = _LIBPQ_NETLOC.match(url)
    if m is None:
        return url
    path, _, query = (m["tail"] or "").partition("?")
    hosts = "&".join(f"host={quote(h, safe=':[]%')}" for h in m["netloc"].split(","))
    return f"{m['head']}{path or '/'}?{hosts}{'&' + query if query else ''}"


def normalize_url(url: str | URL) -> URL:
    """Parse `url`, mapping every PostgreSQL driver (`postgresql://`, `postgres://`,
    `+asyncpg`, `+psycopg2`, ...) to psycopg 3; libpq's host list (`h1:5432,h2:5433`) becomes
    SQLAlchemy's (`?host=h1:5432&host=h2:5433`). A URL that is not one raises a DatabaseURLError
    that says what is wrong without quoting any of it."""
    if isinstance(url, URL):
        u = url
    else:
        if not re.match(r"[\w+]+://", url):
            raise DatabaseURLError(f"not a database URL: it must start with a scheme and '://' and "
                             f"look like {_URL_SHAPE}")
        url = _sqlalchemy_hosts(url)
        userinfo = _SA_USERINFO.match(url)
        if userinfo and "@" in url[userinfo.end():].split("?", 1)[0]:
            # A second '@' (in a password, usually): the parser would take what follows the
            # first one for the host, and connection errors would print it.
            raise DatabaseURLError("not a database URL: it has an '@' that does not end a user name "
                             "and password (write an '@' in a user name, password or database name "
                             "as %40)")
        try:
            u = make_url(url)
        except Exception as exc:
            # SQLAlchemy's messages may quote the URL (a password included): name the part.
            raise DatabaseURLError(f"not a database URL: {_what_is_wrong(exc)}; it must look like "
                             f"{_URL_SHAPE}") from None
    driver = u.drivername.partition("+")[0]
    if driver not in ("postgresql", "postgres"):
        raise DatabaseURLError(f"flowq needs PostgreSQL, not {u.drivername!r}: pass a postgresql:// URL")
    if u.drivername != "postgresql+psycopg":
        u = u.set(drivername="postgresql+psycopg")
    _conninfo_params(u)  # a host list libpq cannot take is refused here, not in a worker
    return u


def _what_is_wrong(exc: Exception) -> str:
    if isinstance(exc, ValueError) and "int()" in str(exc):
        return "its port is not a number"
    return "it cannot be parsed"


def _split_host(entry: str) -> tuple[str, str]:
    """`h`, `h:5432`, `[::1]:5432`, `::1` or a unix-socket directory: (host, port or '')."""
    if entry.startswith("/") or entry.startswith("@"):
        return entry, ""  # a socket directory (or an abstract socket): a ':' is its own
    if entry.startswith("["):
        host, sep, rest = entry[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise DatabaseURLError("not a database URL: an IPv6 host is written [address]:port")
        return host, rest[1:]
    if entry.count(":") > 1:
        return entry, ""  # a bare IPv6 address
    host, _, port = entry.partition(":")
    return host, port


def to_conninfo(url: URL) -> str:
    """The libpq conninfo of `url` (any form `normalize_url` accepts): what every psycopg
    connection flowq opens itself is given. Several hosts become `host=h1,h2 port=p1,p2`,
    each host with its own port (or the URL's, or libpq's default when it has none)."""
    import psycopg
    from psycopg.conninfo import make_conninfo

    try:
        return make_conninfo("", **_conninfo_params(url))
    except psycopg.ProgrammingError as exc:  # an option libpq does not know, say
        raise DatabaseURLError(f"not a database URL: {mask_secrets(str(exc))}") from None


def _conninfo_params(url: URL) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for key, value in url.query.items():
        params[key] = value if isinstance(value, str) else list(value)
    query_hosts = params.pop("host", None)
    query_ports = params.pop("port", None)
    if isinstance(query_hosts, str):
        query_hosts = [query_hosts]
    if query_hosts is not None and url.host:
        raise DatabaseURLError("not a database URL: it names a host both before its path and in "
                         "?host=; give the hosts in one place")
    if isinstance(query_ports, list):
        raise DatabaseURLError("not a database URL: give a port with each ?host=h:port, not "
                         "several ?port=")
    default_port = "" if url.port is None else str(url.port)
    if query_ports is not None:
        default_port = query_ports
    hosts: list[str] = []
    ports: list[str] = []
    for entry in query_hosts if query_hosts is not None else ([url.host] if url.host else []):
        host, port = (entry, "") if entry == url.host else _split_host(entry)
        if port and not port.isdigit():
            raise DatabaseURLError("not a database URL: a host's port is not a number")
        if "," in host:
            raise DatabaseURLError("not a database URL: give several hosts as ?host=h1:p1&host=h2:p2 "
                             "or as h1:p1,h2:p2 before the path")
        hosts.append(host)
        ports.append(port or default_port)
    if hosts:
        params["host"] = ",".join(hosts)
    if any(ports):
        params["port"] = ports[0] if len(set(ports)) == 1 else ",".join(ports)
    for key, part in (("user", url.username), ("password", url.password),
                      ("dbname", url.database)):
        if part:
            params[key] = part
    return params


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
    """A SQLAlchemy engine on psycopg 3, with pre-ping so a restarted server is survived,
    and read-only servers left (a failover: `flowq.db.transient.leave_read_only_servers`);
    with `pgbouncer`, safe through PgBouncer in transaction mode (`PGBOUNCER_CONNECT_ARGS`)."""
    kwargs.setdefault("pool_pre_ping", True)
    if pgbouncer:
        kwargs["connect_args"] = {**kwargs.get("connect_args", {}), **PGBOUNCER_CONNECT_ARGS}
    engine = sa.create_engine(normalize_url(url), **kwargs)
    leave_read_only_servers(engine)
    return engine
