"""Definition fingerprints (flowq.define.shape): stable across processes, changed by a shape
change only; recorded on runs and copied to their later steps; registered by workers;
versioned pipelines (new runs on the newest, a run continues on its own version)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import deploy_a
import deploy_b
import pytest
import sqlalchemy as sa
from support import APPS_DIR, rows, scalar

import flowq
from flowq.define.shape import Shape, fingerprint_of, pick_version
from flowq.durable.context import Context
from flowq.testing import drain
from flowq.worker.registry import Registry

FINGERPRINTS = ("import json, deploy_a; "
                "print(json.dumps({p.name: p.fingerprint for p in deploy_a.app.definitions}))")


def test_the_same_app_has_the_same_fingerprint_in_another_process() -> None:
    # Another process with another hash seed: no hash() in the fingerprint.
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(APPS_DIR)}
    out = subprocess.run([sys.executable, "-c", FINGERPRINTS], env=env, check=True,
                         capture_output=True, text=True).stdout
    here = {p.name: p.fingerprint for p in deploy_a.app.definitions}
    assert json.loads(out) == here
    assert all(len(f) == 16 and int(f, 16) >= 0 for f in here.values())


def _pipeline(doc: str = "", *, param: str = "n", parents: bool = False) -> flowq.Pipeline:
    app = flowq.FlowQ()
    p = app.pipeline("p")

    def first(ctx: Context, n: int) -> dict[str, Any]:
        return {"n": n}

    first.__doc__ = doc
    one = p.step()(first)
    if parents:
        p.step(name="side", parents=[one])(first)
    namespace: dict[str, Any] = {}
    exec(f"def second(ctx, {param}): return None", namespace)
    p.step(parents=[one])(namespace["second"])
    return p


def test_a_shape_change_changes_the_fingerprint_and_a_body_change_does_not() -> None:
    base = _pipeline()
    assert _pipeline(doc="another docstring").fingerprint == base.fingerprint
    assert deploy_a.versioned.fingerprint == deploy_b.versioned.fingerprint  # new bodies
    assert _pipeline(param="m").fingerprint != base.fingerprint  # a parameter renamed
    assert _pipeline(param="n=1").fingerprint != base.fingerprint  # now optional
    assert _pipeline(parents=True).fingerprint != base.fingerprint  # a step added
    assert deploy_b.versioned_v2.fingerprint != deploy_b.versioned.fingerprint
    assert fingerprint_of(base.shape) == base.fingerprint
    assert base.shape["steps"][1] == {"name": "second", "parents": ["first"],
                                      "wait_for": None,
                                      "params": [["n", "positional_or_keyword", True]]}
    for a, b in ((deploy_a.chain, deploy_b.chain), (deploy_a.fanin, deploy_b.fanin),
                 (deploy_a.argchange, deploy_b.argchange)):
        assert a.fingerprint != b.fingerprint


def test_versions_live_side_by_side_and_new_runs_start_on_the_newest() -> None:
    app = deploy_b.app
    assert [p.version for p in app.versions("versioned")] == [1, 2]
    assert app.get("versioned") is deploy_b.versioned_v2
    with pytest.raises(flowq.ConfigurationError, match="already registered"):
        app.pipeline("versioned", version=2)
    with pytest.raises(flowq.ConfigurationError, match="version of pipeline"):
        flowq.FlowQ().pipeline("bad", version=0)
    shapes = [Shape.of(p) for p in app.versions("versioned")]
    v1, v2 = shapes
    assert pick_version(shapes, v1.fingerprint, None, "v_b") is v1
    assert pick_version(shapes, None, 1, "v_b") is v1  # a changed v1 keeps its number
    assert pick_version(shapes, None, 3, "v_b") is None  # a version this code lacks
    assert pick_version(shapes, None, None, "v_b") is v1  # unrecorded: newest with the step
    assert pick_version(shapes, None, None, "w_a") is v2


def test_a_run_records_its_fingerprint_and_its_later_steps_copy_it(
        engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(deploy_a.LEDGER_DDL)
        chain = deploy_a.chain.enqueue(conn, n=1)
        fan = deploy_a.fanin.enqueue(conn, n=2)
        # The version 1 object of B's versioned pipeline starts a run on the newest.
        newest = deploy_b.versioned.enqueue(conn, n=3)
    with engine.connect() as conn:
        for _ in range(2):  # the second steps wait deploy_a.GATE: made due in between
            drain(conn, deploy_a.app, runs=[chain, fan])
            drain(conn, deploy_b.app, runs=[newest])
            conn.execute(sa.text("UPDATE flowq.jobs SET run_at = now() "
                                 "WHERE status = 'pending'"))
        conn.commit()
    got = {(r.run_id, r.step): r.fingerprint for r in rows(
        engine, "SELECT run_id, step, fingerprint FROM flowq.steps")}
    assert {got[chain.id, s] for s in "abc"} == {deploy_a.chain.fingerprint}
    assert {got[fan.id, s] for s in ("x", "y1", "y2", "z")} == {deploy_a.fanin.fingerprint}
    assert got[newest.id, "w_a"] == deploy_b.versioned_v2.fingerprint


def test_a_worker_registers_the_definitions_it_serves(engine: sa.Engine) -> None:
    registry = Registry(engine, "flowq", worker="w-b", queues=["default"], tasks=["versioned"],
                        concurrency=1, definitions=deploy_b.app.definitions)
    registry.register()
    registry.register()  # once per fingerprint
    served = json.loads(scalar(engine, "SELECT definitions::text FROM flowq.workers"))
    assert served["versioned"] == [
        {"version": 1, "fingerprint": deploy_b.versioned.fingerprint},
        {"version": 2, "fingerprint": deploy_b.versioned_v2.fingerprint}]
    recorded = rows(engine, "SELECT fingerprint, pipeline, version, shape FROM "
                    "flowq.definitions ORDER BY pipeline, version")
    assert len(recorded) == len(deploy_b.app.definitions)
    for r in recorded:
        assert fingerprint_of(r.shape) == r.fingerprint
    other = Registry(engine, "flowq", worker="w-a", queues=["default"], tasks=["versioned"],
                     concurrency=1, definitions=deploy_a.app.definitions)
    other.register()
    [b] = other.elsewhere.workers
    assert b.worker == "w-b" and b.queues == {"default"}
    assert b.definitions["versioned"][1] == (2, deploy_b.versioned_v2.fingerprint)
    assert other.elsewhere.versions[deploy_b.versioned_v2.fingerprint] == 2
