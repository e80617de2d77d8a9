"""The workflows of the workflow fault tests (tests/acceptance/test_workflow_faults.py): DAG joins, a
map, signals, and run control, run by real `flowq worker` processes.

Every step that writes `ledger(ctx, ...)` inserts one row through `ctx.session`, so the row
commits with the step's success (and the creation or counting of its successors) or not at
all: after any crash, a step that succeeded has exactly one ledger row, written by the very
attempt whose result the next step received. A result names that attempt (`mark(ctx)`:
`step:job_id:attempt:pid`), so a test can match the join's inputs to its parents' rows.

Pipelines (names are prefixed `wf_`, so they never meet another app's definitions in the
test process's registry):

- `wf_diamond`: start -> left, right -> join; every step writes a ledger row. `sleep`
  holds left and right (half before their ledger write, half after, inside their open
  transaction), so a SIGKILL finds them either not yet in the database or mid-transaction.
- `wf_race`: the same diamond without `ctx.session` in start, left and right (their
  completions are batched by the completer: both parents of one join may complete in one
  statement), and the join writing the ledger.
- `wf_fan`: split (its first attempt held `hold` seconds after its ledger write) maps `work` over `n` items;
  `work` fails its first attempt for item `FLAKY_ITEM` only (and sleeps `sleep` seconds);
  `total` receives the results in item order.
- `wf_approval`: request (held `hold` seconds) -> publish, which waits for signal
  `approval` (7 days).
- `wf_hasty`: ask -> hurry, which waits for signal `answer` for one second only, with the
  default retry policy (a SignalTimeout is not retried: the step ends dead).
- `wf_fixable`: start -> left, right -> join; right fails until the switch `fixed` is on
  (two attempts, then dead).
- `wf_gated`: start -> hold (waits for signal `go`), slow (runs until the switch
  `release:<run_id>` is on) -> join.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any, Final

import sqlalchemy as sa
from tenacity import stop_after_attempt, wait_fixed

import flowq
from flowq.durable.context import Context

__all__ = ["FLAKY_ITEM", "LEDGER_DDL", "app", "item_value", "ledger", "mark"]

app = flowq.FlowQ()

LEDGER_DDL: Final = (
    "CREATE TABLE IF NOT EXISTS workflow_ledger (id bigserial PRIMARY KEY, run_id bigint NOT "
    "NULL, step text NOT NULL, job_id bigint NOT NULL, attempt int NOT NULL, pid int NOT NULL,"
    " payload jsonb);"
    "CREATE TABLE IF NOT EXISTS workflow_switches (name text PRIMARY KEY)")

# Each crash or reap costs a step an attempt: room for plenty, at once.
PATIENT: Final = flowq.Retry(stop=stop_after_attempt(30), wait=wait_fixed(0))
TWO_TRIES: Final = flowq.Retry(stop=stop_after_attempt(2), wait=wait_fixed(0))
FLAKY_ITEM: Final = 1234
GATE_DEADLINE: Final = 90.0  # seconds a gated step waits for its switch at most


def mark(ctx: Context) -> str:
    """Which attempt produced a result."""
    return f"{ctx.step}:{ctx.job_id}:{ctx.attempt}:{os.getpid()}"


def ledger(ctx: Context, payload: Any = None) -> None:
    """One row for this step of this run, committed with the step's success or not at all."""
    ctx.session.execute(sa.text(
        "INSERT INTO workflow_ledger (run_id, step, job_id, attempt, pid, payload) "
        "VALUES (:r, :s, :j, :a, :p, CAST(:payload AS jsonb))"),
        {"r": ctx.run_id, "s": ctx.step, "j": ctx.job_id, "a": ctx.attempt, "p": os.getpid(),
         "payload": json.dumps(payload)})


def switch_on(ctx: Context, name: str) -> bool:
    return ctx.session.execute(sa.text("SELECT 1 FROM workflow_switches WHERE name = :n"),
                               {"n": name}).first() is not None


