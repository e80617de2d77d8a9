"""Version B of tests/apps/deploy_a.py, the next deploy: `chain` lost step b, `rename`'s q
is called q2, `argchange`'s t needs an argument m that s does not produce, `fanin`'s join
z gained a parent y3; `versioned` keeps A's version 1 unchanged beside a version 2, which
new runs start on.
"""

from __future__ import annotations

import os
from typing import Any, Final

import sqlalchemy as sa

import flowq
from flowq.durable.context import Context

RELEASE: Final = "B"
GATE: Final = 3600.0

app = flowq.FlowQ()


def record(ctx: Context, release: str = RELEASE) -> None:
    ctx.session.execute(sa.text(
        "INSERT INTO deploy_ledger (run_id, step, release, pid) VALUES (:r, :s, :rel, :pid)"),
        {"r": ctx.run_id, "s": ctx.step, "rel": release, "pid": os.getpid()})


def passing(ctx: Context, n: int) -> dict[str, Any]:
    """A step that hands its argument on (a new body: the shape is what counts)."""
    record(ctx)
    return {"n": n}


def last(ctx: Context, n: int) -> None:
    record(ctx)


chain = app.pipeline("chain")
chain.step(name="a")(passing)
chain.step(name="c")(last)

rename = app.pipeline("rename")
rename.step(name="p")(passing)
rename.step(name="q2", delay=GATE)(passing)
rename.step(name="r")(last)

argchange = app.pipeline("argchange")
argchange.step(name="s")(passing)


@argchange.step(name="t", delay=GATE)
def t(ctx: Context, n: int, m: int) -> dict[str, Any]:
    record(ctx)
    return {"n": n + m}


argchange.step(name="u")(last)

fanin = app.pipeline("fanin")
x = fanin.step(name="x")(passing)
fanin.step(name="y1", parents=[x], delay=GATE)(passing)
fanin.step(name="y2", parents=[x], delay=GATE)(passing)
fanin.step(name="y3", parents=[x])(passing)


@fanin.step(name="z", parents=["y1", "y2", "y3"])
def z(ctx: Context, y1: dict[str, Any], y2: dict[str, Any], y3: dict[str, Any]) -> None:
    record(ctx)


versioned = app.pipeline("versioned")
versioned.step(name="v_a")(passing)
versioned.step(name="v_b", delay=GATE)(passing)
versioned.step(name="v_c")(last)

versioned_v2 = app.pipeline("versioned", version=2)
versioned_v2.step(name="w_a")(passing)
versioned_v2.step(name="w_b", delay=GATE)(passing)
versioned_v2.step(name="w_c")(last)
