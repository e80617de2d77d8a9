"""Periodic schedules: definitions and their bad input, tick computation (DST included, computed
rather than waited for), the scheduler's passes with a fake clock against the real database
(exactly one run per tick under concurrent passes, the catch-up rule), `ctx.scheduled_at`,
`flowq schedules`, and three real worker processes sharing an every-second schedule."""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

import flowq
from flowq.cli import main
from flowq.define.schedules import LATE_GRACE, MAX_TICKS_PER_PASS, Schedule
from flowq.ops.schedules import list_schedules
from flowq.testing import drain, wait_until
from flowq.worker import Worker, WorkerConfig
from flowq.worker.scheduler import Scheduler

UTC = timezone.utc
KEYS = "idempotency_key LIKE 'flowq:schedule:%'"


def at(text: str) -> datetime:
    """An aware UTC datetime from `2025-03-30T01:00:00Z`-style text."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)


def only(app: flowq.FlowQ) -> Schedule:
    [s] = app.schedules
    return s


def scheduled_runs(engine: sa.Engine) -> list[sa.Row[Any]]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text(
            f"SELECT run_id, idempotency_key, scheduled_at, run_at, task FROM flowq.steps "
            f"WHERE {KEYS} ORDER BY idempotency_key")))


def tick_of(key: str) -> datetime:
    """The tick named by a schedule's idempotency key `flowq:schedule:<name>:<tick>`."""
    _name, _, stamp = key.removeprefix("flowq:schedule:").partition(":")
    return at(stamp)


# -- definitions and bad input -------------------------------------------------------------


def test_periodic_returns_the_task_itself(app: flowq.FlowQ) -> None:
    @app.periodic(cron="*/5 * * * *", args={"n": 1})
    @app.task()
    def tick(ctx: flowq.Context, n: int) -> None: ...

    assert isinstance(tick, flowq.Task) and app.get("tick") is tick
    s = only(app)
    assert (s.name, s.task, s.args, s.timezone, s.catch_up) == ("tick", "tick", {"n": 1},
                                                                "UTC", False)
    assert s.spec == "*/5 * * * * (UTC)"


def test_pipelines_take_the_method_or_decorator_form(app: flowq.FlowQ) -> None:
    report = app.pipeline("report")

    @report.step()
    def fetch(ctx: flowq.Context, day: str = "today") -> dict[str, Any]:
        return {"rows": 1}

    assert app.periodic(report, every=timedelta(hours=1)) is report
    assert app.periodic(name="nightly", cron="@daily", timezone="Europe/Paris",
                        args={"day": "yesterday"})(report) is report
    assert [(s.name, s.spec) for s in app.schedules] == [
        ("nightly", "@daily (Europe/Paris)"), ("report", "every 1h")]


def test_a_pipeline_scheduled_before_its_steps_is_checked_at_worker_start(
        app: flowq.FlowQ) -> None:
    later = app.pipeline("later")
    app.periodic(later, every=60, args={"x": 1})

    @later.step()
    def first(ctx: flowq.Context, y: int) -> None: ...

    with pytest.raises(flowq.ConfigurationError, match=r"schedule 'later'.*unexpected.*'x'"):
        app.check()
    with pytest.raises(flowq.ConfigurationError, match="schedule 'later'"):
        Worker(app, "postgresql://localhost/none")


def _define(app: flowq.FlowQ, **options: Any) -> None:
    @app.periodic(**options)
    @app.task()
    def job(ctx: flowq.Context, n: int = 0) -> None: ...


