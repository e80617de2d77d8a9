"""Typed pipelines: what mypy and pyright say about `pipeline.enqueue(...)`.

A fixture of tests/acceptance/test_typing.py, checked, never run: a line ending in
`# expect error` must get an error from each checker, every other line none.
"""

from __future__ import annotations

from typing import Any, TypedDict

from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

import flowq

app = flowq.FlowQ()


class Account(TypedDict):
    account_id: int


@app.pipeline(retry=flowq.Retry(), timeout=30)
def onboard(ctx: flowq.Context, user_id: int, plan: str = "free") -> Account:
    return {"account_id": user_id}


@onboard.step()
def send_welcome(ctx: flowq.Context, account_id: int) -> None: ...


@app.pipeline(name="fulfil")
def take_order(ctx: flowq.Context, order_id: int, *, gift: bool = False) -> dict[str, Any]:
    return {"order_id": order_id}


by_name = app.pipeline("by_name", queue="q", priority=1)  # steps added later: untyped


@by_name.step()
def first(ctx: flowq.Context, x: int) -> None: ...


def produce(s: flowq.Session, conn: Connection) -> None:
    run: flowq.Enqueued = onboard.enqueue(s, user_id=1)
    onboard.enqueue(conn, 1, plan="pro")
    onboard.options(queue="q", idempotency_key="k").enqueue(s, user_id=1, plan="pro")
    take_order.enqueue(s, order_id=7, gift=True)
    by_name.enqueue(s, anything="goes")  # a pipeline created by name is Pipeline[...]
    print(run)

    onboard.enqueue(s, usr_id=1)  # expect error
    onboard.enqueue(s)  # expect error
    onboard.enqueue(s, user_id="1")  # expect error
    onboard.enqueue(s, user_id=1, queue="q")  # expect error
    onboard.options(queue="q").enqueue(s, user_id=1, pln="pro")  # expect error
    onboard.options(queue="q").enqueue(s)  # expect error
    onboard.options(queu="q")  # expect error
    take_order.enqueue(s, 7, True)  # expect error
    take_order.options(priority=1).enqueue(conn, orderid=7)  # expect error


async def produce_async(s: AsyncSession, conn: AsyncConnection) -> None:
    run: flowq.Enqueued = await onboard.aenqueue(s, user_id=1)
    await onboard.options(delay=5).aenqueue(conn, 2, plan="pro")
    await onboard.aenqueue(s, user_idd=1)  # expect error
    await onboard.aenqueue(s)  # expect error
    await onboard.options(delay=5).aenqueue(conn, user_id=1, plann="x")  # expect error
    onboard.enqueue(s, user_id=1)  # expect error
    print(run)


def annotate(s: flowq.Session, p: flowq.Pipeline, typed: flowq.Pipeline[[int]]) -> None:
    p.enqueue(s, 1, anything=2)  # a bare Pipeline is Pipeline[...]
    typed.enqueue(s, 1)
    typed.enqueue(s, "x")  # expect error


@app.pipeline()
async def fetch(ctx: object, url: str) -> None: ...


async def produce_fetch(s: AsyncSession) -> None:
    await fetch.aenqueue(s, url="https://example.com")
    await fetch.aenqueue(s, uri="https://example.com")  # expect error


@app.pipeline()  # expect error
def no_context(url: str) -> None: ...


@by_name.step()
def second(ctx: flowq.Context) -> Account:
    return {"account_id": 1}


def call_steps(ctx: flowq.Context) -> None:
    # A step called directly (in a test) is typed like its handler, return type included.
    account: Account = second(ctx)
    send_welcome(ctx, account_id=account["account_id"])
    send_welcome(ctx, account="x")  # expect error
    count: int = second(ctx)  # expect error
    print(count)
