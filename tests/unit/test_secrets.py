"""No password in anything flowq prints: `flowq.db.mask_secrets` and every CLI command.

Each command runs with a URL holding `PASSWORD`, given by `--database-url`,
FLOWQ_DATABASE_URL or DATABASE_URL, in shapes that are malformed or that point at nothing (a
closed port on 127.0.0.1, a host that does not resolve). The password must appear nowhere in
stdout or stderr, nor in a log record or a warning, and the failure must be one `Error: `
sentence with exit code 2 and no exception escaping the command.

The sweeps over every command and every shape run in-process (click's CliRunner on
`flowq.cli.main`): what they check is what the command writes, which a process adds nothing to.
What only a real `python -m flowq` process shows (the interpreter's own output: a traceback
printed at exit, a warning, a log line through logging's last-resort handler) is checked once
per command, each paired with another URL shape, in `test_real_processes_print_no_password`.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from click.testing import CliRunner

import flowq.db
from flowq.cli import main
from flowq.errors import FlowqError

PASSWORD = "S3cr3tPassw0rd"
APP = "flowq_bench.app:app"  # importable wherever flowq-bench is installed (make test does)
PARALLEL = 2  # real processes at once
URL_VARIABLES = ("FLOWQ_DATABASE_URL", "DATABASE_URL")


@pytest.fixture(scope="module")
def closed_port() -> int:
    """A port on 127.0.0.1 nobody listens on (connections are refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def url_shapes(port: int) -> dict[str, str]:
    """Malformed URLs and well-formed ones that reach nothing, each holding PASSWORD."""
    fast = "connect_timeout=3"
    return {
        "closed port": f"postgresql://bob:{PASSWORD}@127.0.0.1:{port}/db?{fast}",
        "unknown host": f"postgresql://bob:{PASSWORD}@nosuchhost.invalid/db?{fast}",
        "port not a number": f"postgresql://bob:{PASSWORD}@host:notaport/db",
        "unclosed IPv6 host": f"postgresql://bob:{PASSWORD}@[::1",
        # An unescaped '@' makes the password's tail look like the host to a parser.
        "password with @ : /": f"postgresql://bob:x@{PASSWORD}:9/y@127.0.0.1:{port}/db?{fast}",
        "password with / and :": f"postgresql://bob:{PASSWORD}/:x@127.0.0.1:{port}/db?{fast}",
        "query password": f"postgresql://bob@127.0.0.1:{port}/db?password={PASSWORD}&{fast}",
        "unknown query option": f"postgresql://bob:{PASSWORD}@127.0.0.1:{port}/db?foo=bar",
        "libpq key/value": f"host=127.0.0.1 port={port} password='{PASSWORD} x'",
        "not PostgreSQL": f"mysql://bob:{PASSWORD}@localhost/db",
        # Malformed (issue 20, item 5): none may be quoted back, masked or not.
        "no colon after the scheme": f"postgresql//bob:{PASSWORD}@127.0.0.1:{port}/db",
        "no slashes": f"postgresql:bob:{PASSWORD}@127.0.0.1:{port}/db",
        "one slash": f"postgresql:/bob:{PASSWORD}@127.0.0.1:{port}/db",
        "three slashes": f"postgresql:///bob:{PASSWORD}@127.0.0.1:{port}/db",
        "no scheme": f"bob:{PASSWORD}@127.0.0.1:{port}/db",
        "not a scheme": f"pg sql://bob:{PASSWORD}@127.0.0.1/db",
        "unknown scheme, no colon": f"mysql+foo//bob:{PASSWORD}@h/x",
        "malformed, password with a space": f"postgresql:bob:{PASSWORD} x@h/db",
        "malformed, query password": f"postgresql//bob@127.0.0.1/db?password={PASSWORD}",
        "garbage": f"\x01{PASSWORD}:{PASSWORD}@@:://",
        "the password alone": PASSWORD,
        "password with % and :": f"postgresql://bob:{PASSWORD}%25x%zz:y@127.0.0.1:{port}/db?{fast}",
        "libpq host list": f"postgresql://bob:{PASSWORD}@127.0.0.1:{port},127.0.0.1:{port}/db?{fast}",
        "unknown option, host list": f"postgresql://bob:{PASSWORD}@/db?host=h:1&host=h:2&x=1",
    }


# Every command and subcommand, with the arguments it needs besides the URL.
COMMANDS: dict[str, tuple[str, ...]] = {
    "migrate": ("migrate",),
    "migrate --sql": ("migrate", "--sql"),
    "worker": ("worker", APP, "--start-timeout", "0"),  # no retrying a closed port
    "reap": ("reap",),
    "prune": ("prune",),
    "runs list": ("runs", "list"),
    "runs show": ("runs", "show", "1"),
    "runs cancel": ("runs", "cancel", "1"),
    "runs retry": ("runs", "retry", "1"),
    "demo": ("demo", "--jobs", "10"),
    "bench": ("bench", "--quick", "--scenario", "enqueue"),
}
# demo and bench never read the environment (tests/acceptance/test_demo.py): with only a variable set
# they would start an embedded server, so they take the URL by option only.
ENV_COMMANDS = [name for name in COMMANDS if name not in ("demo", "bench")]
Call = tuple[tuple[str, ...], dict[str, str] | None]


@dataclass(frozen=True)
class Ran:
    """What one command printed (and, in-process, logged and warned) and how it ended."""

    argv: Sequence[str]
    env: dict[str, str]
    returncode: int
    stdout: str
    stderr: str
    # In-process only: the exception that escaped the command (None or SystemExit when it
    # ended as a command should), the log records and warnings it emitted.
    escaped: BaseException | None = None
    logged: str = ""

    def __str__(self) -> str:
        return (f"{' '.join(self.argv)} env={self.env} -> {self.returncode}\n"
                f"stdout: {self.stdout}\nstderr: {self.stderr}\nescaped: {self.escaped!r}\n"
                f"logged: {self.logged}")


class _Records(logging.Handler):
    """Every log record emitted while a command runs, formatted with its traceback."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def flowq_cli(*args: str, env: dict[str, str] | None = None) -> Ran:
    """`flowq ARGS` in-process, with neither URL variable set unless `env` sets it."""
    records = _Records()
    root = logging.getLogger()
    root.addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            result = CliRunner().invoke(
                main, list(args), env={**dict.fromkeys(URL_VARIABLES), **(env or {})})
    finally:
        root.removeHandler(records)
    logged = "\n".join([*records.lines, *(str(w.message) for w in warned)])
    escaped = result.exception
    return Ran(args, env or {}, result.exit_code, result.stdout, result.stderr,
               escaped, logged)


def flowq_process(*args: str, env: dict[str, str] | None = None) -> Ran:
    """`python -m flowq ARGS` as a real process, with neither URL variable set unless `env`
    sets it."""
    child_env = {k: v for k, v in os.environ.items() if k not in URL_VARIABLES}
    child_env.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "flowq", *args], capture_output=True,
                          text=True, timeout=60, env=child_env)
    return Ran(args, env or {}, proc.returncode, proc.stdout, proc.stderr)


def run_all(calls: list[Call]) -> Iterator[Ran]:
    for args, env in calls:
        yield flowq_cli(*args, env=env)


def run_processes(calls: list[Call]) -> Iterator[Ran]:
    with ThreadPoolExecutor(PARALLEL) as pool:
        yield from pool.map(lambda call: flowq_process(*call[0], env=call[1]), calls)


def assert_no_secret(ran: Ran) -> None:
    printed = ran.stdout + ran.stderr + ran.logged + repr(ran.escaped)
    assert PASSWORD not in printed, str(ran)
    # Nor a recognisable piece of it.
    assert "S3cr3t" not in printed and "Passw0rd" not in ran.stderr + ran.logged, str(ran)


def assert_ended_as_a_command(ran: Ran) -> None:
    """No exception escaped the command but the exit click turns its errors into."""
    assert ran.escaped is None or isinstance(ran.escaped, SystemExit), str(ran)


def assert_one_sentence(ran: Ran) -> None:
    """Exit code 2 and one line, `Error: ...`, on stderr: no traceback, no log lines."""
    assert_ended_as_a_command(ran)
    assert ran.returncode == 2, str(ran)
    assert "Traceback" not in ran.stderr, str(ran)
    text = ran.stderr.strip()
    assert text.startswith("Error: ") and "\n" not in text, str(ran)


def assert_command_failed_safely(ran: Ran) -> None:
    """`migrate --sql` prints the DDL without connecting; every other command fails in one
    sentence."""
    assert_no_secret(ran)
    if tuple(ran.argv[:2]) == ("migrate", "--sql"):
        assert_ended_as_a_command(ran)
        assert ran.returncode == 0 and "CREATE TABLE flowq.jobs" in ran.stdout, str(ran)
    else:
        assert_one_sentence(ran)


def usage_error_calls(url: str) -> list[Call]:
    """click's own messages echo a misplaced value: a URL given where it does not belong."""
    return [
        (("migrate", url), None),                            # unexpected extra argument
        (("runs", "show", url), None),                       # not a valid integer
        (("worker", APP, "--concurrency", url), None),       # not a valid integer range
        (("worker", url, "--database-url", url), None),      # not MODULE:APP
        (("demo", "--jobs", url), None),
        (("bench", "--scenario", url, "--database-url", url), None),  # unknown scenario
        ((url,), None),                                      # no such command
    ]


def assert_usage_error_safe(ran: Ran) -> None:
    assert_no_secret(ran)
    assert_ended_as_a_command(ran)
    assert ran.returncode == 2, str(ran)
    assert "Traceback" not in ran.stderr, str(ran)
    assert ran.stderr.strip().splitlines()[-1].startswith("Error: "), str(ran)


# -- mask_secrets ----------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "kept"), [
    (f"postgresql://bob:{PASSWORD}@db.example.com:5432/app", "bob:***@db.example.com:5432/app"),
    (f"postgresql+psycopg://bob:{PASSWORD}@h/db?sslmode=require", "@h/db?sslmode=require"),
    (f"not a database URL: 'postgresql://bob:{PASSWORD}@host:notaport/db' (invalid literal "
     "for int() with base 10: 'notaport')", "'notaport')"),
    (f"postgresql://bob:{PASSWORD}@[::1", "bob:***@[::1"),
    (f"postgresql://bob:p@ss{PASSWORD}@host/db", "bob:***@host/db"),
    (f"postgresql://bob:{PASSWORD}@:x/y@host/db", "bob:***@host/db"),
    (f"postgresql://bob:p/a:{PASSWORD}@host/db", "bob:***@host/db"),
    (f"postgresql://:{PASSWORD}@host/db", "://:***@host/db"),
    (f"postgres://bob:{PASSWORD} with spaces@host/db", "@host/db"),
    (f"postgresql://bob@host/db?sslmode=require&password={PASSWORD}&x=1", "&x=1"),
    (f"postgresql://bob@host/db?PASSWORD={PASSWORD}", "bob@host/db?PASSWORD=***"),
    (f"host=h port=5 password={PASSWORD} dbname=d", "host=h port=5 password=*** dbname=d"),
    (f"host=h password = '{PASSWORD} with \\' quote' dbname=d", "dbname=d"),
    (f"'host=h password={PASSWORD}'", "password=***'"),
    (repr(f"host=h password='{PASSWORD} x'"), "password=***\""),
    (f"{{'host': 'h', 'password': '{PASSWORD}'}}", "'host': 'h'"),
    (f"sslpassword={PASSWORD}", "sslpassword=***"),
    (f"a\npostgresql://u:{PASSWORD}@h/d\nb", "a\npostgresql://u:***@h/d\nb"),
    # Malformed: credentials-shaped text, whatever is around it.
    (f"postgresql//bob:{PASSWORD}@host/x", "postgresql//bob:***@host/x"),
    (f"postgresql:bob:{PASSWORD}@host/x", "postgresql:***@host/x"),
    (f"postgresql:/bob:{PASSWORD}@host/x", "postgresql:***@host/x"),
    (f"postgresql:///bob:{PASSWORD}@host/x", "postgresql:///bob:***@host/x"),
    (f"extra argument (bob:{PASSWORD}@host/x)", "(bob:***@host/x)"),
    (f"'bob:x@{PASSWORD}:y@host'", "'bob:***@host'"),
    (f"postgresql:bob:{PASSWORD} with spaces@host/x", "@host/x"),
])
def test_mask_secrets_hides_the_password(text: str, kept: str) -> None:
    masked = flowq.db.mask_secrets(text)
    assert PASSWORD not in masked
    assert kept in masked, masked
    assert flowq.db.mask_secrets(masked) == masked  # messages are masked more than once