def item_value(i: int) -> int:
    """What `work` returns for item i: a permutation of the items, so that order matters."""
    return (i * 7919) % 10007


# -- wf_diamond: every step writes the ledger ----------------------------------------------

diamond = app.pipeline("wf_diamond")


@diamond.step(name="start", retry=PATIENT)
def d_start(ctx: Context, n: int, sleep: float = 0.0) -> dict[str, Any]:
    ledger(ctx, {"n": n})
    return {"n": n, "sleep": sleep}


def _branch(ctx: Context, n: int, sleep: float, value: int) -> dict[str, Any]:
    time.sleep(sleep / 2)
    ledger(ctx, {"n": n})
    time.sleep(sleep / 2)  # with the step's transaction open
    return {"n": n, "v": value, "by": mark(ctx)}


@diamond.step(name="left", parents=["start"], retry=PATIENT)
def d_left(ctx: Context, n: int, sleep: float) -> dict[str, Any]:
    return _branch(ctx, n, sleep, n + 1)


@diamond.step(name="right", parents=["start"], retry=PATIENT)
def d_right(ctx: Context, n: int, sleep: float) -> dict[str, Any]:
    return _branch(ctx, n, sleep, n * 10)


@diamond.step(name="join", parents=["left", "right"], retry=PATIENT)
def d_join(ctx: Context, left: dict[str, Any], right: dict[str, Any]) -> dict[str, Any]:
    ledger(ctx, {"left": left, "right": right})
    return {"n": left["n"], "sum": left["v"] + right["v"], "by": mark(ctx)}


# -- wf_race: batched completions of both parents ------------------------------------------

race = app.pipeline("wf_race")


@race.step(name="start", retry=PATIENT)
def r_start(ctx: Context, n: int, sleep: float) -> dict[str, Any]:
    return {"n": n, "sleep": sleep}


@race.step(name="left", parents=["start"], retry=PATIENT)
def r_left(ctx: Context, n: int, sleep: float) -> dict[str, Any]:
    time.sleep(sleep)
    return {"n": n, "v": n + 1, "by": mark(ctx)}


@race.step(name="right", parents=["start"], retry=PATIENT)
def r_right(ctx: Context, n: int, sleep: float) -> dict[str, Any]:
    time.sleep(sleep)
    return {"n": n, "v": n * 10, "by": mark(ctx)}


@race.step(name="join", parents=["left", "right"], retry=PATIENT)
def r_join(ctx: Context, left: dict[str, Any], right: dict[str, Any]) -> dict[str, Any]:
    ledger(ctx, {"left": left, "right": right})
    return {"n": left["n"], "sum": left["v"] + right["v"], "by": mark(ctx)}


# -- wf_fan: a map of many items, one of them flaky ------------------------------------------

fan = app.pipeline("wf_fan")


@fan.step(retry=PATIENT)
def split(ctx: Context, n: int, sleep: float = 0.0, hold: float = 0.0,
          session: bool = False) -> flowq.Each:
    ledger(ctx, {"n": n})
    if ctx.attempt == 1:
        time.sleep(hold)  # with the step's transaction open
    extra = {**({"sleep": sleep} if sleep else {}), **({"session": True} if session else {})}
    return flowq.each([{"i": i, **extra} for i in range(n)])


@fan.step(retry=PATIENT)
def work(ctx: Context, i: int, sleep: float = 0.0, session: bool = False) -> int:
    if i == FLAKY_ITEM and ctx.attempt == 1:
        raise RuntimeError(f"item {i} fails its first attempt")
    time.sleep(sleep)
    if session:  # committed with the instance's success, one transaction per instance
        ledger(ctx, {"i": i})
    return item_value(i)


