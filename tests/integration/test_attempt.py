"""One attempt, one place: the same jobs run by a real worker and by the test kit end the same.

Each case is enqueued twice; one run is drained by `flowq.testing.drain` (the test kit, built
on `flowq.worker.attempt` and `flowq.worker.writes`), the other by a real in-process worker
(claimer, executor threads and loop, completer), and their rows are compared column by column:
status, attempts, result, the error's first line, and for a retry the time it is due. Then
`flowq.testing.run_step` is held to the same results and exceptions.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import sqlalchemy as sa
from tenacity import stop_after_attempt, wait_fixed

import flowq
from flowq import Context
from flowq.db.rows import ClaimedJob
from flowq.testing import drain, run_step, run_until_idle
from flowq.worker.attempt import Attempt, arun_attempt, run_attempt
from flowq.worker.model import Failed

WAIT = 30  # a retry's wait: long past the worker's idle horizon, so it is left pending


def make_app() -> flowq.FlowQ:
    app = flowq.FlowQ()

    @app.task()
    def double(ctx: Context, n: int) -> dict[str, int]:
        return {"n": 2 * n}

    @app.task()
    async def adouble(ctx: Context, n: int) -> dict[str, int]:
        return {"n": 2 * n}

    @app.task()
    def booked(ctx: Context, n: int) -> int:
        ctx.session.execute(sa.text("INSERT INTO ledger VALUES (:run, :n)"),
                            {"run": ctx.run_id, "n": n})
        return n

    @app.task(retry=flowq.Retry(stop=stop_after_attempt(3), wait=wait_fixed(WAIT)))
    def flaky(ctx: Context, n: int) -> None:
        raise ValueError(f"flaky {n}")

    @app.task()
    async def later(ctx: Context, n: int) -> None:
        raise flowq.RetryStep(after=WAIT + 15, reason=f"not yet {n}")

    @app.task(retry=flowq.Retry(max_attempts=1))
    def doomed(ctx: Context, n: int) -> None:
        raise RuntimeError(f"doomed {n}")

    @app.task()
    def unstorable(ctx: Context, n: int) -> Any:
        return {"n": float("nan")}

    @app.task()
    def enough(ctx: Context, n: int) -> None:
        raise flowq.CancelRun(f"enough {n}")

    chain = app.pipeline("chain")

    @chain.step()
    def first(ctx: Context, n: int) -> dict[str, int]:
        return {"m": n + 1}

    @chain.step()
    def second(ctx: Context, m: int) -> dict[str, int]:
        return {"total": m * 10}

    return app


CASES = ["double", "adouble", "booked", "flaky", "later", "doomed", "unstorable", "enough",
         "chain"]


def rows(conn: sa.Connection, run_id: int) -> list[dict[str, Any]]:
    """What a run's rows ended as: the columns both paths must agree on."""
    got = conn.execute(sa.text(
        "SELECT step, status, attempts, max_attempts, result, last_error, "
        "       extract(epoch FROM run_at - now()) AS due_in "
        "  FROM flowq.steps WHERE run_id = :run ORDER BY id"), {"run": run_id})
    return [{"step": r.step, "status": r.status, "attempts": r.attempts,
             "max_attempts": r.max_attempts, "result": r.result,
             "error": (r.last_error or "").splitlines()[0] if r.last_error else None,
             "due_in": float(r.due_in) if r.status == "pending" else None} for r in got]


