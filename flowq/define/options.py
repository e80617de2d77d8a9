"""The enqueue options: the one list, with their types, that every signature forwarding them uses.

`EnqueueOptions` is a TypedDict, so a function taking `**options: Unpack[EnqueueOptions]` is
checked by a type checker like one spelling the eight keywords out (`Task.options`,
`Pipeline.options`, `flowq.enqueueing.prepare.prepare_enqueue`). What each option means, and how
it is checked, is `flowq.enqueue`'s (see `flowq.enqueueing.sync.enqueue`); every one is
optional, and one left out means its default:

- `idempotency_key` (None): names the run; a second enqueue with it returns the first run;
- `queue` (None: the first step's), `priority` (None: the pipeline's, lower first);
- `run_at` (an aware datetime) or `delay` (seconds or a timedelta): not due before then;
- `schema` (None: the task's app's, else "flowq"): the flowq schema;
- `unique` (False) / `unique_key` (None): one active run per task and arguments, or per key.

`RESERVED_OPTIONS` is the same list as names: a handler may not take a parameter named like
one (enqueue would take it as the option), which `flowq.define.step` checks at definition.
It lives here, under the definitions, because they need it; enqueue imports it from here.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Final, TypedDict

__all__ = ["RESERVED_OPTIONS", "EnqueueOptions"]


class EnqueueOptions(TypedDict, total=False):
    """Options of one enqueue (`flowq.enqueue`'s keywords besides the handler's arguments)."""

    idempotency_key: str | None
    queue: str | None
    priority: int | None
    run_at: datetime | None
    delay: float | timedelta | None
    schema: str | None
    unique: bool
    unique_key: str | None


RESERVED_OPTIONS: Final[frozenset[str]] = frozenset(EnqueueOptions.__optional_keys__)
