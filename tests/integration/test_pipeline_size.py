"""The largest pipeline flowq can store, defined in linear time.

A step's index is stored as a smallint (`flowq.jobs.step_index`), so a pipeline has at most
`MAX_STEP_INDEX + 1` = 32,768 steps: one more is refused when it is defined (it used to be
accepted and then break the run at its 32,768th step). Defining N steps costs O(N): each
check (a unique name, a parent that is a step, a signal waited for once) is a lookup, not a
scan of the steps defined so far. The pipeline is built once for the module (about 2 s).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa

import flowq
from flowq.define.step import MAX_STEP_INDEX


class CountingList(list[Any]):
    """`Pipeline.steps` that counts every step visited by a scan of it (iteration, slices)."""

    visits = 0

    def __iter__(self) -> Iterator[Any]:
        for item in super().__iter__():
            CountingList.visits += 1
            yield item

    def __getitem__(self, key: Any) -> Any:
        got = super().__getitem__(key)
        if isinstance(key, slice):
            CountingList.visits += len(got)
        return got


@dataclass
class Big:
    pipeline: flowq.Pipeline
    visits: dict[int, int]  # scanned steps once N steps are defined


def handler(ctx: flowq.Context, **kwargs: Any) -> None: ...


@pytest.fixture(scope="module")
def big() -> Big:
    """A pipeline of the most steps storable, its last one a root (so that enqueue stores
    its index); each kind of step definition is among them: a chain, a Step or a name as
    parent, a signal waited for."""
    app = flowq.FlowQ()
    p = app.pipeline("big")
    p.steps = CountingList()
    CountingList.visits = 0
    visits: dict[int, int] = {}
    prev = None
    for i in range(MAX_STEP_INDEX + 1):
        if i in (10_000, 20_000):
            visits[i] = CountingList.visits
        if i == MAX_STEP_INDEX:
            options: dict[str, Any] = {"parents": []}
        elif prev is not None and i % 3 == 1:
            options = {"parents": [prev]}
        elif prev is not None and i % 3 == 2:
            options = {"parents": [prev.name], "wait_for": f"w{i}"}
        else:
            options = {}
        prev = p.step(name=f"s{i}", **options)(handler)
    return Big(p, visits)


def test_a_pipeline_takes_32768_steps_and_refuses_one_more(big: Big) -> None:
    p = big.pipeline
    assert len(p.steps) == 32_768 and p.steps[-1].index == MAX_STEP_INDEX == 2**15 - 1
    with pytest.raises(flowq.ConfigurationError,
                       match=r"pipeline 'big' already has 32,768 steps, the most a pipeline "
                             r"can have \(a step's index is stored as a smallint\): split it"):
        p.step(name="one_too_many")(handler)
    assert len(p.steps) == 32_768
    # The lookups still answer: every step by name, its children, the roots.
    assert p.step_named("s32766") is p.steps[32_766]
    assert p.children(p.steps[0]) == [p.steps[1]]
    assert p.roots == [p.steps[0], p.steps[-1]]


def test_defining_steps_is_linear(big: Big) -> None:
    # A scan of the steps per step defined visits N**2 / 2 of them: 50,000,000 by 10,000
    # steps, four times as many by twice the steps. An index visits each step about once.
    at_10k, at_20k = big.visits[10_000], big.visits[20_000]
    assert at_20k <= 2 * 20_000, big.visits
    assert at_20k - at_10k <= 1.1 * at_10k + 100, big.visits


def test_the_last_storable_step_index_is_stored(big: Big, engine: sa.Engine) -> None:
    with engine.begin() as conn:
        run = big.pipeline.enqueue(conn)
        rows = conn.execute(sa.text("SELECT step, step_index FROM flowq.steps WHERE run_id = :r "
                                    "ORDER BY step_index"), {"r": run.id}).all()
    assert [tuple(r) for r in rows] == [("s0", 0), ("s32767", 32_767)]
