"""Workflows in one process: DAG joins, maps, signals, delays, run control (flowq.testing.drain
writes outcomes with the worker's own statements). Real processes: test_workflow_faults.py."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from tenacity import stop_after_attempt

import flowq
from flowq.ops.runs import cancel_run, get_run, retry_run
from flowq.testing import drain


def make_app() -> tuple[flowq.FlowQ, dict[str, Any]]:
    app = flowq.FlowQ()
    seen: dict[str, Any] = {}

    diamond = app.pipeline("diamond")

    @diamond.step()
    def start(ctx: flowq.Context, n: int) -> dict[str, int]:
        return {"n": n}

    @diamond.step(parents=[start])
    def left(ctx: flowq.Context, n: int) -> dict[str, int]:
        return {"v": n + 1}

    @diamond.step(parents=[start])
    def right(ctx: flowq.Context, n: int) -> dict[str, int]:
        return {"v": n * 10}

    @diamond.step(parents=[left, right])
    def join(ctx: flowq.Context, left: dict[str, int], right: dict[str, int]) -> dict[str, int]:
        seen["join"] = (left, right)
        return {"sum": left["v"] + right["v"]}

    fan = app.pipeline("fan")

    @fan.step()
    def split(ctx: flowq.Context, count: int) -> flowq.Each:
        return flowq.each([{"i": i} for i in range(count)])

    @fan.step()
    def square(ctx: flowq.Context, i: int) -> int:
        return i * i

    @fan.step()
    def total(ctx: flowq.Context, square: list[int]) -> dict[str, int]:
        return {"total": sum(square), "count": len(square)}

    approval = app.pipeline("approval")

    @approval.step()
    def request(ctx: flowq.Context, doc: str) -> dict[str, str]:
        return {"doc": doc}

    @approval.step(wait_for="approved", wait_timeout=timedelta(hours=1))
    def publish(ctx: flowq.Context, doc: str, approved: dict[str, Any]) -> dict[str, Any]:
        return {"doc": doc, "by": approved["by"]}

    return app, seen


@pytest.fixture
def wf(engine: sa.Engine) -> tuple[flowq.FlowQ, dict[str, Any], sa.Engine]:
    app, seen = make_app()
    return app, seen, engine


def test_diamond_joins_once_with_each_parent_by_name(wf: Any) -> None:
    app, seen, engine = wf
    with engine.begin() as conn:
        run = flowq.enqueue(conn, app.get("diamond"), n=2)
    drain(engine, app)
    info = get_run(engine, run.id)
    assert info.status == "succeeded"
    assert seen["join"] == ({"v": 3}, {"v": 20})
    assert info.result == {"sum": 23}
    assert [s.step for s in info.steps].count("join") == 1


@pytest.mark.parametrize("count", [0, 1, 7])
def test_map_runs_each_item_and_joins_in_order(wf: Any, count: int) -> None:
    app, _, engine = wf
    with engine.begin() as conn:
        run = flowq.enqueue(conn, app.get("fan"), count=count)
    drain(engine, app)
    info = get_run(engine, run.id)
    assert info.status == "succeeded", info
    assert info.result == {"total": sum(i * i for i in range(count)), "count": count}
    group = {g.step: g for g in info.graph}
    assert group["square"].instances == (count or None) if count else "square" not in group


def test_signal_before_and_after_the_step_is_reached(wf: Any) -> None:
    app, _, engine = wf
    with engine.begin() as conn:
        early = flowq.enqueue(conn, app.get("approval"), doc="a")
        late = flowq.enqueue(conn, app.get("approval"), doc="b")
    with engine.begin() as conn:
        assert flowq.signal(conn, early.id, "approved", {"by": "ann"}).created
    drain(engine, app)
    assert get_run(engine, early.id).result == {"doc": "a", "by": "ann"}
    late_run = get_run(engine, late.id)
    assert late_run.status == "waiting"
    with engine.connect() as conn:
        flowq.signal(conn, late.id, "approved", {"by": "bob"})
        conn.rollback()  # never delivered
    drain(engine, app)
    assert get_run(engine, late.id).status == "waiting"
    with engine.begin() as conn:
        sent = flowq.signal(conn, late.id, "approved", {"by": "bob"})
    assert sent.delivered
    drain(engine, app)
    assert get_run(engine, late.id).result == {"doc": "b", "by": "bob"}


def test_bad_signals_are_refused(wf: Any) -> None:
    app, _, engine = wf
    with engine.begin() as conn:
        run = flowq.enqueue(conn, app.get("approval"), doc="a")
    with engine.begin() as conn, pytest.raises(flowq.SignalError, match="waits for"):
        flowq.signal(conn, run.id, "nope", 1)
    with engine.begin() as conn, pytest.raises(flowq.RunNotFoundError):
        flowq.signal(conn, 10**12, "approved", 1)
    with engine.begin() as conn, pytest.raises(flowq.SignalError, match="JSON"):
        flowq.signal(conn, run.id, "approved", float("nan"))
    with engine.begin() as conn:
        flowq.signal(conn, run.id, "approved", {"by": "x"})
    with engine.begin() as conn:
        assert not flowq.signal(conn, run.id, "approved", {"by": "x"}).created
    with engine.begin() as conn, pytest.raises(flowq.SignalError, match="already sent"):
        flowq.signal(conn, run.id, "approved", {"by": "y"})
    drain(engine, app)
    with engine.begin() as conn, pytest.raises(flowq.RunStateError, match="finished"):
        flowq.signal(conn, run.id, "approved", {"by": "x"})


def test_cancel_and_retry(wf: Any) -> None:
    app, _, engine = wf
    with engine.begin() as conn:
        run = flowq.enqueue(conn, app.get("approval"), doc="a")
    drain(engine, app)
    res = cancel_run(engine, run.id)
    assert res.run.status == "cancelled"
    assert [s.status for s in res.run.steps] == ["succeeded", "cancelled"]
    with pytest.raises(flowq.RunStateError):
        retry_run(engine, run.id)


# -- definitions: every mistake is a ConfigurationError at import time --------------------------


def test_a_graph_is_validated_when_it_is_defined() -> None:
    app = flowq.FlowQ()
    p = app.pipeline("p")
    other = app.pipeline("other")

    @p.step()
    def a(ctx: flowq.Context) -> None: ...

    @other.step()
    def elsewhere(ctx: flowq.Context) -> None: ...

    with pytest.raises(flowq.ConfigurationError, match=r"unknown parent .b.*cycles"):
        @p.step(parents=["b"])
        def c(ctx: flowq.Context) -> None: ...
    with pytest.raises(flowq.ConfigurationError, match=r"own parent.*cycle"):
        @p.step(name="d", parents=["d"])
        def d(ctx: flowq.Context) -> None: ...
    with pytest.raises(flowq.ConfigurationError, match="another pipeline"):
        @p.step(parents=[elsewhere])
        def e(ctx: flowq.Context) -> None: ...

    @p.step(parents=[a])
    def b(ctx: flowq.Context) -> None: ...

    with pytest.raises(flowq.ConfigurationError, match=r"cannot take keyword.*.b."):
        @p.step(parents=[a, b])
        def join(ctx: flowq.Context, a: Any) -> None: ...
    with pytest.raises(flowq.ConfigurationError, match="twice"):
        @p.step(parents=[a, a])
        def twice(ctx: flowq.Context, a: Any) -> None: ...
    with pytest.raises(flowq.ConfigurationError, match="list of steps"):
        @p.step(parents=a)  # type: ignore[arg-type]
        def bare(ctx: flowq.Context) -> None: ...


@pytest.mark.parametrize("options", [
    {"wait_for": "s", "wait_timeout": 0},
    {"wait_for": "s", "wait_timeout": timedelta(days=400)},
    {"wait_for": "s", "wait_timeout": float("nan")},
    {"wait_for": "s", "wait_timeout": "1h"},
    {"delay": -1},
    {"delay": timedelta(days=367)},
    {"delay": float("inf")},
    {"wait_timeout": 5},
    {"wait_for": "s", "delay": 1},
    {"wait_for": "not a name!"},
])
def test_wait_and_delay_out_of_range_are_refused(options: dict[str, Any]) -> None:
    p = flowq.FlowQ().pipeline("p")
    with pytest.raises(flowq.ConfigurationError):
        @p.step(**options)
        def a(ctx: flowq.Context, s: Any = None) -> None: ...


def test_a_signal_is_waited_for_by_one_step_and_must_fit_it() -> None:
    p = flowq.FlowQ().pipeline("p")

    @p.step(wait_for="go")
    def a(ctx: flowq.Context, go: Any) -> None: ...

    with pytest.raises(flowq.ConfigurationError, match="already waits"):
        @p.step(wait_for="go")
        def b(ctx: flowq.Context, go: Any) -> None: ...
    with pytest.raises(flowq.ConfigurationError, match="payload as a keyword named 'ok'"):
        @p.step(wait_for="ok")
        def c(ctx: flowq.Context) -> None: ...


# -- map: bad items end the mapping step dead, with nothing spawned ------------------------------


@pytest.mark.parametrize("items, match", [
    ("abc", "list of dicts"),
    ({"i": 1}, "list of dicts"),
    ([1, 2], "item 0 .* not a dict"),
    ([{"i": float("nan")}], "nan, which JSON cannot represent"),
    ([{"j": 1}], "do not fit step 'square'"),
    (None, "list of dicts"),
])
def test_bad_map_items_end_the_step_dead(engine: sa.Engine, items: Any, match: str) -> None:
    app = flowq.FlowQ()
    p = app.pipeline("badmap")

    @p.step()
    def split(ctx: flowq.Context) -> Any:
        return flowq.each(items)

    @p.step()
    def square(ctx: flowq.Context, i: int) -> int:
        return i

    with engine.begin() as conn:
        run = flowq.enqueue(conn, p)
    drain(engine, app, raise_on_dead=False)
    info = get_run(engine, run.id)
    assert info.status == "dead"
    assert [(s.step, s.attempts) for s in info.steps] == [("split", 1)]
    assert info.steps[0].last_error is not None
    import re
    assert re.search(match, info.steps[0].last_error), info.steps[0].last_error


def test_too_many_map_items_are_refused() -> None:
    from flowq.define.workflows import MAX_MAP_ITEMS

    with pytest.raises(flowq.WorkflowError, match="at most"):
        flowq.each({"i": i} for i in range(MAX_MAP_ITEMS + 1))
    assert len(flowq.each([{"i": i} for i in range(MAX_MAP_ITEMS)]).items) == MAX_MAP_ITEMS


def test_a_mapping_step_needs_exactly_one_child(engine: sa.Engine) -> None:
    app = flowq.FlowQ()
    p = app.pipeline("twokids")

    @p.step()
    def split(ctx: flowq.Context) -> Any:
        return flowq.each([{"i": 1}])

    @p.step(parents=[split])
    def one(ctx: flowq.Context, i: int) -> None: ...

    @p.step(parents=[split])
    def two(ctx: flowq.Context, i: int) -> None: ...

    with engine.begin() as conn:
        run = flowq.enqueue(conn, p)
    drain(engine, app, raise_on_dead=False)
    info = get_run(engine, run.id)
    assert info.status == "dead" and "2 child steps" in (info.steps[0].last_error or "")


def test_a_flaky_instance_is_retried_alone_and_retry_run_redoes_only_dead_ones(
        engine: sa.Engine) -> None:
    app = flowq.FlowQ()
    p = app.pipeline("flaky")
    calls: dict[int, int] = {}
    broken = {3}

    @p.step()
    def split(ctx: flowq.Context) -> Any:
        calls[-1] = calls.get(-1, 0) + 1
        return flowq.each([{"i": i} for i in range(6)])

    @p.step(retry=flowq.Retry(stop=stop_after_attempt(2)))
    def work(ctx: flowq.Context, i: int) -> int:
        calls[i] = calls.get(i, 0) + 1
        if i in broken:
            raise RuntimeError(f"item {i} broke")
        return i

    @p.step()
    def total(ctx: flowq.Context, work: list[int]) -> int:
        return sum(work)

    with engine.begin() as conn:
        run = flowq.enqueue(conn, p)
    drain(engine, app, raise_on_dead=False)
    info = get_run(engine, run.id)
    assert info.status == "dead"
    assert calls == {-1: 1, 0: 1, 1: 1, 2: 1, 3: 2, 4: 1, 5: 1}
    group = {g.step: g for g in info.graph}["work"]
    assert group.instances == 6 and group.counts == {"succeeded": 5, "dead": 1}
    broken.clear()
    res = retry_run(engine, run.id)
    assert len(res.job_ids) == 1
    drain(engine, app)
    info = get_run(engine, run.id)
    assert info.status == "succeeded" and info.result == 15
    assert calls == {-1: 1, 0: 1, 1: 1, 2: 1, 3: 3, 4: 1, 5: 1}


# -- roots, delays, timeouts -----------------------------------------------------------------


def test_several_roots_start_together_and_a_key_names_the_run(engine: sa.Engine) -> None:
    app = flowq.FlowQ()
    p = app.pipeline("roots")

    @p.step()
    def a(ctx: flowq.Context, x: int) -> dict[str, int]:
        return {"a": x}

    @p.step(parents=[])
    def b(ctx: flowq.Context, x: int) -> dict[str, int]:
        return {"b": x * 2}

    @p.step(parents=[a, b])
    def both(ctx: flowq.Context, a: Any, b: Any) -> dict[str, Any]:
        return {**a, **b}

    with engine.begin() as conn:
        run = flowq.enqueue(conn, p, x=3, idempotency_key="k1")
        again = flowq.enqueue(conn, p, x=4, idempotency_key="k1")
    assert (again.id, again.created) == (run.id, False)
    assert sorted(s.step for s in get_run(engine, run.id).steps) == ["a", "b"]
    with engine.begin() as conn, pytest.raises(flowq.InvalidArgumentsError, match="one by one"):
        flowq.enqueue_many(conn, p, [{"x": 1}])
    drain(engine, app)
    assert get_run(engine, run.id).result == {"a": 3, "b": 6}


def test_by_name_enqueue_of_a_many_rooted_pipeline_starts_every_root(engine: sa.Engine) -> None:
    app = flowq.FlowQ(schema="flowq")
    p = app.pipeline("roots_by_name")

    @p.step()
    def a(ctx: flowq.Context, x: int) -> int:
        return x

    @p.step(parents=[])
    def b(ctx: flowq.Context, x: int) -> int:
        return -x

    with engine.begin() as conn:
        # As a producer without the definition would: one row, step ''.
        conn.execute(sa.text("INSERT INTO flowq.jobs (task, step, queue, args) "
                             "VALUES ('roots_by_name', '', 'default', '{\"x\": 5}')"))
        run_id = conn.execute(sa.text("SELECT max(run_id) FROM flowq.steps")).scalar_one()
    drain(engine, app)
    info = get_run(engine, run_id)
    assert info.status == "succeeded" and info.result == {"a": 5, "b": -5}


def test_a_delayed_step_starts_that_long_after_its_parent(engine: sa.Engine) -> None:
    app = flowq.FlowQ()
    p = app.pipeline("later")

    @p.step()
    def first(ctx: flowq.Context) -> None: ...

    @p.step(delay=timedelta(hours=2))
    def second(ctx: flowq.Context) -> None: ...

    with engine.begin() as conn:
        run = flowq.enqueue(conn, p)
    drain(engine, app)
    with engine.connect() as conn:
        wait = conn.execute(sa.text(
            "SELECT extract(epoch FROM s.run_at - f.finished_at) "
            "FROM flowq.steps s, flowq.steps f "
            "WHERE s.run_id = :r AND f.run_id = :r AND s.step = 'second' AND f.step = 'first'"),
            {"r": run.id}).scalar_one()
    assert 7199 <= float(wait) <= 7201
    assert get_run(engine, run.id).status == "pending"


def test_a_signal_that_never_comes_times_out_dead(wf: Any) -> None:
    from flowq.worker.waits import WaitExpirer

    app, _, engine = wf
    with engine.begin() as conn:
        run = flowq.enqueue(conn, app.get("approval"), doc="a")
    drain(engine, app)
    assert WaitExpirer(engine, "flowq").run_once() == 0  # not yet due
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE flowq.jobs SET run_at = now() - interval '1 second' "
                             "WHERE status = 'waiting'"))
    WaitExpirer(engine, "flowq").run_once()
    drain(engine, app, raise_on_dead=False)
    info = get_run(engine, run.id)
    assert info.status == "dead"
    assert (info.steps[1].last_error or "").startswith("SignalTimeout: signal 'approved'")
    with engine.begin() as conn, pytest.raises(flowq.RunStateError):
        flowq.signal(conn, run.id, "approved", {"by": "late"})
    # Retried, it waits again (for its timeout), and a signal then delivers.
    retry_run(engine, run.id)
    assert get_run(engine, run.id).steps[1].status == "waiting"
    with engine.begin() as conn:
        assert flowq.signal(conn, run.id, "approved", {"by": "late"}).delivered
    drain(engine, app)
    assert get_run(engine, run.id).result == {"doc": "a", "by": "late"}


def test_two_parents_completing_at_once_create_the_join_once(engine: sa.Engine) -> None:
    """Two completions of a join's parents in two transactions at the same time: the second
    waits on the join's counter row, then sees the first's decrement; one join row."""
    import threading

    from flowq.db.runner import runner
    from flowq.db.store import Store
    from flowq.worker.attempt import Attempt, run_attempt
    from flowq.worker.model import Succeeded
    from flowq.worker.writes import write_successes

    app, _ = make_app()
    with engine.begin() as conn:
        run = flowq.enqueue(conn, app.get("diamond"), n=1)
    with pytest.raises(AssertionError, match="max_jobs"):
        drain(engine, app, max_jobs=1)  # start: left and right are pending
    with engine.begin() as conn:
        claimed = Store(runner(conn, direct=False)).claim("default", 2, "t")
    assert sorted(j.step for j in claimed) == ["left", "right"]
    outcomes = [o for job in claimed if isinstance(o := run_attempt(Attempt(app, job)), Succeeded)]
    assert len(outcomes) == 2
    first, second = engine.connect(), engine.connect()
    first.begin()
    write_successes(Store(runner(first, direct=False)), [(claimed[0], outcomes[0])])
    done = threading.Event()

    def complete_second() -> None:
        with second.begin():
            write_successes(Store(runner(second, direct=False)), [(claimed[1], outcomes[1])])
        done.set()

    t = threading.Thread(target=complete_second)
    t.start()
    assert not done.wait(1.0), "the second completion should wait for the first's counter"
    first.commit()
    t.join(30)
    assert done.is_set()
    first.close()
    second.close()
    info = get_run(engine, run.id)
    assert [s.step for s in info.steps].count("join") == 1
    drain(engine, app)
    assert get_run(engine, run.id).result == {"sum": 12}


def test_async_signal_in_an_async_session(wf: Any, db_url: str) -> None:
    import asyncio

    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    import flowq.enqueueing.aio

    app, _, engine = wf
    with engine.begin() as conn:
        run = flowq.enqueue(conn, app.get("approval"), doc="z")

    async def send() -> flowq.Signalled:
        aengine = create_async_engine(db_url.replace("postgresql://", "postgresql+psycopg://"))
        try:
            async with async_sessionmaker(aengine, class_=flowq.enqueueing.aio.AsyncSession)() as s:
                sent = await s.signal(run.id, "approved", {"by": "async"})
                await s.commit()
                return sent
        finally:
            await aengine.dispose()

    assert asyncio.run(send()).created
    drain(engine, app)
    assert get_run(engine, run.id).result == {"doc": "z", "by": "async"}


def test_wait_run_returns_a_finished_run_and_times_out_on_a_waiting_one(wf: Any) -> None:
    from flowq.ops.runs import wait_run

    app, _, engine = wf
    with engine.begin() as conn:
        done = flowq.enqueue(conn, app.get("diamond"), n=0)
        waiting = flowq.enqueue(conn, app.get("approval"), doc="w")
    drain(engine, app)
    assert wait_run(engine, done.id, timeout=5).status == "succeeded"
    with pytest.raises(TimeoutError, match="waiting"):
        wait_run(engine, waiting.id, timeout=0.3)


def test_cancel_stops_every_branch_of_a_dag(wf: Any) -> None:
    app, _, engine = wf
    with engine.begin() as conn:
        run = flowq.enqueue(conn, app.get("diamond"), n=1)
    with pytest.raises(AssertionError, match="max_jobs"):
        drain(engine, app, max_jobs=2)  # start and one branch
    res = cancel_run(engine, run.id)
    assert res.run.status == "cancelled"
    drain(engine, app)
    info = get_run(engine, run.id)
    assert "join" not in [s.step for s in info.steps]
    assert sorted(s.status for s in info.steps) == ["cancelled", "succeeded", "succeeded"]


def test_runs_show_prints_the_dag_with_map_instances_aggregated(engine: sa.Engine,
                                                                db_url: str) -> None:
    import json
    import subprocess
    import sys

    app = flowq.FlowQ()
    p = app.pipeline("shown")

    @p.step()
    def split(ctx: flowq.Context) -> Any:
        return flowq.each([{"i": i} for i in range(12)])

    @p.step(retry=flowq.Retry(max_attempts=1))
    def work(ctx: flowq.Context, i: int) -> int:
        if i % 5 == 0:
            raise ValueError(f"bad item {i}")
        return i

    @p.step()
    def total(ctx: flowq.Context, work: list[int]) -> int:
        return sum(work)

    with engine.begin() as conn:
        run = flowq.enqueue(conn, p)
    drain(engine, app, raise_on_dead=False)
    show = subprocess.run([sys.executable, "-m", "flowq", "runs", "show", str(run.id),
                           "--database-url", db_url], capture_output=True, text=True,
                          timeout=60, check=True).stdout
    assert "work ×12: 9 succeeded, 3 dead" in show  # noqa: RUF001
    assert "work[0]" in show and "ValueError: bad item 0" in show
    data = json.loads(subprocess.run(
        [sys.executable, "-m", "flowq", "runs", "show", str(run.id), "--json",
         "--database-url", db_url], capture_output=True, text=True, timeout=60,
        check=True).stdout)
    assert data["status"] == "dead"
    [group] = [g for g in data["graph"] if g["step"] == "work"]
    assert (group["instances"], group["counts"]) == (12, {"succeeded": 9, "dead": 3})
    retried = json.loads(subprocess.run(
        [sys.executable, "-m", "flowq", "runs", "retry", str(run.id), "--json",
         "--database-url", db_url], capture_output=True, text=True, timeout=60,
        check=True).stdout)
    assert len(retried["retried_job_ids"]) == 3


def test_each_map_instance_has_its_own_idempotency_key(engine: sa.Engine) -> None:
    app = flowq.FlowQ()
    p = app.pipeline("instance_keys")

    @p.step()
    def split(ctx: flowq.Context) -> Any:
        return flowq.each([{"i": i} for i in range(3)])

    @p.step()
    def charge(ctx: flowq.Context, i: int) -> str:
        return ctx.idempotency_key

    with engine.begin() as conn:
        run = flowq.enqueue(conn, p)
    drain(engine, app)
    keys = get_run(engine, run.id).result
    assert keys == [f"flowq:{run.id}:charge:{i}" for i in range(3)]


def test_runs_show_with_the_app_knows_parents_and_leaves(engine: sa.Engine, db_url: str,
                                                         tmp_path: Any) -> None:
    import json
    import subprocess
    import sys

    (tmp_path / "dag_app.py").write_text(
        "import flowq\n"
        "app = flowq.FlowQ()\n"
        "p = app.pipeline('shown_dag')\n"
        "@p.step()\n"
        "def start(ctx): return {'n': 1}\n"
        "@p.step(parents=[start])\n"
        "def side(ctx, n): return 'side'\n"
        "@p.step(parents=[start])\n"
        "def main(ctx, n): return 'main'\n")
    import importlib.util
    spec = importlib.util.spec_from_file_location("dag_app", tmp_path / "dag_app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with engine.begin() as conn:
        run = flowq.enqueue(conn, module.p)
    drain(engine, module.app)
    data = json.loads(subprocess.run(
        [sys.executable, "-m", "flowq", "runs", "show", str(run.id), "--json", "--app",
         "dag_app:app", "--database-url", db_url], capture_output=True, text=True, timeout=60,
        check=True, cwd=tmp_path).stdout)
    assert data["result"] == {"side": "side", "main": "main"}
    assert {g["step"]: g["parents"] for g in data["graph"]} == {
        "start": [], "side": ["start"], "main": ["start"]}
