"""Transactional enqueue against a real PostgreSQL: rows, NOTIFY, options, bulk, idempotency, bad input."""

from __future__ import annotations

import inspect
import time
import typing
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, scoped_session, sessionmaker

import flowq
from flowq.define.options import RESERVED_OPTIONS, EnqueueOptions
from flowq.enqueueing.prepare import MAX_RUN_AT, MIN_RUN_AT

MARKER = "__test_marker__"


# -- helpers --------------------------------------------------------------------------------


class Listener:
    """A raw autocommit psycopg connection LISTENing on a flowq channel.

    `received()` returns the payloads delivered before a marker NOTIFY sent now: notifications
    arrive in commit order, so this proves what was (and was not) sent without waiting for a
    timeout.
    """

    def __init__(self, url: str, channel: str = "flowq") -> None:
        self.url = url
        self.channel = channel
        self.conn = psycopg.connect(url, autocommit=True)
        self.conn.execute(f'LISTEN "{channel}"')

    def received(self, deadline: float = 30.0) -> list[str]:
        with psycopg.connect(self.url, autocommit=True) as other:
            other.execute("SELECT pg_notify(%s, %s)", (self.channel, MARKER))
        payloads: list[str] = []
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            for n in self.conn.notifies(timeout=max(0.0, end - time.monotonic()), stop_after=1):
                if n.payload == MARKER:
                    return payloads
                payloads.append(n.payload)
        raise AssertionError(f"marker notification not received; got {payloads}")

    def close(self) -> None:
        self.conn.close()


def _libpq_url(db_url: str) -> str:
    return make_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture
def listener(db_url: str) -> Iterator[Listener]:
    lst = Listener(_libpq_url(db_url))
    yield lst
    lst.close()


def _rows(engine: sa.Engine) -> list[sa.Row[Any]]:
    with engine.connect() as c:
        return list(c.execute(sa.text(
            "SELECT id, run_id, task, step, queue, status, priority, max_attempts, args, "
            "idempotency_key, run_at FROM flowq.steps ORDER BY id")))


def _tasks(engine: sa.Engine) -> list[str]:
    return [r.task for r in _rows(engine)]


# -- commit, rollback, savepoints, NOTIFY -------------------------------------------------


def test_commit_creates_row_and_notifies_queue_name(
        Session: sessionmaker[flowq.Session], engine: sa.Engine, app: flowq.FlowQ,
        listener: Listener) -> None:
    @app.task(queue="emails")
    def send_mail(ctx: object, user_id: int, secret: str) -> None: ...

    with Session.begin() as s:
        run = s.enqueue(send_mail, user_id=7, secret="do-not-broadcast")
    assert run.created
    [row] = _rows(engine)
    assert (row.run_id, row.id) == (run.id, run.job_id)
    assert (row.task, row.step, row.queue, row.status) == ("send_mail", "send_mail", "emails",
                                                            "pending")
    assert row.args == {"user_id": 7, "secret": "do-not-broadcast"}
    assert listener.received() == ["emails"]  # the queue name only, never job data


def test_a_delayed_job_notifies_when_it_falls_due(
        Session: sessionmaker[flowq.Session], listener: Listener) -> None:
    """`queue@seconds`, measured from the transaction's start: a worker that waits that long
    after receiving it wakes when the job is due, never before."""
    # Names no test app defines: by name, a live app of another test that defines one (a
    # task 'keyed' taking an argument) would check these arguments against it.
    with Session.begin() as s:
        s.enqueue("notify_later_undefined", queue="q1", delay=30)
        s.enqueue("notify_keyed_undefined", queue="q2", delay=60, idempotency_key="k-later")
        s.enqueue_many("notify_bulk_undefined", [{}, {}], queue="q3", delay=90)
        s.enqueue("notify_now_undefined", queue="q4")
    got = dict(p.partition("@")[::2] for p in listener.received())
    assert got["q4"] == ""
    assert [round(float(got[q])) for q in ("q1", "q2", "q3")] == [30, 60, 90]


def test_notify_is_delivered_only_at_commit(
        Session: sessionmaker[flowq.Session], listener: Listener) -> None:
    with Session() as s:
        s.enqueue("pending_until_commit", queue="default")
        assert listener.received() == []
        s.commit()
    assert listener.received() == ["default"]


