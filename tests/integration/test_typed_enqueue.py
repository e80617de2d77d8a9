"""Typed enqueue: `task.enqueue(...)`, `task.options(...).enqueue(...)`, `await task.aenqueue(...)`.

At runtime they are the untyped enqueue (same row, same options, same errors); under
`mypy --strict` they refuse what the handler would refuse.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.orm import sessionmaker

import flowq

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")
FLOWQ_ROOT = Path(flowq.__file__).parent.parent  # where the flowq under test lives
ROW = "task, step, queue, priority, max_attempts, status, args, idempotency_key"


def _rows(engine: sa.Engine) -> list[sa.Row[Any]]:
    with engine.connect() as c:
        return list(c.execute(sa.text(f"SELECT run_id, {ROW} FROM flowq.steps ORDER BY id")))


def _add(ctx: flowq.Context, a: int, b: int = 0) -> int:
    return a + b


def _define(app: flowq.FlowQ, fn: Callable[Concatenate[flowq.Context, P], R]
            ) -> flowq.Task[P, R]:
    """`add` registered in this test's app, typed like `@app.task` would type it."""
    return app.task(name="add", queue="math", priority=3)(fn)


def test_typed_enqueue_inserts_the_row_the_untyped_form_does(
        app: flowq.FlowQ, engine: sa.Engine) -> None:
    add = _define(app, _add)
    Session = sessionmaker(engine, class_=flowq.Session)
    with Session.begin() as s:
        untyped = s.enqueue(add, a=1, b=2)
        typed = add.enqueue(s, a=1, b=2)
    with engine.begin() as conn:  # a Connection, and positionals named after the handler's
        positional = add.enqueue(conn, 1, b=2)

    rows = _rows(engine)
    assert [r.run_id for r in rows] == [untyped.id, typed.id, positional.id]
    assert typed.created and positional.created
    expected = ("add", "add", "math", 3, rows[0].max_attempts, "pending", {"a": 1, "b": 2}, None)
    assert [tuple(r)[1:] for r in rows] == [expected] * 3


def test_options_apply(app: flowq.FlowQ, engine: sa.Engine) -> None:
    add = _define(app, _add)
    at = datetime(2100, 1, 1, tzinfo=timezone.utc)
    with engine.begin() as conn:
        add.options(queue="urgent", priority=-5, run_at=at).enqueue(conn, a=1)
        add.options(delay=timedelta(hours=1)).enqueue(conn, 2)
        due_in = conn.execute(sa.text("SELECT max(run_at) - now() FROM flowq.steps "
                                      "WHERE args->>'a' = '2'")).scalar_one()
        # The option reaches prepare_enqueue: an unknown flowq schema is reported as such.
        with pytest.raises(flowq.SchemaMissingError, match="elsewhere"):
            add.options(schema="elsewhere").enqueue(conn, a=3)
    with engine.connect() as c:
        got = c.execute(sa.text("SELECT queue, priority, run_at FROM flowq.steps ORDER BY id")
                        ).all()
    assert got[0] == ("urgent", -5, at)
    assert got[1][:2] == ("math", 3)  # the task's own queue and priority by default
    assert timedelta(minutes=59) < due_in <= timedelta(hours=1)


def test_an_idempotency_key_returns_the_existing_run(app: flowq.FlowQ, engine: sa.Engine) -> None:
    add = _define(app, _add)
    keyed = add.options(idempotency_key="add-1")
    with engine.begin() as conn:
        first = keyed.enqueue(conn, a=1)
    with engine.begin() as conn:
        second = keyed.enqueue(conn, a=99)
    assert (first.created, second.created, second.id) == (True, False, first.id)
    assert [(r.args, r.idempotency_key) for r in _rows(engine)] == [({"a": 1}, "add-1")]


