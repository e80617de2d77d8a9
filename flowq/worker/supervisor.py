"""`flowq worker --processes N`: N worker processes under one command.

Each child is the same `flowq worker` command with `--processes 1`, so a child behaves
exactly like a worker started by hand. SIGTERM/SIGINT are forwarded to every child (each
drains within its grace period; SIGHUP is forwarded as SIGTERM) and the supervisor exits 0
once all have exited cleanly. Children run in their own process groups, so a Ctrl-C reaches
them once, through the supervisor. A child that dies on its own (crash, OOM kill) is
restarted after a short backoff; the reaper requeues the jobs it held.

A child is told its supervisor's pid (`FLOWQ_SUPERVISOR_PID`): its `SupervisorWatch` looks
every `SUPERVISOR_CHECK_INTERVAL` (1 s) whether that is still its parent, and when the
supervisor is gone (SIGKILLed: its children are in their own process groups and would run on
as orphans) the worker shuts down cleanly, as on SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Final

from flowq.worker.logs import INFO, WARNING, log_event
from flowq.worker.services import Service

__all__ = ["SUPERVISOR_ENV", "SupervisorWatch", "child_argv", "supervise"]

SUPERVISOR_ENV: Final = "FLOWQ_SUPERVISOR_PID"
RESTART_BACKOFF: Final = 1.0
SUPERVISOR_CHECK_INTERVAL: Final = 1.0


class SupervisorWatch(Service):
    """Calls `on_orphaned()` once, when the process's parent is no longer `supervisor` (a
    pid, as `SUPERVISOR_ENV` gives it)."""

    name = "supervisor-watch"

    def __init__(self, supervisor: str, on_orphaned: Callable[[], None], *,
                 interval: float = SUPERVISOR_CHECK_INTERVAL,
                 stopping: threading.Event | None = None) -> None:
        super().__init__(interval=interval, stopping=stopping)
        self.supervisor = supervisor
        self.on_orphaned = on_orphaned
        self.orphaned = False

    def run_once(self) -> int:
        """Look once; returns 1 when it found the supervisor gone (the first time), else 0."""
        if self.orphaned or str(os.getppid()) == self.supervisor:
            return 0
        self.orphaned = True
        log_event(WARNING, "the --processes supervisor is gone; shutting down",
                  supervisor_pid=self.supervisor)
        self.on_orphaned()
        return 1


def child_argv(argv: list[str]) -> list[str]:
    """The command line of one child: the same arguments with `--processes 1`."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("--processes", "-p"):
            skip = True
            continue
        if arg.startswith("--processes=") or (arg.startswith("-p") and arg[2:].isdigit()):
            continue
        out.append(arg)
    return [sys.executable, "-m", "flowq", *out, "--processes", "1"]


def _spawn(cmd: list[str]) -> subprocess.Popen[bytes]:
    # Each child in its own process group: Ctrl-C in a terminal signals the whole foreground
    # group, and a child that got SIGINT from the terminal and again from `forward` would take
    # it as the second signal and exit at once, without draining.
    # Outside the group, a SIGKILLed supervisor's children would run on as orphans: they are
    # told who their supervisor is and stop by themselves when it is gone (`SupervisorWatch`).
    env = {**os.environ, SUPERVISOR_ENV: str(os.getpid())}
    if sys.version_info >= (3, 11):
        return subprocess.Popen(cmd, process_group=0, env=env)
    return subprocess.Popen(cmd, preexec_fn=os.setpgrp, env=env)  # safe: no threads here


def supervise(processes: int, argv: list[str] | None = None) -> int:
    """Run `processes` children until signalled; the exit code for the supervisor."""
    cmd = child_argv(list(sys.argv[1:] if argv is None else argv))
    children: list[subprocess.Popen[bytes]] = []
    stopping = False
    signalled: set[int] = set()

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.poll() is None:
                signalled.add(child.pid)
                child.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)

    def catch_up(child: subprocess.Popen[bytes]) -> None:
        # A signal that came while `child` was being spawned was not forwarded to it.
        if stopping and child.pid not in signalled:
            signalled.add(child.pid)
            child.send_signal(signal.SIGTERM)

    # Handlers first, so a signal during the start is forwarded rather than fatal here.
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGHUP, forward)  # the children no longer get the terminal's hangup
    for _ in range(processes):
        children.append(_spawn(cmd))
    for child in children:
        catch_up(child)
    log_event(INFO, "supervising worker processes", processes=processes,
              pids=",".join(str(c.pid) for c in children))
    while True:
        alive = 0
        for i, child in enumerate(children):
            code = child.poll()
            if code is None:
                alive += 1
            elif not stopping:
                log_event(WARNING, "worker process exited; restarting", pid=child.pid,
                          exit_code=code)
                time.sleep(RESTART_BACKOFF)
                if not stopping:
                    children[i] = _spawn(cmd)
                    catch_up(children[i])
                    alive += 1
        if stopping and alive == 0:
            break
        time.sleep(0.1)
    # A child still starting up when the signal came dies of it (its handler is not installed
    # yet); it had claimed nothing, so that is a clean exit too.
    clean = {0, -signal.SIGTERM, -signal.SIGINT}
    return 0 if all(c.returncode in clean for c in children) else 1