def test_rollback_leaves_no_row_and_no_notify(
        Session: sessionmaker[flowq.Session], engine: sa.Engine, listener: Listener) -> None:
    with Session() as s:
        s.enqueue("never_happens", queue="default", x=1)
        s.rollback()
    assert _rows(engine) == []
    assert listener.received() == []


def test_rolled_back_savepoint_drops_only_its_job(
        Session: sessionmaker[flowq.Session], engine: sa.Engine, listener: Listener) -> None:
    with Session() as s:
        outer = s.enqueue("outer_job", queue="outer")
        sp = s.begin_nested()
        s.enqueue("inner_job", queue="inner")
        sp.rollback()
        kept = s.begin_nested()
        s.enqueue("kept_inner_job", queue="kept")
        kept.commit()
        s.commit()
    assert _tasks(engine) == ["outer_job", "kept_inner_job"]
    assert _rows(engine)[0].run_id == outer.id
    assert sorted(listener.received()) == ["kept", "outer"]


def test_plain_connection(engine: sa.Engine, listener: Listener) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE orders (id int)"))
        conn.execute(sa.text("INSERT INTO orders VALUES (1)"))
        run = flowq.enqueue(conn, "ship_order", queue="default", order_id=1)
    assert _tasks(engine) == ["ship_order"]
    assert _rows(engine)[0].run_id == run.id
    assert listener.received() == ["default"]
    with engine.connect() as conn:
        flowq.enqueue(conn, "dropped_with_connection", queue="default")
        conn.rollback()
    assert _tasks(engine) == ["ship_order"]


def test_scoped_session_function_form(engine: sa.Engine) -> None:
    # Flask-SQLAlchemy's db.session is a scoped_session: it has no .enqueue, so use
    # flowq.enqueue(db.session, ...).
    scoped = scoped_session(sessionmaker(engine))
    try:
        flowq.enqueue(scoped, "from_scoped", queue="default", n=1)
        scoped.commit()
        flowq.enqueue(scoped, "rolled_back_scoped", queue="default", n=2)
        scoped.rollback()
    finally:
        scoped.remove()
    assert _tasks(engine) == ["from_scoped"]


def test_joins_orm_writes_in_the_same_transaction(engine: sa.Engine) -> None:
    class Base(DeclarativeBase):
        pass

    class Order(Base):
        __tablename__ = "orders"
        id: Mapped[int] = mapped_column(primary_key=True)

    Base.metadata.create_all(engine)
    Session = sessionmaker(engine, class_=flowq.Session)
    with Session() as s:
        order = Order()
        s.add(order)
        s.flush()  # the generated id exists only after a flush
        s.enqueue("ship", queue="default", order_id=order.id)
        s.rollback()
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM orders")).scalar() == 0
    assert _rows(engine) == []


# -- by name, options -------------------------------------------------------------------------


def test_enqueue_by_name_without_definition(
        Session: sessionmaker[flowq.Session], engine: sa.Engine) -> None:
    with Session.begin() as s:
        s.enqueue("nowhere_defined_task", queue="default", a=[1, 2])
        s.enqueue("nowhere_defined_task", queue="elsewhere")
    rows = _rows(engine)
    assert [r.queue for r in rows] == ["default", "elsewhere"]
    assert rows[0].step == ""  # resolved by the worker from its registry
    assert rows[0].args == {"a": [1, 2]}


def test_enqueue_by_an_unknown_name_needs_its_queue(Session: sessionmaker[flowq.Session],
                                                    engine: sa.Engine) -> None:
    """A producer that does not import the handler cannot know its queue: guessing `default`
    stranded jobs whose workers serve other queues, so it must say (issue 10)."""
    _assert_refused(Session, engine, lambda s: s.enqueue("fast_by_name", n=21),
                    flowq.UnknownTaskError, "'fast_by_name'", "queue=",
                    "import the module that defines it")


