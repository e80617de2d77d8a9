"""Unit-testing one handler: `run_step(task_or_step, *, session=None, **args)` calls it with a
real `Context`, and `make_context(...)` builds one to call a handler yourself.

The context's `job_id` and `run_id` are synthetic (`SYNTHETIC_ID`, 0: never a real row's id),
`attempt` is 1 unless given, and `ctx.session` is the `session` you pass (the test owns its
commit or rollback; without one, using `ctx.session` raises FlowqError). Its checkpoints are
kept in memory (each runs once per context; a function taking `session` gets that session),
and `ctx.sleep` returns at once. Pass a
`flowq.durable.session.StepSession` to get a worker's refusal of `commit()` in the handler too.

`run_step` checks the arguments as a worker would (they must bind to the handler; `Task` and
`Pipeline` run their first step), awaits an `async def` handler (`asyncio.run`; inside a
running loop use `await arun_step(...)`), and judges the result as a worker would
(`flowq.worker.attempt.Attempt.judge`, the graph rules included): a value flowq cannot store,
or one that does not fit the pipeline's next step, raises AssertionError. Exceptions the handler raises (`RetryStep`, `CancelRun`, any other) propagate,
for `pytest.raises`. It returns the handler's result.
"""

from __future__ import annotations

from typing import Any, Final, cast

from sqlalchemy import orm

from flowq.db.rows import ClaimedJob
from flowq.define.pipeline import Pipeline
from flowq.define.step import Step
from flowq.define.workflows import Each
from flowq.durable.checkpoints import Ledger
from flowq.durable.context import Context
from flowq.durable.session import StepSession
from flowq.jsonargs import JSONError, dumps_checked
from flowq.worker.attempt import Attempt
from flowq.worker.graph import InvalidResultError, result_text
from flowq.worker.model import Failed

__all__ = ["SYNTHETIC_ID", "arun_step", "make_context", "run_step"]

SYNTHETIC_ID: Final = 0


def _resolve(task_or_step: Pipeline | Step[Any, Any]) -> tuple[Pipeline | None, Step[Any, Any]]:
    if isinstance(task_or_step, Pipeline):
        return task_or_step, task_or_step.first
    if isinstance(task_or_step, Step):
        return None, task_or_step
    raise TypeError(f"run_step needs a task, pipeline or step, got {task_or_step!r}")


def make_context(task_or_step: Pipeline | Step[Any, Any], *,
                 session: orm.Session | None = None, attempt: int = 1,
                 job_id: int = SYNTHETIC_ID, run_id: int = SYNTHETIC_ID) -> Context:
    """A real `Context` for the step (a task's or pipeline's first step), as a worker builds it."""
    pipeline, step = _resolve(task_or_step)
    factory = None if session is None else (lambda: cast(StepSession, session))
    # Its checkpoints are kept in memory: each runs once per context, a sleep returns at once.
    ledger = Ledger(run_id=run_id, step=step.name, map_index=None, session_factory=factory)
    return Context(job_id=job_id, run_id=run_id,
                   task=pipeline.name if pipeline is not None else step.name,
                   step=step.name, attempt=attempt, queue=step.queue,
                   session_factory=factory, ledger=ledger)


def _prepared(task_or_step: Pipeline | Step[Any, Any], session: orm.Session | None,
              args: dict[str, Any]) -> Context:
    _, step = _resolve(task_or_step)
    step.check_arguments(args, what=f"arguments for step {step.name!r}")
    return make_context(task_or_step, session=session)


def _checked(task_or_step: Pipeline | Step[Any, Any], ctx: Context, result: Any) -> Any:
    """`result`, if a worker would store it (and feed it to the next step)."""
    pipeline, step = _resolve(task_or_step)
    if pipeline is None:  # a bare step: which pipeline follows is unknown; only storability
        if isinstance(result, Each):  # its items were checked by `flowq.each`
            return result
        try:
            result_text(step, result)
        except InvalidResultError as exc:
            raise AssertionError(str(exc)) from None
        return result
    job = ClaimedJob(id=ctx.job_id, lease=0, run_id=ctx.run_id, task=ctx.task, step=step.name,
                     step_index=step.index, queue=step.queue, priority=0, attempts=ctx.attempt,
                     max_attempts=step.retry.attempt_cap, args="{}", cancel_requested=False,
                     age=0.0)
    outcome = Attempt(pipeline.app, job).judge(result, 0.0)
    if isinstance(outcome, Failed):
        raise AssertionError(outcome.summary)
    return result


def run_step(task_or_step: Pipeline | Step[Any, Any], *, session: orm.Session | None = None,
             **args: Any) -> Any:
    """Call the handler with a real context and `args`; its result (see the module)."""
    from flowq.testing.draining import run_coroutine

    _, step = _resolve(task_or_step)
    ctx = _prepared(task_or_step, session, _json_args(args))
    result = step.fn(ctx, **args)
    if step.is_async:
        result = run_coroutine(result)
    return _checked(task_or_step, ctx, result)


async def arun_step(task_or_step: Pipeline | Step[Any, Any], *,
                    session: orm.Session | None = None, **args: Any) -> Any:
    """`run_step` on the running event loop (an `async def` handler is awaited here)."""
    _, step = _resolve(task_or_step)
    ctx = _prepared(task_or_step, session, _json_args(args))
    result = step.fn(ctx, **args)
    if step.is_async:
        result = await result
    return _checked(task_or_step, ctx, result)


def _json_args(args: dict[str, Any]) -> dict[str, Any]:
    """Refuse arguments a worker could never receive: enqueue's own JSON rule."""
    try:
        dumps_checked(args, "args")
    except JSONError as exc:
        raise AssertionError(f"arguments flowq cannot enqueue: {exc}") from None
    return args
