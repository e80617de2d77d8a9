"""Child runs (flowq.children) through the test kit's drain, which runs attempts with the
worker's own parts: a child is started once, a wait returns results in order, a dead child
fails the wait, a cancel goes down the tree, hostile handles and arguments are refused, and
`flowq runs show` links parent and children. The real-process guarantees (a SIGKILL among
100 children, a `-c 1` worker) are in tests/acceptance/test_child_runs.py."""

from __future__ import annotations

import json
import warnings
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from support import enqueue_id as enqueue
from tenacity import stop_after_attempt

import flowq
from flowq.cli import main
from flowq.testing import drain, job_rows
from flowq.worker.pruner import Pruner

ONCE = flowq.Retry(stop=stop_after_attempt(1))
TWICE = flowq.Retry(stop=stop_after_attempt(2))


def run_of(engine: sa.Engine, run_id: int) -> flowq.runs.RunInfo:
    return flowq.runs.get_run(engine, run_id)


def links(engine: sa.Engine, parent: int) -> list[int]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text(
            "SELECT run_id FROM flowq.children WHERE parent_run_id = :p ORDER BY run_id"),
            {"p": parent}).scalars())


@pytest.fixture
def app() -> flowq.FlowQ:
    app = flowq.FlowQ()
    starts: list[int] = []

    @app.task(retry=ONCE)
    def square(ctx: flowq.Context, n: int) -> dict[str, int]:
        return {"n": n * n}

    @app.task(retry=ONCE)
    def boom(ctx: flowq.Context) -> None:
        raise ValueError("child exploded")

    @app.task(retry=TWICE)
    def parent(ctx: flowq.Context, count: int, fail_first: bool = False) -> dict[str, Any]:
        children = [ctx.start_child(square, n=i) for i in range(count)]
        starts.append(len(children))
        if fail_first and ctx.attempt == 1:
            raise RuntimeError("crash after starting the children")
        results = ctx.wait_all(children)
        return {"total": sum(r["n"] for r in results), "children": children}

    @app.task(retry=ONCE)
    def doomed(ctx: flowq.Context) -> None:
        ctx.wait(ctx.start_child(boom))

    @app.task(retry=ONCE)
    def middle(ctx: flowq.Context) -> Any:
        return ctx.wait(ctx.start_child("leaf", queue="default"))

    @app.task(retry=TWICE)
    def leaf(ctx: flowq.Context) -> None:
        raise flowq.RetryStep(after=3600, reason="never done")

    @app.task(retry=ONCE)
    def top(ctx: flowq.Context) -> Any:
        return ctx.wait(ctx.start_child(middle))

    @app.task(retry=ONCE)
    def stranger(ctx: flowq.Context, handle: Any) -> Any:
        return ctx.wait(handle)

    @app.task(retry=ONCE)
    def bad_child(ctx: flowq.Context, how: str) -> Any:
        if how == "args":
            return ctx.start_child(square, n=float("nan"))
        if how == "unknown":
            return ctx.start_child("no_such_tsak")
        if how == "key":
            return ctx.start_child(square, n=1, idempotency_key="k")
        return ctx.start_child(square, m=1)

    app.starts = starts  # type: ignore[attr-defined]
    return app


def test_a_childs_checkpoint_name_is_one_of_flowqs_own() -> None:
    assert flowq.children.CHILD_PREFIX.startswith(flowq.durable.RESERVED_PREFIX)


def test_a_parent_gets_its_childrens_results_in_order_and_a_retry_starts_none_twice(
        engine: sa.Engine, app: flowq.FlowQ) -> None:
    run_id = enqueue(engine, app.get("parent"), count=5, fail_first=True)
    drain(engine, app)
    parent = run_of(engine, run_id)
    assert parent.status == "succeeded"
    assert parent.result["total"] == sum(i * i for i in range(5))
    children = parent.result["children"]
    assert links(engine, run_id) == sorted(children) and len(set(children)) == 5
    # The first attempt crashed after starting them, the retry and every wake-up replayed.
    assert parent.steps[0].attempts == 2
    for i, child in enumerate(children):
        info = run_of(engine, child)
        assert info.status == "succeeded" and info.result == {"n": i * i}
        assert info.parent is not None and info.parent.run_id == run_id
        assert info.parent.step == "parent" and info.parent.name == f"flowq.child.{i}"
    assert [c.run_id for c in parent.children] == sorted(children)
    assert {c.status for c in parent.children} == {"succeeded"}


def test_the_completion_ending_a_child_wakes_its_waiting_parent(engine: sa.Engine,
                                                                app: flowq.FlowQ) -> None:
    """Without skipping waits, the parent's re-check is due later; the child's completion
    makes it due now, so one drain runs the child and then the parent to its end."""
    run_id = enqueue(engine, app.get("parent"), count=2)
    drain(engine, app, skip_waits=False)
    assert run_of(engine, run_id).status == "succeeded"


