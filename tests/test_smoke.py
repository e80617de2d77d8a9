from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

import flowq


def test_enqueue_commit_creates_row(engine: sa.Engine, app: flowq.FlowQ) -> None:
    @app.task()
    def hello(ctx: object, name: str) -> None: ...

    Session = sessionmaker(engine, class_=flowq.Session)
    with Session.begin() as s:
        run = s.enqueue(hello, name="x")
    with engine.connect() as c:
        assert c.execute(sa.text("select count(*) from flowq.jobs")).scalar() == 1
    assert run.created
