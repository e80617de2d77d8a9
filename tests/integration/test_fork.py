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


# -- what the forked step recorded: reused by default, run again when asked -------------------

shop = app.pipeline("fork_shop")
labels: list[int] = []  # an external effect: a label printed (outside the database)


def charge(order_id: int, *, session: Any) -> dict[str, Any]:
    """The payment: a row in `charges`, written through the checkpoint's session."""
    session.execute(sa.text("INSERT INTO charges (order_id) VALUES (:o)"), {"o": order_id})
    return {"charge": f"ch-{order_id}"}


def print_label(order_id: int) -> str:
    labels.append(order_id)
    return f"LBL-{order_id}"


@shop.step(retry=ONCE)
def place(ctx: Context, order_id: int) -> dict[str, Any]:
    return {"order_id": order_id}


@shop.step(retry=ONCE)
def charge_and_ship(ctx: Context, order_id: int) -> dict[str, Any]:
    paid = ctx.checkpoint("charge", charge, order_id)
    ctx.sleep(3600)  # a durable sleep between the charge and the label
    label = ctx.checkpoint("label", print_label, order_id)
    called(ctx, order_id=order_id)
    return {"order_id": order_id, "charge": paid["charge"], "label": label}


@shop.step(retry=ONCE)
def notify(ctx: Context, order_id: int, charge: str, label: str) -> dict[str, Any]:
    ctx.checkpoint("mail", lambda: f"mail-{order_id}")
    called(ctx, order_id=order_id)
    return {"done": charge}


@pytest.fixture
def charges(engine: sa.Engine) -> sa.Engine:
    labels.clear()
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE charges (id serial PRIMARY KEY, order_id int)")
    return engine


