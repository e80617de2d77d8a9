"""Test pipelines: every step writes a ledger row through ctx.session (so a row exists exactly
once per committed step) and some misbehave on purpose.

`app` is the deployed version; `app_v2` is a later deploy in which the pipeline `renamed`
is called `renamed_v2` and the pipeline `deploy` lost its step `second`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from tenacity import stop_after_attempt, wait_fixed

import flowq
from flowq.durable.context import Context

app = flowq.FlowQ()
app_v2 = flowq.FlowQ()

LEDGER_DDL = (
    "CREATE TABLE IF NOT EXISTS pipeline_ledger (id bigserial PRIMARY KEY, run_id bigint NOT "
    "NULL, step text NOT NULL, job_id bigint NOT NULL, attempt int NOT NULL, pid int NOT NULL, "
    "queue text NOT NULL, payload jsonb);"
    "CREATE TABLE IF NOT EXISTS switches (name text PRIMARY KEY)")
FAST = flowq.Retry(stop=stop_after_attempt(5), wait=wait_fixed(0))
TWO_TRIES = flowq.Retry(stop=stop_after_attempt(2), wait=wait_fixed(0))
THREE_TRIES = flowq.Retry(stop=stop_after_attempt(3), wait=wait_fixed(0))


def ledger(ctx: Context, payload: dict[str, Any] | None = None) -> None:
    """One row for this step of this run, committed with the step's success or not at all."""
    ctx.session.execute(sa.text(
        "INSERT INTO pipeline_ledger (run_id, step, job_id, attempt, pid, queue, payload) "
        "VALUES (:r, :s, :j, :a, :p, :q, CAST(:payload AS jsonb))"),
        {"r": ctx.run_id, "s": ctx.step, "j": ctx.job_id, "a": ctx.attempt, "p": os.getpid(),
         "q": ctx.queue, "payload": json.dumps(payload)})


# -- chain3: three steps, the middle one flaky (and optionally slow) -------------------------

chain3 = app.pipeline("chain3")


@chain3.step(retry=FAST)
def create(ctx: Context, n: int, fail_times: int = 0, sleep: float = 0.0) -> dict[str, Any]:
    ledger(ctx)
    return {"n": n, "account": n * 10, "fail_times": fail_times, "sleep": sleep}


@chain3.step(retry=FAST)
def flaky(ctx: Context, n: int, account: int, fail_times: int, sleep: float) -> dict[str, Any]:
    if sleep:
        time.sleep(sleep)
    ledger(ctx)  # rolled back with a failed attempt
    if ctx.attempt <= fail_times:
        raise RuntimeError(f"flaky failure {ctx.attempt} of run {ctx.run_id}")
    return {"n": n, "token": f"tok-{n}-{account}"}


@chain3.step(retry=FAST)
def finish(ctx: Context, n: int, token: str) -> dict[str, Any]:
    ledger(ctx, {"token": token})
    return {"n": n, "done": token}


# -- keys: ctx.idempotency_key per step, observed across a failed and a good attempt --------

keys = app.pipeline("keys")


@keys.step(name="key_a", retry=FAST)
def key_a(ctx: Context, n: int) -> dict[str, Any]:
    if ctx.attempt == 1:
        raise RuntimeError(f"key={ctx.idempotency_key}")
    return {"n": n, "key_a": ctx.idempotency_key}


@keys.step(name="key_b", retry=FAST)
def key_b(ctx: Context, n: int, key_a: str) -> dict[str, Any]:
    if ctx.attempt == 1:
        raise RuntimeError(f"key={ctx.idempotency_key}")
    return {"key_a": key_a, "key_b": ctx.idempotency_key}


# -- misfit: a result that does not fit the next step ---------------------------------------

misfit = app.pipeline("misfit")


@misfit.step(retry=FAST)
def produce(ctx: Context, n: int) -> dict[str, Any]:
    ledger(ctx)
    return {"wrong": n}


@misfit.step(retry=FAST)
def consume(ctx: Context, n: int) -> None:
    ledger(ctx)


# -- queued: the middle step runs on another queue ------------------------------------------

queued = app.pipeline("queued")


@queued.step(name="local_1", retry=FAST)
def local_1(ctx: Context, n: int) -> dict[str, Any]:
    ledger(ctx)
    return {"n": n}


@queued.step(retry=FAST, queue="reports")
def report(ctx: Context, n: int) -> dict[str, Any]:
    ledger(ctx)
    return {"n": n}


@queued.step(name="local_2", retry=FAST)
def local_2(ctx: Context, n: int) -> dict[str, Any]:
    ledger(ctx)
    return {"n": n}


# -- policies: per-step attempt caps and timeouts --------------------------------------------

policies = app.pipeline("policies")


@policies.step(name="slow_once", retry=THREE_TRIES, timeout=0.5)
def slow_once(ctx: Context, n: int) -> dict[str, Any]:
    if ctx.attempt == 1:
        time.sleep(5)  # abandoned at the timeout; the late result is discarded
    ledger(ctx)
    return {"n": n}


@policies.step(name="always_fails", retry=TWO_TRIES)
def always_fails(ctx: Context, n: int) -> None:
    raise ValueError(f"always fails (attempt {ctx.attempt})")


# -- gated: step two waits for a file, so a test can act while it is running -----------------

gated = app.pipeline("gated")


@gated.step(name="gate_open", retry=FAST)
def gate_open(ctx: Context, n: int, gate: str) -> dict[str, Any]:
    ledger(ctx)
    return {"n": n, "gate": gate}


@gated.step(name="gate_wait", retry=FAST)
def gate_wait(ctx: Context, n: int, gate: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while not Path(gate).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    ledger(ctx)
    return {"n": n}


@gated.step(name="gate_after", retry=FAST)
def gate_after(ctx: Context, n: int) -> None:
    ledger(ctx)


# -- fixable: step two dies until the switch 'fixed' is on -----------------------------------

fixable = app.pipeline("fixable")


@fixable.step(name="fix_one", retry=FAST)
def fix_one(ctx: Context, n: int) -> dict[str, Any]:
    ledger(ctx)
    return {"n": n, "from_one": n * 2}


@fixable.step(name="fix_two", retry=TWO_TRIES)
def fix_two(ctx: Context, n: int, from_one: int) -> dict[str, Any]:
    if ctx.session.execute(sa.text("SELECT 1 FROM switches WHERE name = 'fixed'")).first() is None:
        raise RuntimeError("not fixed yet")
    ledger(ctx)
    return {"n": n, "total": from_one + 1}


# -- deploys: a pipeline renamed, and one that loses a step, in app_v2 -----------------------


def _start(ctx: Context, n: int) -> dict[str, Any]:
    ledger(ctx)
    return {"n": n}


def _second(ctx: Context, n: int) -> dict[str, Any]:
    ledger(ctx)
    return {"n": n}


renamed = app.pipeline("renamed")
renamed.step(name="start", retry=THREE_TRIES)(_start)

renamed_v2 = app_v2.pipeline("renamed_v2")
renamed_v2.step(name="start", retry=THREE_TRIES)(_start)

deploy = app.pipeline("deploy")
deploy.step(name="first", retry=THREE_TRIES)(_start)
deploy.step(name="second", retry=THREE_TRIES, queue="deploy2")(_second)

deploy_v2 = app_v2.pipeline("deploy")
deploy_v2.step(name="first", retry=THREE_TRIES)(_start)