def test_the_worker_and_the_test_kit_end_every_attempt_the_same(engine: sa.Engine,
                                                                 db_url: str) -> None:
    app = make_app()
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE ledger (run_id bigint, n int)"))
        # By definition, not by name: a name enqueue checks the arguments against whatever
        # live app defines that name, and another test's app may still be alive (GC timing).
        defs = {d.name: d for d in app}
        kit = {c: flowq.enqueue(conn, defs[c], n=3).id for c in CASES}
        real = {c: flowq.enqueue(conn, defs[c], n=3).id for c in CASES}

    drained = drain(engine, app, runs=kit.values(), skip_waits=False, raise_on_dead=False)
    with engine.connect() as conn:
        by_kit = {c: rows(conn, run) for c, run in kit.items()}
    run_until_idle(app, db_url, horizon=5.0)
    with engine.connect() as conn:
        by_worker = {c: rows(conn, run) for c, run in real.items()}
        ledger = dict(conn.execute(sa.text("SELECT run_id, n FROM ledger")).all())

    assert (drained.succeeded, drained.retried, drained.dead, drained.cancelled) == (5, 2, 2, 1)
    for case in CASES:
        kit_rows, worker_rows = by_kit[case], by_worker[case]
        for k, w in zip(kit_rows, worker_rows, strict=True):
            due_k, due_w = k.pop("due_in"), w.pop("due_in")
            assert k == w, case
            if due_k is not None:  # the wait of the policy (or of RetryStep), from either path
                assert due_w is not None and abs(due_k - due_w) < 5, case
                assert WAIT - 10 < due_k <= WAIT + 15, case
    assert [r["status"] for r in by_worker["flaky"]] == ["pending"]
    assert by_worker["flaky"][0]["error"] == "ValueError: flaky 3"
    assert by_worker["later"][0]["error"] == "RetryStep: not yet 3"
    assert by_worker["doomed"][0]["status"] == "dead"
    assert by_worker["unstorable"][0]["error"].startswith("InvalidResultError:")
    assert by_worker["enough"][0] == {"step": "enough", "status": "cancelled", "attempts": 1,
                                      "max_attempts": 10, "result": None,
                                      "error": "CancelRun: enough 3"}
    assert [r["result"] for r in by_worker["chain"]] == [{"m": 4}, {"total": 40}]
    assert ledger == {kit["booked"]: 3, real["booked"]: 3}  # ctx.session committed once each


def test_run_step_returns_and_raises_what_the_worker_stores() -> None:
    app = make_app()
    assert run_step(app.get("double"), n=3) == {"n": 6}  # type: ignore[arg-type]
    assert run_step(app.get("adouble"), n=3) == {"n": 6}  # type: ignore[arg-type]
    assert run_step(app.get("chain"), n=3) == {"m": 4}  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="flaky 3"):
        run_step(app.get("flaky"), n=3)  # type: ignore[arg-type]
    with pytest.raises(flowq.RetryStep):
        run_step(app.get("later"), n=3)  # type: ignore[arg-type]
    with pytest.raises(flowq.CancelRun):
        run_step(app.get("enough"), n=3)  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="InvalidResultError: step 'unstorable' returned "
                                             "a value flowq cannot store"):
        run_step(app.get("unstorable"), n=3)  # type: ignore[arg-type]


def claimed(task: str, *, attempts: int, max_attempts: int) -> ClaimedJob:
    return ClaimedJob(1, 1, 1, task, "", 0, "default", 0, attempts, max_attempts, '{"n": 1}',
                      False, 0.0)


def test_the_live_policy_caps_a_known_step_and_the_row_an_unknown_one() -> None:
    """One rule for the attempt cap (docs/pipelines.md): the step's live policy when the worker
    knows the step (the row's copy may be stale), the row's `max_attempts` when it does not."""
    app = make_app()
    # Enqueued when `flaky` allowed one attempt; the deployed policy allows three.
    stale = run_attempt(Attempt(app, claimed("flaky", attempts=1, max_attempts=1)))
    assert isinstance(stale, Failed) and stale.retry_in == WAIT
    last = run_attempt(Attempt(app, claimed("flaky", attempts=3, max_attempts=10)))
    assert isinstance(last, Failed) and last.retry_in is None
    # A task this worker does not know: retried with the default backoff up to the row's cap.
    for attempts, retried in ((1, True), (11, True), (12, False)):
        unknown = run_attempt(Attempt(app, claimed("renamed", attempts=attempts,
                                                   max_attempts=12)))
        assert isinstance(unknown, Failed), attempts
        assert unknown.text.startswith("UnknownTaskError: no task or pipeline named 'renamed'")
        assert (unknown.retry_in is not None) is retried, attempts
    # RetryStep (here from an async handler) counts against the same cap.
    capped = asyncio.run(arun_attempt(Attempt(app, claimed("later", attempts=10,
                                                           max_attempts=99))))
    assert isinstance(capped, Failed) and "attempt cap of 10" in capped.text
