"""CPU a drain costs, per job: the client processes' and the PostgreSQL server's, from /proc.

A drain's throughput says how fast; the CPU per job says what it costs each side, and on a
2-core machine where both sides saturate the cores that is what a faster path must cut.

- `tree_cpu(pids)`: user+sys seconds of processes and all their descendants, the reaped
  ones included (each process's `cutime`/`cstime` holds its waited-for children's), so a
  worker process restarted or a backend that disconnected inside the window still counts.
- `ServerCpu.find(engine)`: the local PostgreSQL's postmaster, found as the parent of the
  connection's own backend (`pg_backend_pid()`) when that pid is a `postgres` process on
  this machine whose parent is one too; None for a remote server (the table says n/a).
  `read()` is the postmaster's tree: every backend, the WAL writer, the checkpointer and
  autovacuum, of every database on that server (the bench's own polling is in it too).
- `cpu_rows`: flowq's CPU per job beside the references', as table rows.
- `Window`: each side read when the drain starts and when it ends; `per_job_us(n)`.

Linux only (/proc); elsewhere every figure is None and the table says n/a.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol

import sqlalchemy as sa

from flowq_bench.report import Figure, Row

__all__ = ["CPU_UNIT", "Costed", "ServerCpu", "Window", "cpu_rows", "tree_cpu"]

PROC: Final = Path("/proc")
_TICK: Final = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command (field 3, the state, first); None if gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command is in parentheses and may hold spaces or parentheses itself.
    return text[text.rindex(")") + 2:].split()


def _cpu(fields: list[str]) -> float:
    """utime + stime + cutime + cstime (fields 14-17), in seconds."""
    return sum(int(x) for x in fields[11:15]) * _TICK


def _parents() -> dict[int, int]:
    """Every process's parent, from one scan of /proc."""
    out: dict[int, int] = {}
    for entry in PROC.iterdir() if PROC.is_dir() else ():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None:
                out[int(entry.name)] = int(fields[1])
    return out


def tree_cpu(pids: Iterable[int]) -> float:
    """User+sys CPU seconds of `pids` and their descendants, reaped children included."""
    roots = set(pids)
    parents = _parents()
    tree, grew = set(roots) & set(parents), True
    while grew:
        more = {p for p, parent in parents.items() if parent in tree and p not in tree}
        tree |= more
        grew = bool(more)
    total = 0.0
    for pid in tree:
        fields = _stat(pid)
        if fields is not None:
            total += _cpu(fields)
    return total


def _comm(pid: int) -> str:
    try:
        return (PROC / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class ServerCpu:
    """The local PostgreSQL server's processes, read as one tree under its postmaster."""

    postmaster: int

    @classmethod
    def find(cls, engine: sa.Engine) -> ServerCpu | None:
        """The server behind `engine` if it runs on this machine (and /proc shows it)."""
        with engine.connect() as c:
            backend = int(c.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
            fields = _stat(backend)
            # Checked while the backend is alive: a pid of a server in another pid
            # namespace (a container) is either absent here or not a postgres process.
            if fields is None or not _comm(backend).startswith("postgres"):
                return None
            parent = int(fields[1])
            if not _comm(parent).startswith("postgres"):
                return None
        return cls(parent)

    def read(self) -> float:
        return tree_cpu([self.postmaster])


@dataclass
class Window:
    """CPU seconds of the client `pids` and of `server` (None: not measurable) over one
    drain. Each side is started and stopped on its own: the client before the enqueue (its
    processes idle until it commits), the server at t0 (the enqueue's INSERT is not the
    drain's), the raw loops' client before they are reaped."""

    server: ServerCpu | None
    pids: list[int] = field(default_factory=list)
    client_s: float | None = None
    server_s: float | None = None
    _client_at: float = 0.0
    _server_at: float = 0.0

    def start_client(self, pids: Iterable[int] | None = None) -> None:
        if pids is not None:
            self.pids = list(pids)
        self._client_at = tree_cpu(self.pids)

    def start_server(self) -> None:
        self._server_at = self.server.read() if self.server else 0.0

    def stop_client(self) -> None:
        self.client_s = tree_cpu(self.pids) - self._client_at if self.pids else None

    def stop_server(self) -> None:
        self.server_s = self.server.read() - self._server_at if self.server else None

    def per_job_us(self, n: int) -> tuple[float | None, float | None]:
        """(client, server) µs per job over `n` jobs."""
        def per(s: float | None) -> float | None:
            return None if s is None else 1e6 * s / max(n, 1)

        return per(self.client_s), per(self.server_s)


class Costed(Protocol):
    """A drain's CPU per row (`drains.DrainCost`)."""

    @property
    def client_us(self) -> float | None: ...

    @property
    def server_us(self) -> float | None: ...


CPU_UNIT: Final = "µs/job"
SERVER_NA: Final = ("server CPU n/a: the server is not on this machine (or /proc does not "
                    "show it)")


def cpu_rows(scenario: str, label: str, ours: Sequence[Costed],
             refs: Mapping[str, Sequence[Costed]], *, note: bool = True) -> list[Row]:
    """CPU per job of flowq's drain `ours` beside `refs`', client then server (µs, lower is
    better; `note`: say what is measured); no server row when the server is not local."""
    rows = []
    sides: tuple[tuple[str, Callable[[Costed], float | None]], ...] = (
        ("client", lambda d: d.client_us), ("server", lambda d: d.server_us))
    for side, value in sides:
        mine = [v for v in map(value, ours) if v is not None]
        if not mine:
            continue
        theirs = [Figure(name, CPU_UNIT, [v for v in map(value, r) if v is not None], False)
                  for name, r in refs.items()]
        what = ("the flowq worker processes, supervisor included / the raw loop processes"
                if side == "client" else
                "every process of the PostgreSQL server: backends, WAL writer, checkpointer, "
                "autovacuum")
        rows.append(Row(scenario, Figure(f"{side} CPU per job ({label})", CPU_UNIT, mine,
                                         False), [f for f in theirs if f.values],
                        note=f"user+sys CPU of {what}, from /proc, over the drain, / jobs"
                        if note else ""))
    if len(rows) == 1 and note:  # the client's only
        rows[0].note += f"; {SERVER_NA}"
    return rows