@pytest.mark.parametrize(("options", "message"), [
    ({"cron": "61 * * * *"}, r"cron expression '61 \* \* \* \*' of schedule 'job' is not "
                             r"valid \(Bad minute\): use 5 fields"),
    ({"cron": "* * *"}, r"not valid \(Wrong number of fields\)"),
    ({"cron": "*/0 * * * *"}, r"not valid \(Bad minute\)"),
    ({"cron": "0 0 31 2 *"}, r"not valid \(Bad day-of-month\)"),
    ({"cron": "@reboot"}, "not valid"),
    ({"cron": 5}, "cron of schedule 'job' must be a string"),
    ({"cron": "* * * * *", "timezone": "Mars/Olympus_Mons"},
     "timezone 'Mars/Olympus_Mons' of schedule 'job' is not a known IANA time zone"),
    ({"cron": "* * * * *", "timezone": "../../etc/passwd"}, "not a known IANA time zone"),
    ({"cron": "* * * * *", "timezone": None}, "must be an IANA name"),
    ({"every": timedelta(0)}, r"must be at least 1 second, got .*\(zero or negative\)"),
    ({"every": timedelta(seconds=-5)}, r"\(zero or negative\)"),
    ({"every": -1}, r"\(zero or negative\)"),
    ({"every": timedelta(milliseconds=500)}, "must be at least 1 second"),
    ({"every": float("nan")}, "must be finite"),
    ({"every": "5m"}, "must be a timedelta"),
    ({}, "needs exactly one of cron=.* or every="),
    ({"cron": "* * * * *", "every": timedelta(minutes=1)}, "exactly one of .*, not both"),
    ({"every": 60, "timezone": "Europe/Paris"}, "timezone applies to cron schedules"),
    ({"every": 60, "args": {"n": {1, 2}}}, "args of schedule 'job'.*JSON"),
    ({"every": 60, "args": {"n": float("nan")}}, "args of schedule 'job'"),
    ({"every": 60, "args": [1]}, "must be a dict of keyword arguments"),
    ({"every": 60, "args": {"m": 1}}, r"schedule 'job'.*unexpected keyword argument.*'m'"),
    ({"every": 60, "args": {"n": 1, "queue": "x"}}, "schedule 'job'"),
    ({"every": 60, "catch_up": "yes"}, "catch_up of schedule 'job' must be True or False"),
    ({"every": 60, "name": "bad name!"}, "schedule name 'bad name!' is not valid"),
])
def test_bad_definitions_are_refused_with_a_clear_error(app: flowq.FlowQ,
                                                        options: dict[str, Any],
                                                        message: str) -> None:
    with pytest.raises(flowq.ConfigurationError, match=message):
        _define(app, **options)
    assert app.schedules == []


def test_arguments_that_do_not_bind_are_refused(app: flowq.FlowQ) -> None:
    @app.task()
    def needs(ctx: flowq.Context, n: int) -> None: ...

    with pytest.raises(flowq.ConfigurationError, match=r"schedule 'needs'.*missing.*'n'"):
        app.periodic(needs, every=60)


def test_what_an_enqueue_of_a_tick_refuses_is_refused_at_definition(
        app: flowq.FlowQ) -> None:
    """A schedule is checked as its ticks' enqueues would be: a priority out of range, a
    concurrency key that is not a JSON scalar, the arguments of every root."""
    with pytest.raises(flowq.ConfigurationError, match=r"'too_high'.*priority"):
        @app.task(name="too_high", priority=40_000)  # refused already, when declared
        def too_high(ctx: flowq.Context) -> None: ...

    @app.task(name="keyed", concurrency_key=lambda **_: [1])
    def keyed(ctx: flowq.Context) -> None: ...

    with pytest.raises(flowq.ConfigurationError, match=r"schedule 'keyed'.*JSON scalar"):
        app.periodic(keyed, every=60)

    fan = app.pipeline("fan")

    @fan.step(parents=[])
    def left(ctx: flowq.Context, n: int, extra: int = 0) -> None: ...

    @fan.step(parents=[], wait_for="go")
    def right(ctx: flowq.Context, n: int, go: object) -> None: ...

    app.periodic(fan, every=60, args={"n": 1})  # fits both roots, with right's signal slot
    with pytest.raises(flowq.ConfigurationError, match=r"schedule 'other'.*step 'right'.*extra"):
        app.periodic(fan, every=60, args={"n": 1, "extra": 2}, name="other")


def test_duplicate_schedule_names_are_refused(app: flowq.FlowQ) -> None:
    @app.task()
    def job(ctx: flowq.Context, n: int = 0) -> None: ...

    app.periodic(job, every=60)
    with pytest.raises(flowq.ConfigurationError,
                       match=r"a schedule named 'job' is already defined.*pass name="):
        app.periodic(job, cron="0 * * * *")
    app.periodic(job, cron="0 * * * *", name="job-hourly", args={"n": 1})
    assert [s.name for s in app.schedules] == ["job", "job-hourly"]


