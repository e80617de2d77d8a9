"""A test app with an every-second schedule whose handler writes one ledger row per run
through ctx.session (committed with the run's success): the run, its tick, the worker."""

from __future__ import annotations

import os
from datetime import timedelta

import sqlalchemy as sa

import flowq
from flowq.durable.context import Context

app = flowq.FlowQ()

LEDGER_DDL = ("CREATE TABLE IF NOT EXISTS schedule_ledger (run_id bigint NOT NULL, "
              "scheduled_at timestamptz, pid int NOT NULL)")


@app.periodic(every=timedelta(seconds=1))
@app.task()
def heartbeat(ctx: Context) -> None:
    ctx.session.execute(sa.text(
        "INSERT INTO schedule_ledger (run_id, scheduled_at, pid) VALUES (:r, :t, :p)"),
        {"r": ctx.run_id, "t": ctx.scheduled_at, "p": os.getpid()})