def test_enqueue_by_a_misspelt_name_says_the_name(Session: sessionmaker[flowq.Session],
                                                  engine: sa.Engine, app: flowq.FlowQ) -> None:
    """With the app loaded, an unknown name close to one it defines is a typo: the error names
    the task meant, and does not offer queue=, which would enqueue a job no worker runs."""
    @app.task(queue="fulfilment")
    def fulfil_order_by_name(ctx: object, order: int) -> None: ...

    _assert_refused(Session, engine, lambda s: s.enqueue("fulfil_ordr_by_name", order=1),
                    flowq.UnknownTaskError, "did you mean 'fulfil_order_by_name'?")


def test_enqueue_by_name_validates_against_a_live_app(
        Session: sessionmaker[flowq.Session], engine: sa.Engine, app: flowq.FlowQ) -> None:
    @app.task(queue="billing", priority=3)
    def charge_by_name(ctx: object, amount: int) -> None: ...

    with Session() as s:
        with pytest.raises(flowq.InvalidArgumentsError, match="amout"):
            s.enqueue("charge_by_name", amout=5)
        s.enqueue("charge_by_name", amount=5)
        s.commit()
    [row] = _rows(engine)
    assert (row.queue, row.priority, row.step) == ("billing", 3, "charge_by_name")


def test_options_priority_queue_key_run_at(
        Session: sessionmaker[flowq.Session], engine: sa.Engine) -> None:
    at = datetime(2031, 5, 4, 12, 30, tzinfo=timezone(timedelta(hours=2)))
    with Session.begin() as s:
        s.enqueue("opts", priority=-5, queue="q1", idempotency_key="opt-key", run_at=at)
    [row] = _rows(engine)
    assert (row.priority, row.queue, row.idempotency_key) == (-5, "q1", "opt-key")
    assert row.run_at == at


@pytest.mark.parametrize("delay", [90, 2.5, timedelta(minutes=3)])
def test_delay_is_added_to_the_database_clock(
        Session: sessionmaker[flowq.Session], delay: float | timedelta) -> None:
    expected = delay if isinstance(delay, timedelta) else timedelta(seconds=delay)
    with Session() as s:
        s.enqueue("later", queue="default", delay=delay)
        # now() is the transaction's start time on the database clock: the same now() that
        # the INSERT used, so the difference is exact.
        diff = s.execute(sa.text("SELECT run_at - now() FROM flowq.steps")).scalar_one()
        s.rollback()
    assert diff == expected


def test_no_delay_means_due_now(Session: sessionmaker[flowq.Session]) -> None:
    with Session() as s:
        s.enqueue("now", queue="default")
        assert s.execute(sa.text("SELECT run_at = now() FROM flowq.steps")).scalar_one()
        s.rollback()


# A due time PostgreSQL could not compute or store, or psycopg could not read back as a
# datetime: each used to reach the server and abort the caller's transaction (or, accepted,
# left a row nobody could read).
BAD_DUE_TIMES: list[tuple[dict[str, Any], str]] = [
    ({"delay": 8e13}, "delay"),
    ({"delay": -8e13}, "delay"),
    ({"delay": 1e30}, "delay"),
    ({"delay": -1e30}, "delay"),
    ({"delay": float("inf")}, "delay"),
    ({"delay": float("nan")}, "delay"),
    ({"delay": timedelta.max}, "delay"),
    ({"delay": timedelta.min}, "delay"),
    ({"delay": timedelta(days=365 * 8000)}, "delay"),
    ({"delay": True}, "delay"),
    ({"delay": "5"}, "delay"),
    ({"run_at": datetime(2030, 1, 1)}, "run_at"),  # naive
    ({"run_at": datetime.max.replace(tzinfo=timezone.utc)}, "run_at"),
    ({"run_at": datetime.min.replace(tzinfo=timezone.utc)}, "run_at"),
    # Year 9999 in New York is year 10000 in UTC: it overflows when converted.
    ({"run_at": datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5)))}, "run_at"),
]