def test_periodic_goes_above_the_task_decorator(app: flowq.FlowQ) -> None:
    with pytest.raises(flowq.ConfigurationError, match=r"put it above @app\.task"):
        @app.task()
        @app.periodic(every=60)
        def job(ctx: flowq.Context) -> None: ...


def test_a_task_of_another_app_is_refused(app: flowq.FlowQ) -> None:
    other = flowq.FlowQ()

    @other.task()
    def job(ctx: flowq.Context) -> None: ...

    with pytest.raises(flowq.ConfigurationError, match="not a task or pipeline of this app"):
        app.periodic(job, every=60)


# -- ticks ---------------------------------------------------------------------------------


def schedule(app: flowq.FlowQ, **options: Any) -> Schedule:
    _define(app, **options)
    return only(app)


def test_every_ticks_on_multiples_of_the_interval_since_the_epoch(app: flowq.FlowQ) -> None:
    s = schedule(app, every=timedelta(seconds=5))
    assert s.next_tick(at("2025-01-01T12:00:03Z")) == at("2025-01-01T12:00:05Z")
    assert s.next_tick(at("2025-01-01T12:00:05Z")) == at("2025-01-01T12:00:10Z")
    assert s.ticks(at("2025-01-01T12:00:00Z"), at("2025-01-01T12:00:15Z")) == [
        at("2025-01-01T12:00:05Z"), at("2025-01-01T12:00:10Z"), at("2025-01-01T12:00:15Z")]
    assert s.latest_tick(at("2025-01-01T12:00:00Z"), at("2025-01-01T13:00:02Z")) == at(
        "2025-01-01T13:00:00Z")
    hourly = schedule(flowq.FlowQ(), every=timedelta(hours=1))
    assert hourly.next_tick(at("2025-01-01T12:34:56.789Z")) == at("2025-01-01T13:00:00Z")
    assert s.key(at("2025-01-01T12:00:05Z")) == "flowq:schedule:job:2025-01-01T12:00:05Z"


def test_cron_ticks_in_utc_and_aliases(app: flowq.FlowQ) -> None:
    s = schedule(app, cron="*/15 * * * *")
    assert s.ticks(at("2025-01-01T12:00:00Z"), at("2025-01-01T13:00:00Z")) == [
        at("2025-01-01T12:15:00Z"), at("2025-01-01T12:30:00Z"), at("2025-01-01T12:45:00Z"),
        at("2025-01-01T13:00:00Z")]
    daily = schedule(flowq.FlowQ(), cron="@daily")
    assert daily.next_tick(at("2025-01-01T12:00:00Z")) == at("2025-01-02T00:00:00Z")
    seconds = schedule(flowq.FlowQ(), cron="*/20 * * * * *")
    assert seconds.ticks(at("2025-01-01T12:00:00Z"), at("2025-01-01T12:01:00Z")) == [
        at("2025-01-01T12:00:20Z"), at("2025-01-01T12:00:40Z"), at("2025-01-01T12:01:00Z")]


