"""The durable-execution wing: a step's view of its run, and what it records there.

- `context`: `Context`, what a handler receives as `ctx` (`flowq.Context`);
- `session`: `StepSession`, the Session behind `ctx.session`, committed with the step;
- `checkpoints`: `Ledger`, an attempt's checkpoints (`ctx.checkpoint`) and snooze count;
- `sleeps`: durable sleeps (`ctx.sleep`, `ctx.sleep_until`) and `Suspend`;
- `children`: child runs (`ctx.start_child`, `ctx.wait`, `ctx.wait_all`).

The names `flowq.durable` gave before it was a package are handed on here.
"""

from __future__ import annotations

from flowq.durable.checkpoints import (
    MAX_NAME_CHARS,
    MAX_SNOOZES,
    RESERVED_PREFIX,
    ClaimLost,
    Ledger,
)
from flowq.durable.sleeps import Suspend

__all__ = ["MAX_NAME_CHARS", "MAX_SNOOZES", "RESERVED_PREFIX", "ClaimLost", "Ledger",
           "Suspend"]