@pytest.mark.parametrize(("options", "fragment"), [
    *BAD_DUE_TIMES,
    ({"run_at": "2030-01-01T00:00:00Z"}, "run_at"),
    ({"run_at": datetime.now(timezone.utc), "delay": 5}, "run_at or delay"),
    ({"priority": 40000}, "priority"),
    ({"priority": "high"}, "priority"),
    ({"idempotency_key": ""}, "idempotency_key"),
    ({"idempotency_key": 42}, "idempotency_key"),
    ({"idempotency_key": "a\x00b"}, "idempotency_key"),
    ({"idempotency_key": "é" * 501}, "idempotency_key"),
])
def test_bad_options_are_refused(Session: sessionmaker[flowq.Session], engine: sa.Engine,
                                 options: dict[str, Any], fragment: str) -> None:
    _assert_refused(Session, engine, lambda s: s.enqueue("t", queue="default", **options),
                    flowq.InvalidArgumentsError, fragment)


@pytest.mark.parametrize(("options", "fragment"), BAD_DUE_TIMES)
def test_bad_due_times_are_refused_by_enqueue_many(
        Session: sessionmaker[flowq.Session], engine: sa.Engine, options: dict[str, Any],
        fragment: str) -> None:
    _assert_refused(Session, engine, lambda s: s.enqueue_many("t", [{}], queue="default", **options),
                    flowq.InvalidArgumentsError, fragment)


@pytest.mark.parametrize("time_zone", ["UTC", "Pacific/Kiritimati", "Etc/GMT+12"])
def test_the_extreme_due_times_accepted_read_back_in_any_time_zone(
        Session: sessionmaker[flowq.Session], time_zone: str) -> None:
    latest = MAX_RUN_AT
    with Session() as s:
        s.execute(sa.text("SELECT set_config('TimeZone', :tz, true)"), {"tz": time_zone})
        s.enqueue("latest", queue="default", run_at=latest)
        s.enqueue("earliest", queue="default", run_at=MIN_RUN_AT)
        s.enqueue("long_ago", queue="default", delay=-1e10)  # a negative delay is due at once, as before
        s.enqueue_many("latest_many", [{}], queue="default", delay=latest - datetime.now(timezone.utc)
                       - timedelta(hours=1))
        run_at = dict(s.execute(sa.text("SELECT task, run_at FROM flowq.steps")).all())
        s.commit()
    assert run_at["latest"] == latest
    assert run_at["earliest"] == MIN_RUN_AT
    assert run_at["long_ago"] < datetime.now(timezone.utc) - timedelta(days=365 * 300)
    assert run_at["latest_many"] > latest - timedelta(days=1)


# -- bulk -----------------------------------------------------------------------------------


def test_enqueue_many_returns_ids_in_order_in_one_statement(
        Session: sessionmaker[flowq.Session], engine: sa.Engine, listener: Listener) -> None:
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "INSERT INTO flowq.jobs" in statement:
            statements.append(statement)

    sa.event.listen(engine, "before_cursor_execute", count)
    items = [{"n": i} for i in range(10_000)]
    with Session.begin() as s:
        ids = s.enqueue_many("bulk", items, queue="bulkq", priority=2)
    sa.event.remove(engine, "before_cursor_execute", count)
    assert len(statements) == 1
    assert len(ids) == 10_000 == len(set(ids))
    with engine.connect() as c:
        result = c.execute(sa.text("SELECT run_id, (args->>'n')::int FROM flowq.steps"))
        by_run = {run_id: n for run_id, n in result}
    assert [by_run[i] for i in ids] == list(range(10_000))
    assert listener.received() == ["bulkq"]


def test_enqueue_many_validates_every_item_first(
        Session: sessionmaker[flowq.Session], engine: sa.Engine, app: flowq.FlowQ) -> None:
    @app.task()
    def many_checked(ctx: object, n: int) -> None: ...

    _assert_refused(Session, engine,
                    lambda s: s.enqueue_many(many_checked, [{"n": 1}, {"n": 2}, {"m": 3}]),
                    flowq.InvalidArgumentsError, "item 2", "m")
    _assert_refused(Session, engine,
                    lambda s: s.enqueue_many(many_checked, [{"n": 1}, {"n": {1, 2}}]),
                    flowq.InvalidArgumentsError, "item 1", "args['n']")