# Europe/Paris in 2025: clocks go forward on March 30 at 02:00 CET (01:00Z) to 03:00 CEST,
# and back on October 26 at 03:00 CEST (01:00Z) to 02:00 CET.
@pytest.mark.parametrize(("cron", "after", "expected"), [
    # A daily time skipped by the spring change fires at the first instant after the gap
    # (03:00 CEST), then at 02:30 CEST again.
    ("30 2 * * *", "2025-03-29T12:00:00Z",
     ["2025-03-30T01:00:00Z", "2025-03-31T00:30:00Z", "2025-04-01T00:30:00Z"]),
    # A daily time that occurs twice in the autumn fires once, at the first occurrence.
    ("30 2 * * *", "2025-10-25T12:00:00Z",
     ["2025-10-26T00:30:00Z", "2025-10-27T01:30:00Z", "2025-10-28T01:30:00Z"]),
    # 09:00 local stays 09:00 local: 08:00Z in winter, 07:00Z in summer, and back.
    ("0 9 * * *", "2025-03-28T12:00:00Z",
     ["2025-03-29T08:00:00Z", "2025-03-30T07:00:00Z", "2025-03-31T07:00:00Z"]),
    ("0 9 * * *", "2025-10-25T12:00:00Z",
     ["2025-10-26T08:00:00Z", "2025-10-27T08:00:00Z"]),
    # Sub-hourly jobs run by real time: every half hour through both repeated hours...
    ("*/30 * * * *", "2025-10-25T23:45:00Z",
     ["2025-10-26T00:00:00Z", "2025-10-26T00:30:00Z", "2025-10-26T01:00:00Z",
      "2025-10-26T01:30:00Z", "2025-10-26T02:00:00Z"]),
    # ...and hourly with no tick lost to the hour that does not exist.
    ("0 * * * *", "2025-03-29T23:30:00Z",
     ["2025-03-30T00:00:00Z", "2025-03-30T01:00:00Z", "2025-03-30T02:00:00Z"]),
    # Weekdays are local weekdays: Monday 00:15 in Paris is Sunday 22:15Z in summer.
    ("15 0 * * MON", "2025-03-28T00:00:00Z", ["2025-03-30T22:15:00Z", "2025-04-06T22:15:00Z"]),
])
def test_cron_in_a_timezone_across_dst_changes(app: flowq.FlowQ, cron: str, after: str,
                                               expected: list[str]) -> None:
    s = schedule(app, cron=cron, timezone="Europe/Paris")
    got = s.ticks(at(after), at(expected[-1]))
    assert [t.isoformat().replace("+00:00", "Z") for t in got] == expected
    assert all(t.tzinfo is UTC for t in got)


def test_new_york_spring_forward(app: flowq.FlowQ) -> None:
    # 2025-03-09 02:00 EST does not exist: the 02:00 job runs at 03:00 EDT (07:00Z).
    s = schedule(app, cron="0 2 * * *", timezone="America/New_York")
    assert s.ticks(at("2025-03-08T12:00:00Z"), at("2025-03-10T12:00:00Z")) == [
        at("2025-03-09T07:00:00Z"), at("2025-03-10T06:00:00Z")]


@pytest.mark.parametrize("cron", ["30 2 * * *", "0 * * * *", "*/15 * * * *", "0 2 * * *",
                                  "*/7 2 * * *", "30 1-3 * * *", "0 9 * * MON-FRI"])
def test_ticks_agree_from_any_start_across_a_year_of_paris_time(app: flowq.FlowQ,
                                                                cron: str) -> None:
    """The instants are the same whichever moment a worker starts counting from (even one
    inside a repeated hour), strictly increasing, and `latest_tick` agrees with them: that
    is what makes every worker compute the same idempotency keys."""
    s = schedule(app, cron=cron, timezone="Europe/Paris")
    start, end = at("2025-03-25T00:00:00Z"), at("2025-04-05T00:00:00Z")
    autumn = (at("2025-10-22T00:00:00Z"), at("2025-11-01T00:00:00Z"))
    rng = random.Random(cron)
    for lo, hi in ((start, end), autumn):
        every = s.ticks(lo, hi, limit=100_000)
        assert every == sorted(set(every))
        for _ in range(150):
            x = lo + timedelta(seconds=rng.randrange(int((hi - lo).total_seconds() * 0.9)))
            later = [t for t in every if t > x]
            assert s.next_tick(x) == later[0]
            assert s.latest_tick(lo, x) == max((t for t in every if t <= x), default=None)


def test_due_ticks_latest_plus_recent_by_default_all_with_catch_up(app: flowq.FlowQ) -> None:
    every_minute = schedule(app, every=timedelta(minutes=1))
    cursor, now = at("2025-01-01T10:00:00Z"), at("2025-01-01T11:00:30Z")
    assert every_minute.due_ticks(cursor, now) == [at("2025-01-01T11:00:00Z")]
    assert every_minute.due_ticks(now, now) == []
    every_second = schedule(flowq.FlowQ(), every=timedelta(seconds=1))
    due = every_second.due_ticks(cursor, cursor + timedelta(seconds=100))
    grace = int(LATE_GRACE.total_seconds())
    assert due == [cursor + timedelta(seconds=s) for s in range(101 - grace, 101)]
    catching = schedule(flowq.FlowQ(), every=timedelta(minutes=1), catch_up=True)
    due = catching.due_ticks(cursor, now)
    assert due == [cursor + timedelta(minutes=m) for m in range(1, 61)]
    big = catching.due_ticks(cursor - timedelta(days=30), now)
    assert len(big) == MAX_TICKS_PER_PASS and big[0] == cursor - timedelta(days=30, minutes=-1)