@pytest.mark.parametrize("text", [
    "postgresql://bob@127.0.0.1:5432/db?connect_timeout=3",
    "postgresql+psycopg://127.0.0.1:1/nowhere",
    "cannot connect: connection to server at \"127.0.0.1\", port 1 failed: Connection refused",
    "FATAL: password authentication failed for user \"bob\"",
    "postgresql+psycopg://bob@/db?host=h1:5432&host=h2:5433&target_session_attrs=read-write",
    "postgresql://bob@h1:5432,[::1]:5433/db",
    "postgresql://bob@/db?host=/var/run/postgresql",
    "Error: at 12:30 bob@host said no",
    "",
])
def test_mask_secrets_leaves_text_without_a_password_alone(text: str) -> None:
    assert flowq.db.mask_secrets(text) == text


@pytest.mark.parametrize("text", ["a:" * 50_000, "/a:" * 30_000 + "x@", "x:y " * 25_000 + "@",
                                  "pg:/a:" * 15_000,
                                  # These took 11-15 s before the URL pattern was bounded.
                                  "a://b:" * 24_000, "a.a." * 36_000, "@" + "a://b:" * 24_000])
def test_mask_secrets_takes_linear_time(text: str) -> None:
    # A user's argument lands in click's usage errors: a quadratic mask would hang the CLI.
    # This process's CPU time, not the wall clock: other processes on a loaded machine do not
    # count, and the quadratic mask took 11-15 s of it where the linear one takes milliseconds.
    started = time.process_time()
    flowq.db.mask_secrets(text)
    assert time.process_time() - started < 3.0