def test_enqueue_many_of_nothing_sends_nothing(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        assert flowq.enqueue_many(conn, "nothing", [], queue="default") == []
    assert _rows(engine) == []


# -- idempotency ----------------------------------------------------------------------------


def test_idempotency_key_returns_existing_run_whatever_its_arguments(
        Session: sessionmaker[flowq.Session], engine: sa.Engine, listener: Listener) -> None:
    with Session.begin() as s:
        first = s.enqueue("pay", queue="default", idempotency_key="order-1", amount=10)
    assert listener.received() == ["default"]
    with Session.begin() as s:
        again = s.enqueue("pay", queue="default", idempotency_key="order-1", amount=999)
    assert (again.id, again.job_id, again.created) == (first.id, first.job_id, False)
    [row] = _rows(engine)
    assert row.args == {"amount": 10}
    assert listener.received() == []  # nothing new to claim, nobody woken


def test_idempotency_key_in_the_same_transaction(Session: sessionmaker[flowq.Session],
                                                  engine: sa.Engine) -> None:
    with Session.begin() as s:
        a = s.enqueue("pay", queue="default", idempotency_key="same-tx")
        b = s.enqueue("pay", queue="default", idempotency_key="same-tx")
    assert (a.created, b.created, a.id) == (True, False, b.id)
    assert len(_rows(engine)) == 1


# Under concurrency (who waits for whom, REPEATABLE READ, no lock on the existing run):
# tests/integration/test_enqueue_idempotency.py.


# -- bad input: refused up front, nothing left behind, transaction still usable -------------


def _assert_refused(Session: sessionmaker[flowq.Session], engine: sa.Engine,
                    call: Callable[[flowq.Session], object], exc_type: type[Exception],
                    *fragments: str) -> None:
    before = len(_rows(engine))
    with Session() as s:
        s.enqueue(MARKER, queue="default", step="before")
        with pytest.raises(exc_type) as info:
            call(s)
        assert isinstance(info.value, flowq.FlowqError)
        for fragment in fragments:
            assert fragment in str(info.value)
        # The failed call sent nothing that could abort the transaction.
        s.execute(sa.text("SELECT 1"))
        s.enqueue(MARKER, queue="default", step="after")
        s.commit()
    rows = _rows(engine)[before:]
    assert [r.args["step"] for r in rows] == ["before", "after"]
    assert {r.task for r in rows} == {MARKER}


class _Base(DeclarativeBase):
    pass


class _User(_Base):
    __tablename__ = "users"
    id: Mapped[int] = mapped_column(primary_key=True)


@pytest.mark.parametrize(("value", "fragment"), [
    (datetime(2024, 1, 1, tzinfo=timezone.utc), "datetime"),
    ({1, 2}, "set"),
    (_User(id=1), "_User"),
    (b"raw", "bytes"),
    ("a\x00b", "NUL"),
    (float("nan"), "nan"),
    (float("inf"), "inf"),
    (float("-inf"), "inf"),
    ("\ud800", "surrogate"),
    ({1: "one"}, "key"),
    ({"nested": [{"deep": object()}]}, "object"),
])
def test_non_json_argument_is_refused(Session: sessionmaker[flowq.Session], engine: sa.Engine,
                                      value: object, fragment: str) -> None:
    _assert_refused(Session, engine, lambda s: s.enqueue("takes_anything", queue="default", payload=value),
                    flowq.InvalidArgumentsError, "payload", fragment)


def test_unknown_keyword_argument_is_refused(Session: sessionmaker[flowq.Session],
                                             engine: sa.Engine, app: flowq.FlowQ) -> None:
    @app.task()
    def greet(ctx: object, name: str) -> None: ...

    _assert_refused(Session, engine, lambda s: s.enqueue(greet, name="x", nmae="y"),
                    flowq.InvalidArgumentsError, "nmae")


def test_missing_argument_is_refused(Session: sessionmaker[flowq.Session], engine: sa.Engine,
                                     app: flowq.FlowQ) -> None:
    @app.task()
    def greet_missing(ctx: object, name: str) -> None: ...

    _assert_refused(Session, engine, lambda s: s.enqueue(greet_missing),
                    flowq.InvalidArgumentsError, "name")


@pytest.mark.parametrize("queue", ["bad queue!", "", "q" * 64, "ünïcode", 7])
def test_invalid_queue_name_is_refused(Session: sessionmaker[flowq.Session], engine: sa.Engine,
                                       queue: Any) -> None:
    _assert_refused(Session, engine, lambda s: s.enqueue("t", queue=queue),
                    flowq.InvalidQueueError, "queue", repr(queue))


@pytest.mark.parametrize("task", ["", "has space", "a\x00b", 42, None])
def test_invalid_task_is_refused(Session: sessionmaker[flowq.Session], engine: sa.Engine,
                                 task: Any) -> None:
    _assert_refused(Session, engine, lambda s: s.enqueue(task), flowq.UnknownTaskError)


def test_non_session_target_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"flowq\.enqueueing\.aio"):
        flowq.enqueue(object(), "t", queue="default")  # type: ignore[arg-type]