# -- the scheduler against the database ----------------------------------------------------


@pytest.fixture
def ran() -> list[tuple[int, datetime | None]]:
    return []


@pytest.fixture
def ticking(app: flowq.FlowQ, ran: list[tuple[int, datetime | None]]
            ) -> Callable[..., Schedule]:
    def define(**options: Any) -> Schedule:
        @app.periodic(**options)
        @app.task(name=options.get("name") or "tick")
        def tick(ctx: flowq.Context, n: int = 0) -> None:
            ran.append((ctx.run_id, ctx.scheduled_at))

        return next(s for s in app.schedules if s.name == (options.get("name") or "tick"))

    return define


BASE = at("2025-06-01T12:00:00.250Z")


def test_a_new_schedule_starts_from_now_then_enqueues_each_tick_once(
        engine: sa.Engine, app: flowq.FlowQ, ticking: Callable[..., Schedule],
        ran: list[tuple[int, datetime | None]]) -> None:
    s = ticking(every=timedelta(seconds=1), args={"n": 7})
    scheduler = Scheduler(engine, app)
    assert scheduler.run_once(BASE) == 0  # entered at BASE: no backfill
    assert scheduled_runs(engine) == []
    assert scheduler.run_once(BASE + timedelta(seconds=0.5)) == 0  # no tick in between
    assert scheduler.run_once(BASE + timedelta(seconds=1)) == 1
    assert scheduler.run_once(BASE + timedelta(seconds=1)) == 0  # the same tick: nothing new
    assert scheduler.run_once(BASE + timedelta(seconds=3)) == 2
    runs = scheduled_runs(engine)
    ticks = [at("2025-06-01T12:00:01Z"), at("2025-06-01T12:00:02Z"), at("2025-06-01T12:00:03Z")]
    assert [r.idempotency_key for r in runs] == [s.key(t) for t in ticks]
    assert [r.scheduled_at for r in runs] == ticks == [r.run_at for r in runs]
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT * FROM flowq.schedules")).one()
        args = conn.execute(sa.text(f"SELECT DISTINCT args FROM flowq.steps WHERE {KEYS}")).all()
    assert (row.name, row.task, row.spec, row.last_tick, row.last_run_id) == (
        "tick", "tick", "every 1s", ticks[-1], runs[-1].run_id)
    assert args == [({"n": 7},)]
    # The handler reads the tick it runs for.
    drain(engine, app)
    assert sorted(ran) == [(r.run_id, r.scheduled_at) for r in runs]
    assert all(t is not None and t.tzinfo is UTC for _, t in ran)


def test_concurrent_passes_enqueue_each_tick_exactly_once(
        engine: sa.Engine, app: flowq.FlowQ, ticking: Callable[..., Schedule]) -> None:
    """Eight schedulers on eight connections run the same passes at once (some a little
    later than others): every tick is enqueued once, and the cursor ends on the last."""
    ticking(every=timedelta(seconds=1))
    ticking(name="minutely", cron="* * * * *", catch_up=True)
    n, passes = 8, 40
    schedulers = [Scheduler(engine, app) for _ in range(n)]
    barrier = threading.Barrier(n)
    created = [0] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for p in range(passes):
                barrier.wait(timeout=30)
                jitter = timedelta(milliseconds=(i * 37 + p * 11) % 200)
                created[i] += schedulers[i].run_once(BASE + timedelta(seconds=p * 7) + jitter)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    runs = scheduled_runs(engine)
    keys = [r.idempotency_key for r in runs]
    assert len(keys) == len(set(keys)) == sum(created)
    per_second = sorted(tick_of(k) for k in keys if ":tick:" in k)
    minutes = sorted(tick_of(k) for k in keys if ":minutely:" in k)
    # every=1s: each pass is 7 s after the last, so it enqueues the latest tick and the ones
    # less than 10 s old: all of them, gapless.
    assert per_second == [per_second[0] + timedelta(seconds=i) for i in range(len(per_second))]
    assert per_second[0] == at("2025-06-01T12:00:01Z")
    assert per_second[-1] == at("2025-06-01T12:04:33Z")  # BASE + 39 * 7 s, floored
    assert minutes == [at("2025-06-01T12:01:00Z") + timedelta(minutes=i) for i in range(4)]
    with engine.connect() as conn:
        cursors = dict(conn.execute(sa.text("SELECT name, last_tick FROM flowq.schedules")).all())
    assert cursors == {"tick": per_second[-1], "minutely": minutes[-1]}


