"""Version A of an app, deployed first (tests/acceptance/test_deploy.py and
tests/integration/test_deploy_check.py); tests/apps/deploy_b.py is the next deploy.

Every pipeline's second step waits `GATE` seconds after the first (`delay=`), so runs sit
between steps until a test makes them due. Each step writes a `deploy_ledger` row through
`ctx.session` (committed with the step): which release ran which step of which run, once.
"""

from __future__ import annotations

import os
from typing import Any, Final

import sqlalchemy as sa

import flowq
from flowq.durable.context import Context

RELEASE: Final = "A"
GATE: Final = 3600.0
LEDGER_DDL: Final = ("CREATE TABLE IF NOT EXISTS deploy_ledger (run_id bigint NOT NULL, "
                     "step text NOT NULL, release text NOT NULL, pid int NOT NULL)")

app = flowq.FlowQ()


def record(ctx: Context, release: str = RELEASE) -> None:
    ctx.session.execute(sa.text(
        "INSERT INTO deploy_ledger (run_id, step, release, pid) VALUES (:r, :s, :rel, :pid)"),
        {"r": ctx.run_id, "s": ctx.step, "rel": release, "pid": os.getpid()})


def passing(ctx: Context, n: int) -> dict[str, Any]:
    """A step that hands its argument on."""
    record(ctx)
    return {"n": n}


def last(ctx: Context, n: int) -> None:
    record(ctx)


# b is removed in B.
chain = app.pipeline("chain")
chain.step(name="a")(passing)
chain.step(name="b", delay=GATE)(passing)
chain.step(name="c")(last)

# q is renamed q2 in B.
rename = app.pipeline("rename")
rename.step(name="p")(passing)
rename.step(name="q", delay=GATE)(passing)
rename.step(name="r")(last)

# t needs an argument m in B that s does not produce.
argchange = app.pipeline("argchange")
argchange.step(name="s")(passing)
argchange.step(name="t", delay=GATE)(passing)
argchange.step(name="u")(last)

# The join z gains a parent y3 in B.
fanin = app.pipeline("fanin")
x = fanin.step(name="x")(passing)
fanin.step(name="y1", parents=[x], delay=GATE)(passing)
fanin.step(name="y2", parents=[x], delay=GATE)(passing)


@fanin.step(name="z", parents=["y1", "y2"])
def z(ctx: Context, y1: dict[str, Any], y2: dict[str, Any]) -> None:
    record(ctx)


# Kept as version 1 in B, beside a version 2.
versioned = app.pipeline("versioned")
versioned.step(name="v_a")(passing)
versioned.step(name="v_b", delay=GATE)(passing)
versioned.step(name="v_c")(last)

STRANDED: Final = {"chain": ("b",), "rename": ("q",), "argchange": ("t",),
                   "fanin": ("y1", "y2")}
"""Per pipeline, the steps at which B cannot continue a run of A."""
