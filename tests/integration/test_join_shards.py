"""A large map counts its instances in shards (`flowq.join_shards`, revision 0009): the join
still runs once, after every instance, with the results in item order; a worker of an older
release registered keeps the count on the join's row. Real processes and SIGKILL over maps of
10,000 items: tests/acceptance/test_workflow_faults.py."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from tenacity import stop_after_attempt

import flowq
from flowq.db.schema import JOIN_SHARDS
from flowq.ops.runs import get_run, retry_run
from flowq.testing import drain
from flowq.worker.graph import SHARDED_MAP_ITEMS

SHARDS = sa.text("""
    SELECT parent, shard, remaining FROM flowq.join_shards WHERE run_id = :run_id
     ORDER BY parent, shard""")


def fan_app(broken: set[int] | None = None) -> tuple[flowq.FlowQ, Any]:
    app = flowq.FlowQ()
    fan = app.pipeline("fan")

    @fan.step()
    def split(ctx: flowq.Context, count: int) -> flowq.Each:
        return flowq.each([{"i": i} for i in range(count)])

    @fan.step(queue="items", retry=flowq.Retry(stop=stop_after_attempt(1)))
    def square(ctx: flowq.Context, i: int) -> int:
        if broken and i in broken:
            raise RuntimeError(f"item {i} broke")
        return i * i

    @fan.step()
    def total(ctx: flowq.Context, square: list[int]) -> dict[str, Any]:
        return {"count": len(square), "in_order": square == [i * i for i in range(len(square))]}

    return app, fan


def shards(engine: sa.Engine, run_id: int) -> list[tuple[str, int, int]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(SHARDS, {"run_id": run_id})]  # type: ignore[misc]


@pytest.mark.parametrize("count", [SHARDED_MAP_ITEMS, 100, 500])
def test_a_large_map_counts_in_shards_and_joins_once_in_item_order(
        engine: sa.Engine, count: int) -> None:
    app, fan = fan_app()
    with engine.begin() as conn:
        run = flowq.enqueue(conn, fan, count=count)
    drain(engine, app, queues=["default"])  # the split only: its instances wait
    made = shards(engine, run.id)
    assert [s for _, s, _ in made] == list(range(JOIN_SHARDS))
    assert {p for p, _, _ in made} == {"square"}
    assert [n for _, _, n in made] == [len(range(s, count, JOIN_SHARDS))
                                       for s in range(JOIN_SHARDS)]
    drain(engine, app)
    info = get_run(engine, run.id)
    assert info.status == "succeeded", info
    assert info.result == {"count": count, "in_order": True}
    assert [s.step for s in info.steps].count("total") == 1
    assert all(n == 0 for _, _, n in shards(engine, run.id))
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT parents, remaining FROM flowq.joins "
                                    "WHERE run_id = :r"), {"r": run.id}).one() == (1, 0)


def test_a_small_map_keeps_the_count_on_the_join_row(engine: sa.Engine) -> None:
    app, fan = fan_app()
    with engine.begin() as conn:
        run = flowq.enqueue(conn, fan, count=SHARDED_MAP_ITEMS - 1)
    drain(engine, app)
    assert get_run(engine, run.id).result == {"count": SHARDED_MAP_ITEMS - 1, "in_order": True}
    assert shards(engine, run.id) == []


def test_a_registered_worker_of_an_older_release_keeps_maps_unsharded(
        engine: sa.Engine) -> None:
    """An older worker would count an instance on the join's row: while one is registered
    (no `capabilities`), a new map is counted there too, by every release."""
    app, fan = fan_app()
    with engine.begin() as conn:
        conn.execute(sa.text("""
            INSERT INTO flowq.workers (name, host, pid, queues, tasks, concurrency, version)
            VALUES ('old', 'h', 1, '{default}', '{fan}', 4, '0.6')"""))
        run = flowq.enqueue(conn, fan, count=200)
    drain(engine, app)
    assert get_run(engine, run.id).result == {"count": 200, "in_order": True}
    assert shards(engine, run.id) == []


def test_a_dead_instance_of_a_sharded_map_retried_then_joins_once(engine: sa.Engine) -> None:
    broken = {7, 70}
    app, fan = fan_app(broken)
    with engine.begin() as conn:
        run = flowq.enqueue(conn, fan, count=150)
    drain(engine, app, raise_on_dead=False)
    info = get_run(engine, run.id)
    assert info.status == "dead" and "total" not in [s.step for s in info.steps]
    assert sorted(n for _, _, n in shards(engine, run.id)) == [0] * (JOIN_SHARDS - 2) + [1, 1]
    broken.clear()
    assert len(retry_run(engine, run.id).job_ids) == 2
    drain(engine, app)
    info = get_run(engine, run.id)
    assert info.status == "succeeded" and info.result == {"count": 150, "in_order": True}
    assert [s.step for s in info.steps].count("total") == 1


def test_a_join_of_a_sharded_map_and_a_static_parent_waits_for_both(
        engine: sa.Engine) -> None:
    app = flowq.FlowQ()
    p = app.pipeline("mixed")

    @p.step()
    def start(ctx: flowq.Context, count: int) -> dict[str, int]:
        return {"count": count}

    @p.step(parents=[start])
    def split(ctx: flowq.Context, count: int) -> flowq.Each:
        return flowq.each([{"i": i} for i in range(count)])

    @p.step(queue="items")
    def work(ctx: flowq.Context, i: int) -> int:
        return i

    @p.step(parents=[start], queue="side")
    def side(ctx: flowq.Context, count: int) -> str:
        return "side"

    @p.step(parents=[work, side])
    def gather(ctx: flowq.Context, work: list[int], side: str) -> dict[str, Any]:
        return {"n": len(work), "sum": sum(work), "side": side}

    with engine.begin() as conn:
        run = flowq.enqueue(conn, p, count=300)
    drain(engine, app, queues=["default", "items"])  # every instance, not the side branch
    info = get_run(engine, run.id)
    assert info.status == "pending" and "gather" not in [s.step for s in info.steps]
    assert all(n == 0 for _, _, n in shards(engine, run.id))
    drain(engine, app)
    info = get_run(engine, run.id)
    assert info.status == "succeeded", info
    assert info.result == {"n": 300, "sum": sum(range(300)), "side": "side"}
    assert [s.step for s in info.steps].count("gather") == 1