def test_missed_ticks_run_once_latest_by_default(
        engine: sa.Engine, app: flowq.FlowQ, ticking: Callable[..., Schedule]) -> None:
    ticking(every=timedelta(minutes=1))
    scheduler = Scheduler(engine, app)
    scheduler.run_once(BASE)
    # Every worker was down for an hour: only the latest tick runs.
    assert scheduler.run_once(BASE + timedelta(hours=1)) == 1
    assert [tick_of(r.idempotency_key) for r in scheduled_runs(engine)] == [
        at("2025-06-01T13:00:00Z")]
    # The skipped ticks never come back.
    assert scheduler.run_once(BASE + timedelta(hours=1, seconds=30)) == 0
    assert scheduler.run_once(BASE + timedelta(hours=1, minutes=1)) == 1


def test_catch_up_runs_every_missed_tick_at_most_1000_per_pass(
        engine: sa.Engine, app: flowq.FlowQ, ticking: Callable[..., Schedule]) -> None:
    ticking(every=timedelta(seconds=1), catch_up=True)
    scheduler = Scheduler(engine, app)
    scheduler.run_once(BASE)
    later = BASE + timedelta(seconds=2500)
    assert [scheduler.run_once(later) for _ in range(4)] == [1000, 1000, 500, 0]
    ticks = sorted(tick_of(r.idempotency_key) for r in scheduled_runs(engine))
    assert ticks == [at("2025-06-01T12:00:01Z") + timedelta(seconds=i) for i in range(2500)]


def test_a_pipeline_schedule_stamps_the_steps_the_run_starts_with(
        engine: sa.Engine, app: flowq.FlowQ) -> None:
    seen: list[tuple[str, datetime | None]] = []
    report = app.pipeline("report")

    @report.step()
    def fetch(ctx: flowq.Context) -> dict[str, Any]:
        seen.append((ctx.step, ctx.scheduled_at))
        return {"tick": ctx.scheduled_at.isoformat() if ctx.scheduled_at else None}

    @report.step()
    def send(ctx: flowq.Context, tick: str | None) -> None:
        seen.append((ctx.step, at(tick) if tick else None))

    app.periodic(report, cron="*/5 * * * *", timezone="Europe/Paris")
    scheduler = Scheduler(engine, app)
    scheduler.run_once(BASE)
    assert scheduler.run_once(BASE + timedelta(minutes=5)) == 1
    drain(engine, app)
    assert seen == [("fetch", at("2025-06-01T12:05:00Z")), ("send", at("2025-06-01T12:05:00Z"))]


def test_an_app_without_schedules_or_with_them_switched_off_runs_no_scheduler(
        db_url: str, app: flowq.FlowQ, ticking: Callable[..., Schedule]) -> None:
    @app.task()
    def plain(ctx: flowq.Context) -> None: ...

    w = Worker(app, db_url)
    assert w.scheduler is None
    ticking(every=60)
    assert Worker(app, db_url).scheduler is not None
    assert Worker(app, db_url, WorkerConfig(schedules=False)).scheduler is None


def test_a_worker_thread_enqueues_ticks_by_the_database_clock(
        db_url: str, engine: sa.Engine, app: flowq.FlowQ,
        ticking: Callable[..., Schedule], ran: list[tuple[int, datetime | None]]) -> None:
    ticking(every=timedelta(seconds=1))
    w = Worker(app, db_url, WorkerConfig(poll_interval=0.2, shutdown_grace=5))
    t = threading.Thread(target=w.run, kwargs={"install_signals": False})
    t.start()
    try:
        wait_until(lambda: len(ran) >= 3, timeout=30, message="three ticks run")
    finally:
        w.stop()
        t.join(timeout=30)
    ticks = [s for _, s in sorted(ran) if s is not None]
    assert ticks == [ticks[0] + timedelta(seconds=i) for i in range(len(ticks))]


# -- flowq schedules -----------------------------------------------------------------------