def test_a_childs_end_wakes_the_later_step_that_waits_for_it(
        engine: sa.Engine, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step starts a child and returns its handle; the next step waits for it. The child's
    end must wake that next step too, not only the step that started it: with the re-check
    pushed out to 10 minutes, only the wake-up can end the run within the test."""
    import threading

    monkeypatch.setattr(flowq.children, "MIN_RECHECK", 600.0)
    monkeypatch.setattr(flowq.children, "MAX_RECHECK", 600.0)
    app = flowq.FlowQ()
    release = threading.Event()

    @app.task(retry=ONCE)
    def slow(ctx: flowq.Context) -> dict[str, int]:
        assert release.wait(30)
        return {"n": 42}

    flow = app.pipeline("later_wait")

    @flow.step(retry=ONCE)
    def start(ctx: flowq.Context) -> dict[str, int]:
        return {"child": ctx.start_child(slow)}

    @flow.step(retry=ONCE)
    def collect(ctx: flowq.Context, child: int) -> Any:
        return ctx.wait(child)

    run_id = enqueue(engine, flow)
    with flowq.testing.running_worker(app, db_url, concurrency=2):
        later = datetime.now(timezone.utc) + timedelta(seconds=300)
        flowq.testing.wait_until(lambda: any(  # suspended: re-checking in 600 s
            r.step == "collect" and r.status == "pending" and r.run_at > later
            for r in job_rows(engine) if r.run_id == run_id),
            message="collect suspended in its wait")
        release.set()
        flowq.testing.wait_until(lambda: run_of(engine, run_id).status == "succeeded",
                                 message="the child's end woke collect")
    assert run_of(engine, run_id).result == {"n": 42}


def test_a_dead_child_fails_the_wait_with_child_failed(engine: sa.Engine,
                                                       app: flowq.FlowQ) -> None:
    run_id = enqueue(engine, app.get("doomed"))
    drain(engine, app, raise_on_dead=False, skip_waits=False)  # the dead child wakes it
    run = run_of(engine, run_id)
    assert run.status == "dead"
    error = run.steps[0].last_error or ""
    (child,) = links(engine, run_id)
    assert "ChildFailed" in error and f"child run {child} ended dead in step 'boom'" in error
    assert "child exploded" in error


def test_cancelling_a_run_cancels_its_children_and_grandchildren(engine: sa.Engine,
                                                                 app: flowq.FlowQ) -> None:
    run_id = enqueue(engine, app.get("top"))
    drain(engine, app, skip_waits=False)  # leaf waits an hour on its retry
    (child,) = links(engine, run_id)
    (grandchild,) = links(engine, child)
    assert run_of(engine, grandchild).status == "pending"
    result = flowq.runs.cancel_run(engine, run_id, reason="enough")
    assert result.child_runs == (child, grandchild)
    for rid in (run_id, child, grandchild):
        assert run_of(engine, rid).status == "cancelled"
    (row,) = job_rows(engine, where="run_id = :r", r=grandchild)
    assert row.last_error == f"enough (with its parent run {run_id})"
    # The CLI says so too, and cancelling again changes nothing.
    out = CliRunner().invoke(main, ["runs", "cancel", str(run_id), "--database-url",
                                    str(engine.url.render_as_string(hide_password=False))])
    assert out.exit_code == 0, out.output
    assert "already cancelled" in out.output


def test_a_dead_parent_leaves_its_children_running_and_its_cancel_stops_them(
        engine: sa.Engine, app: flowq.FlowQ) -> None:
    @app.task(retry=ONCE)
    def orphaning(ctx: flowq.Context) -> None:
        ctx.start_child("square", queue="elsewhere", n=2)  # a queue nobody drains here
        raise RuntimeError("the parent dies after starting its child")

    run_id = enqueue(engine, orphaning)
    drain(engine, app, queues=["default"], raise_on_dead=False)
    [child] = links(engine, run_id)
    assert run_of(engine, run_id).status == "dead"
    assert run_of(engine, child).status == "pending"  # left for a retry that waits for it

    result = flowq.runs.cancel_run(engine, run_id)
    assert result.child_runs == (child,) and not result.cancelled
    assert result.run.status == "dead" and run_of(engine, child).status == "cancelled"
    out = CliRunner().invoke(main, ["runs", "cancel", str(run_id), "--database-url",
                                    engine.url.render_as_string(hide_password=False)])
    assert out.exit_code == 2 and "nothing to cancel (retry it, or leave it)" in out.output


def test_a_child_gets_its_parents_deadline_and_is_cancelled_with_it(engine: sa.Engine,
                                                                    app: flowq.FlowQ) -> None:
    from flowq.worker.reaper import Reaper

    run_id = enqueue(engine, app.get("top"), deadline=3600)
    drain(engine, app, skip_waits=False)  # leaf waits an hour on its retry
    (child,) = links(engine, run_id)
    (grandchild,) = links(engine, child)
    deadline = run_of(engine, run_id).deadline
    assert deadline is not None
    assert run_of(engine, child).deadline == run_of(engine, grandchild).deadline == deadline
    with engine.begin() as conn:  # the deadline passes
        conn.execute(sa.text("UPDATE flowq.jobs SET deadline = now() - interval '1 second' "
                             "WHERE run_id IN (:a, :b, :c)"), {"a": run_id, "b": child,
                                                              "c": grandchild})
    Reaper(engine, "flowq", stale_after=30).run_once()
    for rid in (run_id, child, grandchild):
        assert run_of(engine, rid).status == "cancelled", rid
    # A parent without a deadline gives none.
    free_run = enqueue(engine, app.get("top"))
    drain(engine, app, skip_waits=False)
    (free,) = links(engine, free_run)
    assert run_of(engine, free).deadline is None


def test_a_child_started_by_a_cancelled_run_is_never_started(engine: sa.Engine,
                                                             app: flowq.FlowQ) -> None:
    run_id = enqueue(engine, app.get("parent"), count=3)
    with engine.begin() as conn:  # the cancel reaches the row while it runs
        conn.execute(sa.text("UPDATE flowq.jobs SET cancel_requested = true "
                             "WHERE run_id = :r"), {"r": run_id})
    drain(engine, app, raise_on_dead=False)
    assert links(engine, run_id) == []
    assert run_of(engine, run_id).status == "cancelled"
    assert len(job_rows(engine)) == 1  # no child row exists


@pytest.mark.parametrize(("how", "message"), [
    ("args", "is nan"), ("unknown", "UnknownTaskError"), ("key", "idempotency_key"), ("fit", "'m'")])
def test_child_arguments_are_checked_like_any_enqueue(engine: sa.Engine, app: flowq.FlowQ,
                                                      how: str, message: str) -> None:
    run_id = enqueue(engine, app.get("bad_child"), how=how)
    drain(engine, app, raise_on_dead=False)
    run = run_of(engine, run_id)
    assert run.status == "dead" and message in (run.steps[0].last_error or "")
    assert links(engine, run_id) == [] and len(job_rows(engine)) == 1


@pytest.mark.parametrize("handle", [True, "12", -1, 0, 2**63, [1], None])
def test_waiting_on_a_handle_that_is_not_a_child_is_a_clear_error(
        engine: sa.Engine, app: flowq.FlowQ, handle: Any) -> None:
    run_id = enqueue(engine, app.get("stranger"), handle=handle)
    drain(engine, app, raise_on_dead=False)
    run = run_of(engine, run_id)
    assert run.status == "dead" and "WorkflowError" in (run.steps[0].last_error or "")


def test_waiting_on_another_runs_child_names_it(engine: sa.Engine, app: flowq.FlowQ) -> None:
    other = enqueue(engine, app.get("square"), n=2)
    run_id = enqueue(engine, app.get("stranger"), handle=other)
    drain(engine, app, raise_on_dead=False)
    error = run_of(engine, run_id).steps[0].last_error or ""
    assert f"run {other} is not a child of run {run_id}" in error


def test_a_wait_on_a_thousand_children(engine: sa.Engine, app: flowq.FlowQ) -> None:
    run_id = enqueue(engine, app.get("parent"), count=1000)
    drain(engine, app, max_jobs=2000)
    run = run_of(engine, run_id)
    assert run.result["total"] == sum(i * i for i in range(1000))
    assert len(links(engine, run_id)) == 1000
    assert len(run.children) == 1000


def test_runs_show_links_parent_and_children(engine: sa.Engine, app: flowq.FlowQ) -> None:
    run_id = enqueue(engine, app.get("parent"), count=2)
    drain(engine, app)
    url = engine.url.render_as_string(hide_password=False)
    children = links(engine, run_id)
    out = CliRunner().invoke(main, ["runs", "show", str(run_id), "--database-url", url])
    assert out.exit_code == 0, out.output
    assert "children (2):" in out.output and f"run {children[0]} succeeded" in out.output
    out = CliRunner().invoke(main, ["runs", "show", str(children[1]), "--database-url", url,
                                    "--json"])
    data = json.loads(out.output)
    assert data["parent"]["run_id"] == run_id and data["parent"]["name"] == "flowq.child.1"
    assert data["children"] == []


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_dashboards_run_page_links_parent_and_children(engine: sa.Engine,
                                                           app: flowq.FlowQ) -> None:
    with warnings.catch_warnings():  # it will move to httpx2; what it tests does not change
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient
    from flowq.dashboard import create_app

    run_id = enqueue(engine, app.get("parent"), count=2)
    drain(engine, app)
    children = links(engine, run_id)
    c = TestClient(create_app(engine), base_url="http://127.0.0.1:8080")
    page = c.get(f"/runs/{run_id}")
    assert page.status_code == 200
    assert 'id="children"' in page.text
    assert all(f'href="/runs/{child}"' in page.text for child in children)
    page = c.get(f"/runs/{children[0]}")
    assert page.status_code == 200 and f'href="/runs/{run_id}"' in page.text


def test_the_pruner_deletes_a_parents_links_with_it(engine: sa.Engine,
                                                    app: flowq.FlowQ) -> None:
    run_id = enqueue(engine, app.get("parent"), count=2)
    drain(engine, app)
    Pruner(engine, "flowq", retention=0.0, dead_retention=0.0).run_once()
    assert links(engine, run_id) == []