def test_normalize_url_errors_and_describe_url_are_masked(closed_port: int) -> None:
    for name, url in url_shapes(closed_port).items():
        assert PASSWORD not in flowq.db.describe_url(url), name
        try:
            flowq.db.to_conninfo(flowq.db.normalize_url(url))
        except FlowqError as exc:
            assert PASSWORD not in str(exc), (name, str(exc))
            assert "S3cr3t" not in str(exc), (name, str(exc))


@pytest.mark.parametrize("url", [
    f"postgresql//bob:{PASSWORD}@host/x",
    f"postgresql:bob:{PASSWORD}@host/x",
    f"pg sql://bob:{PASSWORD}@host/x",
    PASSWORD,
])
def test_a_malformed_url_is_not_quoted_back(url: str) -> None:
    """Not even masked: the message says what is wrong in flowq's own words."""
    with pytest.raises(FlowqError, match="not a database URL") as err:
        flowq.db.normalize_url(url)
    assert "bob" not in str(err.value) and "host/x" not in str(err.value)


def test_a_password_with_an_unescaped_at_is_refused_not_guessed() -> None:
    # Read as host `S3cr3tPassw0rd`, the password would be printed in "cannot resolve host".
    with pytest.raises(FlowqError, match="%40") as err:
        flowq.db.normalize_url(f"postgresql://bob:x@{PASSWORD}@127.0.0.1/db")
    assert PASSWORD not in str(err.value)
    # An '@' in the query string is fine.
    url = flowq.db.normalize_url("postgresql://bob:pw@h/db?application_name=a@b")
    assert url.host == "h" and url.password == "pw"