@pytest.mark.parametrize(("args", "kwargs", "match"), [
    ((), {"a": 1, "c": 3}, "unexpected keyword argument.*'c'"),   # misspelt
    ((), {}, "missing a required argument: 'a'"),
    ((1, 2, 3), {}, "3 positional arguments, at most 2"),
    ((1,), {"a": 2}, "multiple values for 'a'"),
    ((), {"a": datetime.now(timezone.utc)}, r"args\['a'\]"),         # not JSON
])
def test_bad_arguments_raise_and_leave_the_transaction_usable(
        app: flowq.FlowQ, engine: sa.Engine, args: tuple[Any, ...], kwargs: dict[str, Any],
        match: str) -> None:
    add = _define(app, _add)
    with engine.begin() as conn:
        with pytest.raises(flowq.InvalidArgumentsError, match=match):
            add.enqueue(conn, *args, **kwargs)
        with pytest.raises(flowq.InvalidArgumentsError, match=match):
            add.options(queue="q").enqueue(conn, *args, **kwargs)
        add.enqueue(conn, a=1)
    assert [r.args for r in _rows(engine)] == [{"a": 1}]


def test_bad_options_raise_at_enqueue(app: flowq.FlowQ, engine: sa.Engine) -> None:
    add = _define(app, _add)
    with engine.begin() as conn:
        with pytest.raises(flowq.InvalidQueueError):
            add.options(queue="bad queue!").enqueue(conn, a=1)
        with pytest.raises(flowq.InvalidArgumentsError, match="either run_at or delay"):
            add.options(run_at=datetime.now(timezone.utc), delay=1).enqueue(conn, a=1)
    assert _rows(engine) == []


def test_a_pipeline_enqueues_the_same_way_untyped(app: flowq.FlowQ, engine: sa.Engine) -> None:
    onboard = app.pipeline("onboard")

    @onboard.step()
    def create(ctx: flowq.Context, user_id: int) -> dict[str, int]:
        return {"account_id": user_id}

    with engine.begin() as conn:
        onboard.enqueue(conn, user_id=7)
        onboard.options(queue="signup").enqueue(conn, 8)
        with pytest.raises(flowq.InvalidArgumentsError, match="'usr_id'"):
            onboard.enqueue(conn, usr_id=9)
    assert [(r.task, r.step, r.queue, r.args) for r in _rows(engine)] == [
        ("onboard", "create", "default", {"user_id": 7}),
        ("onboard", "create", "signup", {"user_id": 8})]


def _run_async(db_url: str, fn: Callable[[AsyncEngine], Awaitable[T]]) -> T:
    async def main() -> T:
        engine = create_async_engine(db_url)  # postgresql+psycopg://: psycopg's async driver
        try:
            return await fn(engine)
        finally:
            await engine.dispose()

    return asyncio.run(main())


def test_the_async_twin(app: flowq.FlowQ, db_url: str, engine: sa.Engine) -> None:
    from flowq.enqueueing.aio import AsyncSession

    add = _define(app, _add)

    async def go(aengine: AsyncEngine) -> list[flowq.Enqueued]:
        Session = async_sessionmaker(aengine, class_=AsyncSession)
        async with Session.begin() as s:
            untyped = await s.enqueue(add, a=1, b=2)
            typed = await add.aenqueue(s, a=1, b=2)
            with pytest.raises(flowq.InvalidArgumentsError, match="'c'"):
                await add.aenqueue(s, a=1, c=3)  # type: ignore[call-arg]
        async with aengine.begin() as conn:
            keyed = [await add.options(idempotency_key="k", queue="aq").aenqueue(conn, 5)
                     for _ in range(2)]
        async with Session() as s:
            await add.aenqueue(s, a=6)
            await s.rollback()
        return [untyped, typed, *keyed]

    untyped, typed, first, second = _run_async(db_url, go)
    assert (first.created, second.created, second.id) == (True, False, first.id)
    rows = _rows(engine)
    assert [r.run_id for r in rows] == [untyped.id, typed.id, first.id]
    assert tuple(rows[0])[1:] == tuple(rows[1])[1:]
    assert (rows[2].queue, rows[2].args, rows[2].idempotency_key) == ("aq", {"a": 5}, "k")


