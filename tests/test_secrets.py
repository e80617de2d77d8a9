"""No password in anything flowq prints: `flowq.db.mask_secrets` and every CLI command.

Each command runs as a real `python -m flowq` process with a URL holding `PASSWORD`, given by
`--database-url`, FLOWQ_DATABASE_URL or DATABASE_URL, in shapes that are malformed or that
point at nothing (a closed port on 127.0.0.1, a host that does not resolve). The password
must appear nowhere in stdout or stderr, and the failure must be one `Error: ` sentence.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

import flowq.db
from flowq.errors import FlowqError

PASSWORD = "S3cr3tPassw0rd"
APP = "flowq_bench.app:app"  # importable wherever flowq-bench is installed (make test does)
PARALLEL = 2


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
    }


# Every command and subcommand, with the arguments it needs besides the URL.
COMMANDS: dict[str, tuple[str, ...]] = {
    "migrate": ("migrate",),
    "migrate --sql": ("migrate", "--sql"),
    "worker": ("worker", APP),
    "reap": ("reap",),
    "prune": ("prune",),
    "runs list": ("runs", "list"),
    "runs show": ("runs", "show", "1"),
    "runs cancel": ("runs", "cancel", "1"),
    "runs retry": ("runs", "retry", "1"),
    "demo": ("demo", "--jobs", "10"),
    "bench": ("bench", "--quick", "--scenario", "enqueue"),
}
# demo and bench never read the environment (tests/test_demo.py): with only a variable set
# they would start an embedded server, so they take the URL by option only.
ENV_COMMANDS = [name for name in COMMANDS if name not in ("demo", "bench")]


@dataclass(frozen=True)
class Ran:
    argv: Sequence[str]
    env: dict[str, str]
    returncode: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return (f"{' '.join(self.argv)} env={self.env} -> {self.returncode}\n"
                f"stdout: {self.stdout}\nstderr: {self.stderr}")


def flowq_cli(*args: str, env: dict[str, str] | None = None) -> Ran:
    child_env = {k: v for k, v in os.environ.items()
                 if k not in ("FLOWQ_DATABASE_URL", "DATABASE_URL")}
    child_env.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "flowq", *args], capture_output=True,
                          text=True, timeout=60, env=child_env)
    return Ran(args, env or {}, proc.returncode, proc.stdout, proc.stderr)


def run_all(calls: list[tuple[tuple[str, ...], dict[str, str] | None]]) -> Iterator[Ran]:
    with ThreadPoolExecutor(PARALLEL) as pool:
        yield from pool.map(lambda call: flowq_cli(*call[0], env=call[1]), calls)


def assert_no_secret(ran: Ran) -> None:
    assert PASSWORD not in ran.stdout and PASSWORD not in ran.stderr, str(ran)
    # Nor a recognisable piece of it.
    assert "S3cr3t" not in ran.stdout + ran.stderr and "Passw0rd" not in ran.stderr, str(ran)


def assert_one_sentence(ran: Ran) -> None:
    """Exit code 2 and one line, `Error: ...`, on stderr: no traceback, no log lines."""
    assert ran.returncode == 2, str(ran)
    assert "Traceback" not in ran.stderr, str(ran)
    text = ran.stderr.strip()
    assert text.startswith("Error: ") and "\n" not in text, str(ran)


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
    "",
])
def test_mask_secrets_leaves_text_without_a_password_alone(text: str) -> None:
    assert flowq.db.mask_secrets(text) == text


def test_normalize_url_errors_and_describe_url_are_masked(closed_port: int) -> None:
    for name, url in url_shapes(closed_port).items():
        assert PASSWORD not in flowq.db.describe_url(url), name
        try:
            flowq.db.normalize_url(url)
        except FlowqError as exc:
            assert PASSWORD not in str(exc), (name, str(exc))


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
    results = list(run_all([((*args, "--database-url", url), None) for url in shapes.values()]))
    for ran in results:
        assert_no_secret(ran)
        if command == "migrate --sql":  # prints the DDL without connecting
            assert ran.returncode == 0 and "CREATE TABLE flowq.jobs" in ran.stdout, str(ran)
        else:
            assert_one_sentence(ran)


@pytest.mark.parametrize("var", ["FLOWQ_DATABASE_URL", "DATABASE_URL"])
def test_no_command_prints_the_password_of_its_environment_url(var: str,
                                                               closed_port: int) -> None:
    shapes = url_shapes(closed_port)
    urls = [shapes[s] for s in ("closed port", "password with @ : /", "query password",
                                "libpq key/value")]
    calls = [(COMMANDS[c], {var: url}) for c in ENV_COMMANDS for url in urls]
    for ran in run_all(calls):
        assert_no_secret(ran)
        if ran.argv[:2] == ("migrate", "--sql"):
            assert ran.returncode == 0, str(ran)
        else:
            assert_one_sentence(ran)


def test_usage_errors_do_not_print_the_password(closed_port: int) -> None:
    """click's own messages echo a misplaced value: a URL given where it does not belong."""
    url = url_shapes(closed_port)["closed port"]
    calls: list[tuple[tuple[str, ...], dict[str, str] | None]] = [
        (("migrate", url), None),                            # unexpected extra argument
        (("runs", "show", url), None),                       # not a valid integer
        (("worker", APP, "--concurrency", url), None),       # not a valid integer range
        (("worker", url, "--database-url", url), None),      # not MODULE:APP
        (("demo", "--jobs", url), None),
        (("bench", "--scenario", url, "--database-url", url), None),  # unknown scenario
        ((url,), None),                                      # no such command
    ]
    for ran in run_all(calls):
        assert_no_secret(ran)
        assert ran.returncode == 2, str(ran)
        assert "Traceback" not in ran.stderr, str(ran)
        assert ran.stderr.strip().splitlines()[-1].startswith("Error: "), str(ran)