# -- every command -----------------------------------------------------------------------


@pytest.mark.parametrize("command", list(COMMANDS))
def test_no_command_prints_the_password_of_its_database_url(command: str,
                                                            closed_port: int) -> None:
    args = COMMANDS[command]
    shapes = url_shapes(closed_port)
    for ran in run_all([((*args, "--database-url", url), None) for url in shapes.values()]):
        assert_command_failed_safely(ran)


@pytest.mark.parametrize("var", URL_VARIABLES)
def test_no_command_prints_the_password_of_its_environment_url(var: str,
                                                               closed_port: int) -> None:
    shapes = url_shapes(closed_port)
    urls = [shapes[s] for s in ("closed port", "password with @ : /", "query password",
                                "libpq key/value")]
    for ran in run_all([(COMMANDS[c], {var: url}) for c in ENV_COMMANDS for url in urls]):
        assert_command_failed_safely(ran)


@pytest.mark.parametrize("shape", ["closed port", "no colon after the scheme", "no slashes",
                                   "malformed, password with a space"])
def test_usage_errors_do_not_print_the_password(shape: str, closed_port: int) -> None:
    for ran in run_all(usage_error_calls(url_shapes(closed_port)[shape])):
        assert_usage_error_safe(ran)


@pytest.mark.slow
def test_real_processes_print_no_password(closed_port: int) -> None:
    """Every command once as a real process (each with another URL shape, round the list),
    each URL variable once, and one usage error: what the interpreter itself prints."""
    shapes = list(url_shapes(closed_port).values())
    calls: list[Call] = [((*args, "--database-url", shapes[i % len(shapes)]), None)
                         for i, args in enumerate(COMMANDS.values())]
    env_url = url_shapes(closed_port)["password with @ : /"]
    calls += [(COMMANDS["runs list"], {var: env_url}) for var in URL_VARIABLES]
    usage = usage_error_calls(url_shapes(closed_port)["closed port"])
    results = list(run_processes([*calls, usage[2]]))
    for ran in results[:-1]:
        assert_command_failed_safely(ran)
    assert_usage_error_safe(results[-1])