def charged(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM charges")).scalar_one())


def dead_after_charging(engine: sa.Engine) -> int:
    """A run of `fork_shop` that charged and printed its label, then died in its step."""
    old = dead_at(engine, shop, "charge_and_ship", order_id=3)
    assert charged(engine) == 1 and labels == [3]
    return old


def drain_waiting(engine: sa.Engine) -> None:
    """Run what is due, a durable sleep sleeping for real (not skipped)."""
    with engine.begin() as conn:
        drain(conn, app, raise_on_dead=False, skip_waits=False)


def test_a_fork_reuses_the_forked_steps_checkpoints_and_does_not_charge_again(
        engine: sa.Engine, charges: sa.Engine) -> None:
    old = dead_after_charging(engine)
    forked = fork(engine, old, from_step="charge_and_ship")
    assert [(c.name, c.kind, c.reused) for c in forked.plan.checkpoints] == [
        ("charge", "checkpoint", True), ("flowq.sleep.0", "sleep", True),
        ("label", "checkpoint", True)]
    drain_waiting(engine)  # the sleep was slept in the old run: it returns at once
    new = get_run(engine, forked.run_id)
    assert new.status == "succeeded", new
    assert new.result == {"done": "ch-3"}
    assert charged(engine) == 1 and labels == [3]  # not charged, not printed again
    assert (forked.run_id, "charge_and_ship", {"order_id": 3}) in calls  # the step ran
    assert get_run(engine, old).status == "dead"


def test_redo_checkpoints_runs_them_again(engine: sa.Engine, charges: sa.Engine) -> None:
    old = dead_after_charging(engine)
    forked = fork(engine, old, from_step="charge_and_ship", redo_checkpoints=True)
    assert not any(c.reused for c in forked.plan.checkpoints)
    run_all(engine)
    assert get_run(engine, forked.run_id).status == "succeeded"
    assert charged(engine) == 2 and labels == [3, 3]


def test_redo_from_reuses_the_checkpoints_before_it(engine: sa.Engine,
                                                    charges: sa.Engine) -> None:
    old = dead_after_charging(engine)
    forked = fork(engine, old, from_step="charge_and_ship", redo_from="label")
    assert [(c.name, c.reused) for c in forked.plan.checkpoints] == [
        ("charge", True), ("flowq.sleep.0", True), ("label", False)]
    drain_waiting(engine)
    assert get_run(engine, forked.run_id).status == "succeeded"
    assert charged(engine) == 1 and labels == [3, 3]


def test_redo_from_the_first_checkpoint_sleeps_again(engine: sa.Engine,
                                                     charges: sa.Engine) -> None:
    old = dead_after_charging(engine)
    forked = fork(engine, old, from_step="charge_and_ship", redo_from="charge")
    drain_waiting(engine)  # the charge runs again, then the sleep is a new one: an hour
    assert charged(engine) == 2 and labels == [3]
    assert get_run(engine, forked.run_id).status == "pending"


def test_a_dry_run_lists_what_runs_again_and_changes_nothing(
        engine: sa.Engine, charges: sa.Engine, db_url: str) -> None:
    old = dead_at(engine, shop, "notify", order_id=4)  # every step ran; notify mailed
    labels.clear()

    def snapshot() -> list[Any]:
        with engine.connect() as conn:
            return [list(conn.execute(sa.text(f"SELECT * FROM flowq.{t} ORDER BY 1, 2")))
                    for t in ("steps", "checkpoints")]

    before = snapshot()
    plan = flowq.runs.plan_fork(engine, old, from_step="charge_and_ship", redo_from="label")
    assert plan.steps == ("charge_and_ship", "notify") and plan.args == {"order_id": 4}
    assert [(c.step, c.name, c.reused) for c in plan.checkpoints] == [
        ("charge_and_ship", "charge", True), ("charge_and_ship", "flowq.sleep.0", True),
        ("charge_and_ship", "label", False), ("notify", "mail", False)]
    assert plan.reused == ("charge", "flowq.sleep.0")
    data = cli_json(db_url, "fork", str(old), "--from", "charge_and_ship", "--dry-run",
                    "--app", "test_fork:app")
    assert data["dry_run"] is True and data["steps"] == ["charge_and_ship", "notify"]
    assert [(c["name"], c["reused"]) for c in data["checkpoints"]] == [
        ("charge", True), ("flowq.sleep.0", True), ("label", True), ("mail", False)]
    code, out, err = cli(db_url, "fork", str(old), "--from", "charge_and_ship",
                         "--redo-checkpoints", "--dry-run", "--app", "test_fork:app")
    assert code == 0, err
    assert "dry run: nothing was changed" in out
    assert 'RUN AGAIN checkpoint "charge" of \'charge_and_ship\'' in out
    assert 'RUN AGAIN checkpoint "mail" of \'notify\'' in out
    assert snapshot() == before and charged(engine) == 1 and labels == []


def test_the_cli_forks_reusing_or_redoing(engine: sa.Engine, charges: sa.Engine,
                                         db_url: str) -> None:
    old = dead_after_charging(engine)
    data = cli_json(db_url, "fork", str(old), "--from", "charge_and_ship", "--redo-from",
                    "label", "--app", "test_fork:app")
    assert [c["name"] for c in data["checkpoints"] if c["reused"]] == ["charge",
                                                                       "flowq.sleep.0"]
    drain_waiting(engine)
    assert get_run(engine, data["run_id"]).status == "succeeded"
    assert charged(engine) == 1 and labels == [3, 3]
    code, out, err = cli(db_url, "fork", str(old), "--from", "charge_and_ship",
                         "--app", "test_fork:app")
    assert code == 0, err
    assert "reuse     checkpoint \"charge\"" in out
    run_all(engine)
    assert charged(engine) == 1 and labels == [3, 3]


def test_hostile_redo_options_are_refused_with_a_sentence(
        engine: sa.Engine, charges: sa.Engine, db_url: str) -> None:
    old = dead_after_charging(engine)
    for name, match in [
            ("lable", r"redo_from= 'lable': step 'charge_and_ship' of run \d+ recorded no "
                      r"checkpoint of that name \(did you mean 'label'.*its checkpoints: "
                      r"'charge', 'label'"),
            ("x\x00y", "recorded no checkpoint of that name"),
            ("\ud800", "recorded no checkpoint of that name"),
            ("n" * 100_000, "recorded no checkpoint of that name"),
            ("flowq.sleep.0", "recorded no checkpoint of that name"),
            ("", "recorded no checkpoint of that name")]:
        with pytest.raises(flowq.InvalidArgumentsError, match=match):
            fork(engine, old, from_step="charge_and_ship", redo_from=name)
    with pytest.raises(flowq.InvalidArgumentsError, match="redo_from= takes a checkpoint's "
                                                          "name, got int"):
        fork(engine, old, from_step="charge_and_ship", redo_from=1)  # type: ignore[arg-type]
    with pytest.raises(flowq.InvalidArgumentsError, match="redo_checkpoints is True or False"):
        fork(engine, old, from_step="charge_and_ship",
             redo_checkpoints="yes")  # type: ignore[arg-type]
    with pytest.raises(flowq.InvalidArgumentsError, match=r"give redo_checkpoints=True \(run "
                                                          r"every checkpoint again\) or "
                                                          r"redo_from="):
        fork(engine, old, from_step="charge_and_ship", redo_checkpoints=True,
             redo_from="label")
    with pytest.raises(flowq.InvalidArgumentsError, match="it recorded none"):
        fork(engine, old, from_step="place", redo_from="charge")
    code, _, err = cli(db_url, "fork", str(old), "--from", "charge_and_ship", "--redo-from",
                       "nope\x01", "--app", "test_fork:app")
    assert code == 2 and "--redo-from 'nope\\x01'" in err and "Traceback" not in err
    code, _, err = cli(db_url, "fork", str(old), "--from", "charge_and_ship", "--redo-from",
                       "label", "--redo-checkpoints", "--app", "test_fork:app")
    assert code == 2 and "give --redo-checkpoints" in err and "--redo-from" in err
    with engine.connect() as conn:  # nothing was enqueued by the refusals
        runs = conn.execute(sa.text("SELECT count(DISTINCT run_id) FROM flowq.steps")).scalar()
    assert runs == 1 and charged(engine) == 1


def test_the_cli_names_its_own_flag_for_the_input(engine: sa.Engine, db_url: str) -> None:
    old = dead_at(engine, four, "two", n=5)
    code, _, err = cli(db_url, "fork", str(old), "--from", "three", "--app", "test_fork:app")
    assert code == 2 and "pass its input with --args" in err and "args=" not in err
    with pytest.raises(flowq.RunStateError, match="pass its input with args="):
        fork(engine, old, from_step="three")


# -- a child run the forked step started is the fork's too -------------------------------------

boxes = app.pipeline("fork_boxes")


@app.task(retry=ONCE)
def pack(ctx: Context, order_id: int) -> dict[str, Any]:
    ctx.checkpoint("box", charge, order_id)  # counted in `charges`
    return {"box": order_id}


@boxes.step(retry=ONCE)
def ship(ctx: Context, order_id: int) -> dict[str, Any]:
    (box,) = ctx.wait_all([ctx.start_child(pack, order_id=order_id)])
    called(ctx, order_id=order_id)
    return {"box": box}


def test_a_fork_waits_for_the_child_its_step_started_instead_of_starting_another(
        engine: sa.Engine, charges: sa.Engine) -> None:
    broken.add("ship")
    old = start(engine, boxes, order_id=9)
    drain(engine, app, raise_on_dead=False)  # a transaction per job: the child runs first
    assert get_run(engine, old).status == "dead" and charged(engine) == 1
    broken.clear()
    forked = fork(engine, old, from_step="ship")
    assert [(c.kind, c.reused) for c in forked.plan.checkpoints] == [("child", True)]
    drain(engine, app)
    new = get_run(engine, forked.run_id)
    assert new.status == "succeeded" and new.result == {"box": {"box": 9}}
    assert charged(engine) == 1  # the child was not started again
    again = fork(engine, old, from_step="ship", redo_checkpoints=True)
    drain(engine, app)
    assert get_run(engine, again.run_id).status == "succeeded" and charged(engine) == 2
