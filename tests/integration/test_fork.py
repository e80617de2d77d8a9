"""flowq.runs.fork and `flowq runs fork`: a new run from a step of an ended run, reusing the
outputs recorded before it, with today's code; against a real PostgreSQL, steps run by the
test kit's `drain`.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
import sqlalchemy as sa
from runs_cli import cli, cli_json

import flowq
from flowq.durable.context import Context
from flowq.ops.runs import fork, get_run
from flowq.testing import drain

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # starlette's client
app = flowq.FlowQ()
ONCE = flowq.Retry(max_attempts=1)
calls: list[tuple[int, str, dict[str, Any]]] = []  # (run, step, arguments)
broken: set[str] = set()  # the steps that fail today


def called(ctx: Context, **args: Any) -> None:
    calls.append((ctx.run_id, ctx.step, args))
    if ctx.step in broken:
        raise RuntimeError(f"{ctx.step} is broken")


four = app.pipeline("fork_four")


@four.step(retry=ONCE)
def one(ctx: Context, n: int) -> dict[str, Any]:
    called(ctx, n=n)
    return {"n": n, "a": n + 1}


@four.step(retry=ONCE)
def two(ctx: Context, n: int, a: int) -> dict[str, Any]:
    called(ctx, n=n, a=a)
    return {"n": n, "b": a * 10}


@four.step(retry=ONCE)
def three(ctx: Context, n: int, b: int) -> dict[str, Any]:
    called(ctx, n=n, b=b)
    return {"c": b + n}


@four.step(retry=ONCE)
def four_(ctx: Context, c: int) -> dict[str, Any]:
    called(ctx, c=c)
    return {"d": c * 2}


diamond = app.pipeline("fork_diamond")


@diamond.step(retry=ONCE)
def top(ctx: Context, n: int) -> dict[str, Any]:
    called(ctx, n=n)
    return {"n": n}


@diamond.step(parents=[top], retry=ONCE)
def left(ctx: Context, n: int) -> dict[str, Any]:
    called(ctx, n=n)
    return {"v": n + 1}


@diamond.step(parents=[top], retry=ONCE)
def right(ctx: Context, n: int) -> dict[str, Any]:
    called(ctx, n=n)
    return {"v": n + 2}


@diamond.step(parents=[left, right], retry=ONCE)
def bottom(ctx: Context, left: dict[str, Any], right: dict[str, Any]) -> dict[str, Any]:
    called(ctx, left=left, right=right)
    return {"sum": left["v"] + right["v"]}


@pytest.fixture(autouse=True)
def _fresh() -> None:
    calls.clear()
    broken.clear()


def run_all(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        drain(conn, app, raise_on_dead=False)


def start(engine: sa.Engine, pipeline: flowq.Pipeline, **args: Any) -> int:
    with engine.begin() as conn:
        return flowq.enqueue(conn, pipeline, **args).id


def dead_at(engine: sa.Engine, pipeline: flowq.Pipeline, step: str, **args: Any) -> int:
    broken.add(step)
    run_id = start(engine, pipeline, **args)
    run_all(engine)
    assert get_run(engine, run_id).status == "dead"
    broken.clear()
    calls.clear()
    return run_id


def test_a_fork_from_step_3_of_a_dead_run_runs_steps_3_and_4_with_step_2s_output(
        engine: sa.Engine, db_url: str) -> None:
    old = dead_at(engine, four, "three", n=2)
    before = get_run(engine, old)
    forked = fork(engine, old, from_step="three")
    assert forked.source_run_id == old and forked.from_step == "three"
    assert forked.args == {"n": 2, "b": 30}  # step two's recorded output
    run_all(engine)
    new = get_run(engine, forked.run_id)
    assert new.status == "succeeded" and new.result == {"d": 64}
    assert [s.step for s in new.steps] == ["three", "four_"]
    assert calls == [(forked.run_id, "three", {"n": 2, "b": 30}),
                     (forked.run_id, "four_", {"c": 32})]
    assert new.forked_from == old
    after = get_run(engine, old)
    assert after.status == "dead" and after.steps == before.steps  # untouched
    assert after.forked_from is None
    code, out, err = cli(db_url, "show", str(forked.run_id))
    assert code == 0, err
    assert f"forked from run {old}" in out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient
    from flowq.dashboard import create_app

    page = TestClient(create_app(engine), base_url="http://127.0.0.1:8080").get(
        f"/runs/{forked.run_id}")
    assert page.status_code == 200
    assert f'<dd id="forked-from"><a href="/runs/{old}">run {old}</a></dd>' in page.text


def test_the_cli_forks_with_args(engine: sa.Engine, db_url: str) -> None:
    old = dead_at(engine, four, "four_", n=1)
    data = cli_json(db_url, "fork", str(old), "--from", "four_", "--args",
                    json.dumps({"c": 100}), "--app", "test_fork:app")
    assert data["forked_from"] == old and data["from_step"] == "four_"
    assert data["args"] == {"c": 100} and data["run"]["forked_from"] == old
    run_all(engine)
    assert get_run(engine, data["run_id"]).result == {"d": 200}
    assert calls == [(data["run_id"], "four_", {"c": 100})]


def test_a_fork_from_a_step_never_reached_takes_its_parents_output(engine: sa.Engine) -> None:
    old = dead_at(engine, four, "two", n=5)
    with pytest.raises(flowq.RunStateError, match=r"'three' was never reached in run .*'two' "
                                                   r"did not succeed there; fork from 'two'"):
        fork(engine, old, from_step="three")
    forked = fork(engine, old, from_step="two")
    assert forked.args == {"n": 5, "a": 6}
    run_all(engine)
    assert get_run(engine, forked.run_id).result == {"d": 130}  # b=60, c=65
    assert [step for _, step, _ in calls] == ["two", "three", "four_"]


def test_a_join_is_forked_with_every_parents_output(engine: sa.Engine) -> None:
    old = dead_at(engine, diamond, "bottom", n=1)
    forked = fork(engine, old, from_step="bottom")
    assert forked.args == {"left": {"v": 2}, "right": {"v": 3}}
    run_all(engine)
    assert get_run(engine, forked.run_id).result == {"sum": 5}


def test_a_fork_whose_later_step_needs_a_step_before_it_is_refused(engine: sa.Engine) -> None:
    old = dead_at(engine, diamond, "bottom", n=1)
    with pytest.raises(flowq.InvalidArgumentsError,
                       match="cannot fork from 'left': step 'bottom' after it also waits for "
                             "'right', which would not run in the fork"):
        fork(engine, old, from_step="left")
    forked = fork(engine, old, from_step="top")  # the whole graph again
    run_all(engine)
    assert get_run(engine, forked.run_id).result == {"sum": 5}


def test_refusals_are_clear_sentences(engine: sa.Engine, db_url: str) -> None:
    old = dead_at(engine, four, "three", n=2)
    with pytest.raises(flowq.InvalidArgumentsError,
                       match="'fork_four' has no step 'thre': did you mean 'three'"):
        fork(engine, old, from_step="thre")
    with pytest.raises(flowq.InvalidArgumentsError, match="from_step is a step's name"):
        fork(engine, old, from_step=3)  # type: ignore[arg-type]
    with pytest.raises(flowq.InvalidArgumentsError, match="args must be a JSON object"):
        fork(engine, old, from_step="three", args=[1])  # type: ignore[arg-type]
    with pytest.raises(flowq.InvalidArgumentsError, match="arguments for step 'three'"):
        fork(engine, old, from_step="three", args={"nope": 1})
    with pytest.raises(flowq.InvalidArgumentsError, match="is nan, which JSON cannot"):
        fork(engine, old, from_step="three", args={"n": float("nan"), "b": 1})
    with pytest.raises(flowq.RunNotFoundError, match="no run 424242 exists"):
        fork(engine, 424242, from_step="three")
    running = start(engine, four, n=1)
    with pytest.raises(flowq.RunStateError, match=f"run {running} is still pending: fork a run "
                                                   "once it has ended"):
        fork(engine, running, from_step="two")
    code, _, err = cli(db_url, "fork", str(old), "--from", "three", "--args", "{not json",
                       "--app", "test_fork:app")
    assert code == 2 and "--args is not JSON" in err
    code, _, err = cli(db_url, "fork", str(old), "--from", "three", "--args", "[1]",
                       "--app", "test_fork:app")
    assert code == 2 and "--args must be a JSON object" in err
    code, _, err = cli(db_url, "fork", str(old), "--from", "nowhere", "--app", "test_fork:app")
    assert code == 2 and "has no step 'nowhere'" in err and "Traceback" not in err
    with engine.connect() as conn:  # nothing was enqueued by the refusals
        runs = conn.execute(sa.text("SELECT count(DISTINCT run_id) FROM flowq.steps")).scalar()
    assert runs == 2
