"""Batches: `with session.batch(on_complete=task, **args) as batch:` enqueues `task` once every
run enqueued in the block has finished, whatever its end.

Every run the session enqueues inside the block (`enqueue`, `enqueue_many`, a task's
`.enqueue`) joins the batch; a run that an idempotency or unique key matched (`created=False`)
was enqueued before and does not. The callback and its arguments are checked when the block
opens, as any enqueue's (it may not take its own `batch_id`, `succeeded`, `dead` or
`cancelled`: the batch gives them; `queue=` and `priority=` are its options). As the block
closes without an exception, the batch is written in the session's transaction (a rollback
leaves no batch, and a run whose savepoint rolled back is not waited for); an exception
leaves nothing written. An empty batch enqueues its callback at once, with zero counts, in
that transaction. Otherwise the reaper's pass (every `reap_interval`, default 10 s) counts the
runs that finished and enqueues the callback exactly once when all have, with the batch's id
and the counts `succeeded`, `dead` and `cancelled` (`flowq.db.store.enqueue`). Batches do not
nest on one session.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from flowq.db.schema import BATCH_ARGUMENTS
from flowq.db.store.enqueue import builder
from flowq.define.options import RESERVED_OPTIONS
from flowq.define.pipeline import Pipeline
from flowq.enqueueing.prepare import Enqueued, PreparedCall, prepare_enqueue
from flowq.errors import InvalidArgumentsError

if TYPE_CHECKING:
    from sqlalchemy import orm
    from sqlalchemy.ext.asyncio import AsyncSession

__all__ = ["BATCH_KEY", "Batch", "batch", "join_batch"]

# Where an open batch is kept: the session's `info`, so that every enqueue through it joins.
BATCH_KEY: Final = "flowq.batch"
# The options a callback may take (the others name or schedule a run, which a callback
# enqueued by the batch cannot be given).
_CALLBACK_OPTIONS: Final = frozenset({"queue", "priority"})


@dataclass
class Batch:
    """An open batch: its `id` (drawn when the block opens), and, once the block closed,
    `runs`, how many runs it waits for."""

    id: int
    schema: str
    callback: PreparedCall[Enqueued] = field(repr=False)
    run_ids: list[int] = field(default_factory=list, repr=False)
    runs: int | None = None


def prepare_callback(on_complete: Pipeline | str, args: Mapping[str, Any]
                     ) -> PreparedCall[Enqueued]:
    """Check the callback as an enqueue of it with the batch's arguments (placeholders)."""
    given = set(args) & set(BATCH_ARGUMENTS)
    if given:
        raise InvalidArgumentsError(
            f"the batch gives its callback {', '.join(BATCH_ARGUMENTS)}: do not pass "
            f"{', '.join(sorted(given))}")
    options = {k: args[k] for k in args if k in RESERVED_OPTIONS}
    refused = set(options) - _CALLBACK_OPTIONS
    if refused:
        raise InvalidArgumentsError(
            f"a batch's callback takes only queue= and priority= as options, not "
            f"{', '.join(sorted(refused))}")
    handler_args = {k: v for k, v in args.items() if k not in RESERVED_OPTIONS}
    call = prepare_enqueue(on_complete, {**handler_args, **dict.fromkeys(BATCH_ARGUMENTS, 0)},
                           **options)
    definition = on_complete if isinstance(on_complete, Pipeline) else None
    if definition is not None and (definition.starts_many
                                   or definition.concurrency_key is not None):
        raise InvalidArgumentsError(
            f"{definition.name!r} cannot be a batch's callback: its run starts with several "
            "rows or carries a concurrency key; use a task that enqueues it")
    return call


def join_batch(session: object, schema: str, result: object) -> None:
    """Add what an enqueue through `session` created to the batch open on it, if any."""
    info = getattr(session, "info", None)
    open_batch = info.get(BATCH_KEY) if isinstance(info, dict) else None
    if not isinstance(open_batch, Batch) or open_batch.schema != schema:
        return
    if isinstance(result, Enqueued):
        if result.created:
            open_batch.run_ids.append(result.id)
    elif isinstance(result, list):
        open_batch.run_ids.extend(result)


def _opening(info: dict[str, Any]) -> None:
    if info.get(BATCH_KEY) is not None:
        raise InvalidArgumentsError("a batch is already open on this session: batches do "
                                    "not nest")


@contextlib.contextmanager
def batch(session: orm.Session, on_complete: Pipeline | str,
          **args: Any) -> Iterator[Batch]:
    """The block of `Session.batch` (see the module docstring)."""
    _opening(session.info)
    callback = prepare_callback(on_complete, args)
    verbs = builder(callback.schema)
    conn = session.connection(bind_arguments={"clause": callback.statement})
    opened = Batch(verbs.read_count(conn.execute(*verbs.batch_id_statement()).one()),
                   callback.schema, callback)
    session.info[BATCH_KEY] = opened
    try:
        yield opened
    finally:
        session.info.pop(BATCH_KEY, None)
    closing = verbs.insert_batch_statement(opened.id, opened.run_ids, callback)
    opened.runs = verbs.read_count(conn.execute(*closing).one())
    if opened.runs == 0:
        conn.execute(*verbs.start_batch_statement(opened.id))


@contextlib.asynccontextmanager
async def abatch(session: AsyncSession, on_complete: Pipeline | str,
                 **args: Any) -> AsyncIterator[Batch]:
    """`batch` for an AsyncSession."""
    _opening(session.info)
    callback = prepare_callback(on_complete, args)
    verbs = builder(callback.schema)
    conn = await session.connection(bind_arguments={"clause": callback.statement})
    opened = Batch(verbs.read_count((await conn.execute(*verbs.batch_id_statement())).one()),
                   callback.schema, callback)
    session.info[BATCH_KEY] = opened
    try:
        yield opened
    finally:
        session.info.pop(BATCH_KEY, None)
    closing = verbs.insert_batch_statement(opened.id, opened.run_ids, callback)
    opened.runs = verbs.read_count((await conn.execute(*closing)).one())
    if opened.runs == 0:
        await conn.execute(*verbs.start_batch_statement(opened.id))