def test_flowq_schedules_lists_spec_next_tick_and_last_run(db_url: str,
                                                           engine: sa.Engine) -> None:
    import schedule_app

    def cli(*args: str) -> Any:
        result = CliRunner().invoke(main, ["schedules", "--database-url", db_url, *args],
                                    env={"FLOWQ_DATABASE_URL": None, "DATABASE_URL": None})
        assert result.exit_code == 0, (result.output, result.exception)
        return result.output

    out = cli("--app", "schedule_app:app")
    assert out.splitlines()[0].split() == ["schedule", "task", "spec", "next", "tick", "last",
                                           "tick", "last", "run"]
    assert out.splitlines()[1].split()[:4] == ["heartbeat", "heartbeat", "every", "1s"]
    assert cli() == "no schedules recorded (pass --app MODULE:APP to list an app's).\n"

    scheduler = Scheduler(engine, schedule_app.app)
    scheduler.run_once(BASE)
    scheduler.run_once(BASE + timedelta(seconds=1))
    [run] = scheduled_runs(engine)
    [info] = json.loads(cli("--app", "schedule_app:app", "--json"))["schedules"]
    assert info["last_tick"] == "2025-06-01T12:00:01+00:00"
    assert (info["name"], info["spec"], info["last_run_id"], info["last_status"],
            info["defined"]) == ("heartbeat", "every 1s", run.run_id, "pending", True)
    assert at(info["next_tick"]) > datetime.now(UTC) - timedelta(seconds=5)
    assert f"{run.run_id} (pending)" in cli("--app", "schedule_app:app")
    # Without the app: what the database records, without a next tick.
    [known] = list_schedules(engine)
    assert (known.name, known.spec, known.next_tick, known.defined) == (
        "heartbeat", "every 1s", None, False)
    # ... and nothing says the app does not define it: without the app, no one can tell.
    listed = cli()
    assert "heartbeat" in listed and "not in app" not in listed
    assert json.loads(cli("--json"))["schedules"][0]["defined"] is None
    # The app named as for every command (MODULE:APP after it) is the app.
    assert json.loads(cli("schedule_app:app", "--json"))["schedules"][0]["defined"] is True
    help_text = CliRunner().invoke(main, ["worker", "--help"]).output
    assert "--no-schedules" in help_text


# -- real worker processes -----------------------------------------------------------------


@pytest.mark.slow
def test_three_workers_and_an_every_second_schedule_give_one_run_per_tick(
        db_url: str, engine: sa.Engine, spawn_worker: Callable[..., Any]) -> None:
    import schedule_app

    with engine.begin() as conn:
        conn.execute(sa.text(schedule_app.LEDGER_DDL))
    workers = [spawn_worker("schedule_app:app", db_url, "--concurrency", "2",
                            "--poll-interval", "0.5") for _ in range(3)]
    wait_until(lambda: len(scheduled_runs(engine)) >= 1, timeout=60,
               message="the first tick enqueued")
    started = time.monotonic()
    while time.monotonic() - started < 10.5:
        assert all(w.proc.poll() is None for w in workers), "a worker exited"
        time.sleep(0.5)
    for w in workers:
        w.signal(signal.SIGTERM)
    assert [w.wait(timeout=60) for w in workers] == [0, 0, 0]

    runs = scheduled_runs(engine)
    ticks = [tick_of(r.idempotency_key) for r in runs]
    assert len(ticks) == len(set(ticks))
    assert ticks == [ticks[0] + timedelta(seconds=i) for i in range(len(ticks))], "a gap"
    assert 10 <= len(ticks) <= 14
    assert [r.scheduled_at for r in runs] == ticks
    with engine.connect() as conn:
        ledger = conn.execute(sa.text(
            "SELECT run_id, scheduled_at, pid FROM schedule_ledger")).all()
    # Each run ran once (its ledger row commits with its success); all but those enqueued
    # during the shutdown ran.
    by_run = {r.run_id: r.scheduled_at for r in ledger}
    assert len(by_run) == len(ledger)
    assert by_run == {r.run_id: r.scheduled_at for r in runs if r.run_id in by_run}
    assert len(ledger) >= len(runs) - 2
    for w in workers:
        for trouble in ("scheduler crashed", "pass failed", "schedule failed"):
            assert trouble not in w.log()