def test_typed_enqueue_does_not_import_the_async_module() -> None:
    code = textwrap.dedent("""
        import sys, flowq
        app = flowq.FlowQ()
        @app.task()
        def t(ctx, x): ...
        try:  # validated and prepared, then refused by the sync execute: not a Session
            t.options(queue="q").enqueue(object(), x=1)
        except TypeError:
            pass
        assert "flowq.enqueueing.aio" not in sys.modules and "sqlalchemy.ext.asyncio" not in sys.modules
    """)
    # Run where the flowq this test imports comes first on sys.path.
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=FLOWQ_ROOT)


def test_the_documented_snippet_runs(db_url: str) -> None:
    section = (FLOWQ_ROOT / "docs" / "enqueue.md").read_text().split("## Typed enqueue")[1]
    code = section.split("```python\n")[1].split("```")[0]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=FLOWQ_ROOT, env={**os.environ, "DATABASE_URL": db_url},
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- what mypy --strict says ------------------------------------------------------------------

# Lines marked `# E: <code>` must get exactly that one error; every other line, none.
SNIPPET = '''\
from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

import flowq

app = flowq.FlowQ()


@app.task()
def add(ctx: flowq.Context, a: int, b: int = 0) -> int:
    return a + b


onboard = app.pipeline("onboard")


def produce(s: flowq.Session, conn: Connection) -> None:
    run: flowq.Enqueued = add.enqueue(s, a=1, b=2)
    add.enqueue(conn, 1, b=2)
    add.options(queue="q", priority=1, idempotency_key="k", run_at=datetime.now(timezone.utc),
                delay=None, schema="flowq").enqueue(s, a=1)
    add.options(delay=5.0).enqueue(conn, b=2, a=1)
    onboard.enqueue(s, anything=1)  # a pipeline's enqueue is untyped
    s.enqueue(add, a="x")  # so is session.enqueue

    add.enqueue(s, a=1, c=3)  # E: call-arg
    add.enqueue(s, a="not an int")  # E: arg-type
    add.enqueue(s)  # E: call-arg
    add.enqueue(s, 1, 2, 3)  # E: call-arg
    add.enqueue(s, a=1, queue="q")  # E: call-arg
    add.options(queu="q").enqueue(s, a=1)  # E: call-arg
    add.options(priority="high").enqueue(s, a=1)  # E: arg-type
    add.options(queue="q").enqueue(s, a=1, b="2")  # E: arg-type
    add.enqueue("not a session", a=1)  # E: arg-type
    print(run)


async def produce_async(s: AsyncSession, conn: AsyncConnection) -> None:
    run: flowq.Enqueued = await add.aenqueue(s, a=1)
    await add.options(delay=5).aenqueue(conn, 1, b=2)
    await add.aenqueue(s, a="x")  # E: arg-type
    await add.options(queue="q").aenqueue(conn, a=1, d=2)  # E: call-arg
    add.enqueue(s, a=1)  # E: arg-type
    print(run)
'''


def _mypy_errors(snippet: Path, cwd: Path) -> list[tuple[int, str]]:
    # Checks the flowq this test imports (MYPYPATH wins over the installed copy), from a
    # directory without a mypy configuration, so only --strict applies.
    env = {**os.environ, "MYPYPATH": str(FLOWQ_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--show-error-codes", "--no-color-output",
         "--no-error-summary", "--cache-dir", str(cwd / ".mypy_cache"), snippet.name],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    errors = re.findall(rf"^{re.escape(snippet.name)}:(\d+): error: .*\[([a-z-]+)\]$",
                        proc.stdout, re.MULTILINE)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    assert (proc.returncode == 1) == bool(errors), proc.stdout + proc.stderr
    return sorted((int(line), code) for line, code in errors)


def test_mypy_strict_refuses_what_the_handler_would_refuse(tmp_path: Path) -> None:
    snippet = tmp_path / "typed_snippet.py"
    snippet.write_text(SNIPPET)
    expected = sorted(
        (n, m.group(1)) for n, text in enumerate(SNIPPET.splitlines(), start=1)
        if (m := re.search(r"# E: ([a-z-]+)$", text)))
    assert len(expected) == 12
    assert _mypy_errors(snippet, tmp_path) == expected
