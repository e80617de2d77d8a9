"""What `flowq bench` says while it runs: each scenario as it starts, each repeat as it starts.

A bench runs for minutes; a silent one looks hung. `run_bench` makes a `Progress` current for
its run (`reporting`), and every loop over repeats goes through `repeats(n, what)`, which
reports repeat i of n of `what` before it runs. On a terminal the repeats redraw one line
with a bar; elsewhere (CI logs, a pipe) each is a line of its own, so a log shows where a
long run was. Nothing is reported when no `Progress` is current (a scenario called alone).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final

__all__ = ["BAR_WIDTH", "Progress", "repeats", "reporting"]

BAR_WIDTH: Final = 20


class Progress:
    """Writes the bench's progress through `write` (text without its newline); `tty`: redraw
    the repeats' line in place, with a bar."""

    def __init__(self, write: Callable[[str], None], *, tty: bool = False,
                 scenarios: int = 0) -> None:
        self.write = write
        self.tty = tty
        self.scenarios = scenarios
        self.started = 0
        self._open_line = False  # a repeat's line waiting for its newline (tty)

    def scenario(self, name: str) -> None:
        self._end_line()
        self.started += 1
        total = f"/{self.scenarios}" if self.scenarios else ""
        self.write(f"[{self.started}{total}] running {name} …\n")

    def repeat(self, what: str, index: int, total: int) -> None:
        """Repeat `index` (1-based) of `total` of `what` starts."""
        if self.tty:
            done = BAR_WIDTH * (index - 1) // max(total, 1)
            bar = "#" * done + "-" * (BAR_WIDTH - done)
            self.write(f"\r  {what} [{bar}] {index}/{total}\033[K")
            self._open_line = True
        else:
            self.write(f"  {what}: run {index}/{total}\n")

    def close(self) -> None:
        self._end_line()

    def _end_line(self) -> None:
        if self._open_line:
            self.write("\n")
            self._open_line = False


_current: Progress | None = None


@contextmanager
def reporting(progress: Progress) -> Iterator[Progress]:
    """Make `progress` the one `repeats` reports to, for the block."""
    global _current
    previous, _current = _current, progress
    try:
        yield progress
    finally:
        progress.close()
        _current = previous


def repeats(n: int, what: str) -> Iterator[int]:
    """`range(n)`, reporting each repeat of `what` as it starts."""
    for i in range(n):
        if _current is not None:
            _current.repeat(what, i + 1, n)
        yield i
