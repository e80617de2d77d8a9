"""The 3-step pipeline of the pipeline fault tests (tests/acceptance/test_pipeline_faults.py): `relay`.

Every step writes one ledger row through ctx.session (`pipeline_app.ledger`, recording the
arguments it was given), so the row commits with the step's success or not at all, and
returns its arguments plus one entry for itself in `trail`, which the next step receives.
An entry names the attempt that produced the result (`step:job_id:attempt:pid`), so the
run's final `trail` names the three attempts whose ledger rows must be the ones that exist.

`sleeps[i]` holds step i that long: half before its ledger write and half after, so a crash
finds the step either not yet in the database or inside its open transaction. A long entry
for one step (`[0, 3, 0]`) is how a test catches a worker holding that step.
"""

from __future__ import annotations

import os
import time
from typing import Any, Final

from pipeline_app import LEDGER_DDL, ledger
from tenacity import stop_after_attempt, wait_fixed

import flowq
from flowq.durable.context import Context

__all__ = ["LEDGER_DDL", "STEPS", "app", "relay"]

app = flowq.FlowQ()

STEPS: Final = ("first", "second", "third")
# Each crash, reap or dropped connection costs the step an attempt: room for plenty, soon.
PATIENT: Final = flowq.Retry(stop=stop_after_attempt(30), wait=wait_fixed(0.1))

relay = app.pipeline("relay")


def relay_step(ctx: Context, n: int, sleeps: list[float], trail: list[str]) -> dict[str, Any]:
    args = {"n": n, "sleeps": sleeps, "trail": trail}
    hold = sleeps[STEPS.index(ctx.step)] / 2
    time.sleep(hold)
    ledger(ctx, {"args": args})
    time.sleep(hold)  # with the step's transaction open
    return {**args, "trail": [*trail, f"{ctx.step}:{ctx.job_id}:{ctx.attempt}:{os.getpid()}"]}


for _name in STEPS:
    relay.step(name=_name, retry=PATIENT)(relay_step)