@fan.step(retry=PATIENT)
def total(ctx: Context, work: list[int]) -> dict[str, Any]:
    summary = {"count": len(work), "sum": sum(work),
               "weighted": sum(k * v for k, v in enumerate(work)),
               "in_order": work == [item_value(i) for i in range(len(work))],
               "head": work[:3], "tail": work[-3:]}
    ledger(ctx, summary)
    return summary


# -- wf_approval / wf_hasty: signals ---------------------------------------------------------

approval = app.pipeline("wf_approval")


@approval.step(retry=PATIENT)
def request(ctx: Context, doc: str, hold: float = 0.0) -> dict[str, Any]:
    time.sleep(hold)
    ledger(ctx, {"doc": doc})
    return {"doc": doc}


@approval.step(wait_for="approval", retry=PATIENT)
def publish(ctx: Context, doc: str, approval: Any) -> dict[str, Any]:
    ledger(ctx, {"doc": doc, "approval": approval})
    return {"doc": doc, "approval": approval}


hasty = app.pipeline("wf_hasty")


@hasty.step(retry=PATIENT)
def ask(ctx: Context, doc: str) -> dict[str, Any]:
    ledger(ctx, {"doc": doc})
    return {"doc": doc}


@hasty.step(wait_for="answer", wait_timeout=timedelta(seconds=1))  # default policy
def hurry(ctx: Context, doc: str, answer: Any) -> dict[str, Any]:
    ledger(ctx, {"doc": doc, "answer": answer})
    return {"doc": doc, "answer": answer}


# -- wf_fixable: one branch dies until fixed -------------------------------------------------

fixable = app.pipeline("wf_fixable")


@fixable.step(name="start", retry=PATIENT)
def f_start(ctx: Context, n: int) -> dict[str, Any]:
    ledger(ctx, {"n": n})
    return {"n": n}


@fixable.step(name="left", parents=["start"], retry=PATIENT)
def f_left(ctx: Context, n: int) -> dict[str, Any]:
    ledger(ctx, {"n": n})
    return {"n": n, "v": n + 1, "by": mark(ctx)}


@fixable.step(name="right", parents=["start"], retry=TWO_TRIES)
def f_right(ctx: Context, n: int) -> dict[str, Any]:
    if not switch_on(ctx, "fixed"):
        raise RuntimeError(f"not fixed yet (attempt {ctx.attempt})")
    ledger(ctx, {"n": n})
    return {"n": n, "v": n * 10, "by": mark(ctx)}


@fixable.step(name="join", parents=["left", "right"], retry=PATIENT)
def f_join(ctx: Context, left: dict[str, Any], right: dict[str, Any]) -> dict[str, Any]:
    ledger(ctx, {"left": left, "right": right})
    return {"n": left["n"], "sum": left["v"] + right["v"]}


# -- wf_gated: a waiting branch and a running branch, for cancel ----------------------------

gated = app.pipeline("wf_gated")


@gated.step(name="start", retry=PATIENT)
def g_start(ctx: Context, n: int) -> dict[str, Any]:
    ledger(ctx, {"n": n})
    return {"n": n}


@gated.step(name="hold", parents=["start"], wait_for="go", retry=PATIENT)
def g_hold(ctx: Context, n: int, go: Any) -> dict[str, Any]:
    ledger(ctx, {"n": n, "go": go})
    return {"n": n}


@gated.step(name="slow", parents=["start"], retry=PATIENT)
def g_slow(ctx: Context, n: int) -> dict[str, Any]:
    deadline = time.monotonic() + GATE_DEADLINE
    while not switch_on(ctx, f"release:{ctx.run_id}") and time.monotonic() < deadline:
        time.sleep(0.05)
    ledger(ctx, {"n": n})
    return {"n": n, "by": mark(ctx)}


@gated.step(name="join", parents=["hold", "slow"], retry=PATIENT)
def g_join(ctx: Context, hold: dict[str, Any], slow: dict[str, Any]) -> dict[str, Any]:
    ledger(ctx, {"hold": hold, "slow": slow})
    return {"n": hold["n"]}