def test_missing_schema_says_to_run_migrate(empty_db_url: str) -> None:
    engine = sa.create_engine(empty_db_url)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("CREATE TABLE business (id int)"))
            with pytest.raises(flowq.SchemaMissingError, match="flowq migrate"):
                flowq.enqueue(conn, "t", queue="default")
            with pytest.raises(flowq.SchemaMissingError, match="flowq migrate"):
                flowq.enqueue_many(conn, "t", [{}], queue="default")
            # Refused before the INSERT was sent: the caller's transaction carries on.
            conn.execute(sa.text("INSERT INTO business VALUES (1)"))
            conn.commit()
            assert conn.execute(sa.text("SELECT count(*) FROM business")).scalar() == 1
    finally:
        engine.dispose()


def test_schema_dropped_after_first_check_is_still_reported(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        flowq.enqueue(conn, "t", queue="default")  # the engine is now known to have the schema
    with engine.begin() as conn:
        conn.execute(sa.text("DROP SCHEMA flowq CASCADE"))
    with engine.connect() as conn, pytest.raises(flowq.SchemaMissingError, match="migrate"):
        flowq.enqueue(conn, "t", queue="default")
    with engine.connect() as conn:
        with pytest.raises(flowq.SchemaMissingError):
            flowq.enqueue(conn, "t", queue="default")  # checked up front again: the transaction carries on
        assert conn.execute(sa.text("SELECT 1")).scalar() == 1


def test_tuples_come_back_as_lists(Session: sessionmaker[flowq.Session],
                                   engine: sa.Engine) -> None:
    with Session.begin() as s:
        s.enqueue("t", queue="default", point=(1, 2), nested={"pair": ("a", ("b",))}, text="ü\u2028 ok")
    [row] = _rows(engine)
    assert row.args == {"point": [1, 2], "nested": {"pair": ["a", ["b"]]}, "text": "ü\u2028 ok"}


# -- the direct (pipelined) path ------------------------------------------------------------


def test_enqueue_first_in_the_transaction_rides_with_begin(
        Session: sessionmaker[flowq.Session], engine: sa.Engine, listener: Listener) -> None:
    """The enqueue opens the transaction (psycopg's BEGIN is pipelined with it): what follows
    is still in that transaction, and a rollback takes the job with it."""
    with Session() as s:
        run = s.enqueue("t", queue="default", n=1)
        xid_then = s.execute(sa.text("SELECT txid_current()")).scalar()
        job_xmin = s.execute(sa.text("SELECT xmin::text::bigint FROM flowq.jobs WHERE id = :i"),
                             {"i": run.job_id}).scalar()
        assert job_xmin == xid_then % 2**32
        s.rollback()
    assert _rows(engine) == []
    assert listener.received() == []


def test_a_failure_on_the_direct_path_is_sqlalchemys_exception(
        Session: sessionmaker[flowq.Session], engine: sa.Engine) -> None:
    with Session() as s:
        with pytest.raises(sa.exc.DBAPIError):
            s.execute(sa.text("SELECT 1 / 0"))
        with pytest.raises(sa.exc.InternalError, match="current transaction is aborted"):
            s.enqueue("t", queue="default")
        s.rollback()
        s.enqueue("t", queue="default")  # the session carries on after its rollback
        s.commit()
    assert _tasks(engine) == ["t"]


def test_a_killed_connection_is_invalidated_and_the_next_session_works(
        Session: sessionmaker[flowq.Session], engine: sa.Engine) -> None:
    with Session() as s:
        s.enqueue("t", queue="default")  # also proves the schema check is done
        s.commit()
    with Session() as s:
        pid = s.execute(sa.text("SELECT pg_backend_pid()")).scalar()
        with engine.connect() as other:
            other.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid})
        with pytest.raises(sa.exc.OperationalError):
            s.enqueue("t", queue="default")
    with Session.begin() as s:
        s.enqueue("t", queue="default")
    assert _tasks(engine) == ["t", "t"]


def test_enqueue_inside_the_callers_own_pipeline(
        Session: sessionmaker[flowq.Session], engine: sa.Engine) -> None:
    """psycopg nests pipelines: the enqueue syncs what the caller queued, then its own."""
    with Session() as s:
        first = s.enqueue("t", queue="default", n=1)  # outside: SQLAlchemy's own reads need results at once
        raw = s.connection().connection.dbapi_connection
        assert isinstance(raw, psycopg.Connection)
        with raw.pipeline():
            raw.execute("SELECT 1")
            second = s.enqueue("t", queue="default", n=2)
        s.commit()
    assert [r.run_id for r in _rows(engine)] == [first.id, second.id]



def test_a_plain_connection_commits_the_job(engine: sa.Engine) -> None:
    """SQLAlchemy autobegins on execute; the direct path must too, or `conn.commit()` would
    find no transaction and the job would be rolled back with the pooled connection."""
    for _ in range(2):  # the second time the schema check is cached: enqueue sends the only SQL
        with engine.connect() as conn:
            flowq.enqueue(conn, "t", queue="default")
            assert conn.in_transaction()
            conn.commit()
    with engine.connect() as conn:
        flowq.enqueue(conn, "t", queue="default")
        conn.rollback()
    assert _tasks(engine) == ["t", "t"]


def test_missing_non_default_schema_says_to_migrate_that_schema(engine: sa.Engine) -> None:
    hint = r"`flowq migrate --schema nope` first \(or flowq\.migrate\(engine, schema='nope'\)\)"
    with engine.connect() as conn, pytest.raises(flowq.SchemaMissingError, match=hint):
        flowq.enqueue(conn, "t", queue="default", schema="nope")
    flowq.migrate(engine, schema="nope")
    with engine.begin() as conn:
        flowq.enqueue(conn, "t", queue="default", schema="nope")  # now known to have it
    with engine.begin() as conn:
        conn.execute(sa.text("DROP SCHEMA nope CASCADE"))
    with engine.connect() as conn, pytest.raises(flowq.SchemaMissingError, match=hint):
        flowq.enqueue(conn, "t", queue="default", schema="nope")


def test_the_enqueue_functions_spell_the_one_option_list() -> None:
    """`flowq.enqueue` and its async twin take the options beside the handler's arguments
    (`**args`), which a TypedDict cannot type (PEP 692 has no "and any other keyword"), so
    they spell the options out: exactly `EnqueueOptions`, with its types, each defaulting to
    "not given"."""
    from flowq.enqueueing import aio, sync

    options = typing.get_type_hints(EnqueueOptions)
    assert set(options) == RESERVED_OPTIONS
    for fn in (sync.enqueue, aio.enqueue):
        keywords = {n: p for n, p in inspect.signature(fn).parameters.items()
                    if p.kind is p.KEYWORD_ONLY}
        assert set(keywords) == set(options), fn
        hints = typing.get_type_hints(fn)
        assert {n: hints[n] for n in keywords} == options, fn
        assert all(p.default in (None, False) for p in keywords.values()), fn


def test_an_unknown_option_past_the_type_checker_is_refused() -> None:
    from flowq.enqueueing.prepare import prepare_enqueue

    app = flowq.FlowQ()

    @app.task(name="opt_unknown")
    def t(ctx: flowq.Context) -> None: ...

    with pytest.raises(flowq.InvalidArgumentsError, match="unknown enqueue option"):
        prepare_enqueue(t, {}, **typing.cast(Any, {"prio": 1}))
