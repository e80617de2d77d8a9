"""Bulk redrive and run filters: `flowq runs retry --status dead [filters]`,
`flowq.ops.runs.retry_runs`, and `flowq runs list` / `list_runs` by task, queue and time, in pages.

The acceptance test redrives 1,000 runs that real worker processes ran to death, and the
same workers then finish them; the rest drive the API and the CLI over rows set up directly.
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone
from typing import Any

import pipeline_app as pa
import pytest
import sqlalchemy as sa
from runs_cli import cli, cli_json
from support import scalar

import flowq
from flowq.ops.runs import DEFAULT_RETRY_BATCH, get_run, list_runs, parse_when, retry_runs
from flowq.testing import job_rows, wait_until

FAST_POLL = ("--poll-interval", "0.1")

app = flowq.FlowQ()


@app.task(name="rd_mail", queue="mail")
def mail(ctx: flowq.Context, n: int) -> int:
    return n


@app.task(name="rd_report")
def report(ctx: flowq.Context, n: int) -> int:
    return n


two = app.pipeline("rd_two")


@two.step(queue="first")
def two_a(ctx: flowq.Context, n: int) -> dict[str, int]:
    return {"n": n}


@two.step(queue="second")
def two_b(ctx: flowq.Context, n: int) -> int:
    return n


def many(engine: sa.Engine, task: Any, n: int, start: int = 0) -> list[int]:
    with engine.begin() as conn:
        return flowq.enqueue_many(conn, task, [{"n": start + i} for i in range(n)])


def kill(engine: sa.Engine, run_ids: list[int], *, ago: timedelta | None = None) -> None:
    """End every row of these runs dead, as a worker would after their last attempt (and
    optionally pretend they were created `ago`)."""
    with engine.begin() as conn:
        if ago is not None:  # first: a row that ends moves to flowq.job_history
            conn.execute(sa.text(
                "UPDATE flowq.jobs SET created_at = now() - CAST(:ago AS interval) "
                "WHERE run_id = ANY(:ids)"), {"ids": run_ids, "ago": ago})
        conn.execute(sa.text(
            "UPDATE flowq.jobs SET status = 'dead', attempts = max_attempts, "
            "finished_at = now(), last_error = 'RuntimeError: boom' "
            "WHERE run_id = ANY(:ids)"), {"ids": run_ids})


def statuses(engine: sa.Engine, run_ids: list[int]) -> dict[str, int]:
    with engine.connect() as c:
        return {r.status: r.n for r in c.execute(sa.text(
            "SELECT status, count(*) AS n FROM flowq.steps WHERE run_id = ANY(:ids) "
            "GROUP BY status"), {"ids": run_ids})}


# -- the acceptance test: real workers, 1,000 dead runs ------------------------------------------


def test_a_thousand_runs_killed_by_real_workers_are_redriven_by_the_cli(
        engine: sa.Engine, db_url: str, spawn_worker: Any) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(pa.LEDGER_DDL)
        run_ids = flowq.enqueue_many(conn, pa.fixable, [{"n": i} for i in range(1000)])
        ok = flowq.enqueue_many(conn, pa.chain3, [{"n": i} for i in range(20)])
    for _ in range(2):
        spawn_worker("pipeline_app:app", db_url, "--concurrency", "20", "--no-job-log",
                     *FAST_POLL)
    wait_until(lambda: scalar(engine, "SELECT count(*) FROM flowq.steps WHERE step = 'fix_two' "
                                      "AND status = 'dead'") == 1000,
               timeout=300, interval=0.2, message="1,000 runs to die")
    wait_until(lambda: statuses(engine, ok) == {"succeeded": 60}, timeout=60,
               message="the other runs to succeed")
    assert len(list_runs(engine, status="dead", limit=2000, task="fixable")) == 1000

    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO switches VALUES ('fixed')"))
    code, out, err = cli(db_url, "retry", "--status", "dead", "--batch-size", "128")
    assert (code, out.strip(), err) == (0, "retried 1000 run(s).", said(128))

    wait_until(lambda: statuses(engine, run_ids) == {"succeeded": 2000}, timeout=300,
               interval=0.2, message="the redriven runs to succeed")
    # Each run's first step ran once; its second step once more, with a fresh budget.
    assert scalar(engine, "SELECT count(*) FROM pipeline_ledger WHERE step = 'fix_one'") == 1000
    assert scalar(engine, "SELECT count(*) FROM pipeline_ledger WHERE step = 'fix_two'") == 1000
    assert scalar(engine, "SELECT max(attempts) FROM flowq.steps WHERE step = 'fix_two'") == 1
    assert get_run(engine, run_ids[0]).result == {"n": 0, "total": 1}
    assert cli(db_url, "retry", "--status", "dead")[1].strip() == "retried 0 run(s)."


def said(batch_size: int = DEFAULT_RETRY_BATCH) -> str:
    """What a bulk retry says on stderr as it starts (off a terminal: that one line)."""
    return f"flowq: retrying the dead runs that match, {batch_size:,} per transaction …\n"


# -- the API ------------------------------------------------------------------------------------


def test_the_api_retries_in_batches_each_its_own_transaction(engine: sa.Engine) -> None:
    dead = many(engine, mail, 1000)
    alive = many(engine, mail, 5, start=1000)
    kill(engine, dead)
    assert retry_runs(engine, batch_size=300) == 1000
    rows = job_rows(engine, where="run_id = ANY(:ids)", ids=dead)
    assert {(r.status, r.attempts, r.finished_at) for r in rows} == {("pending", 0, None)}
    assert {r.last_error for r in rows} == {"RuntimeError: boom"}  # kept until the next end
    # Four batches (300, 300, 300, 100), four transactions.
    assert scalar(engine, "SELECT count(DISTINCT xmin::text) FROM flowq.jobs "
                          "WHERE run_id = ANY(:ids)", ids=dead) == 4
    assert statuses(engine, alive) == {"pending": 5}
    assert retry_runs(engine) == 0  # none is dead any more


def test_limit_takes_the_oldest_first(engine: sa.Engine) -> None:
    dead = many(engine, mail, 30)
    kill(engine, dead)
    assert retry_runs(engine, limit=12, batch_size=5) == 12
    assert statuses(engine, dead[:12]) == {"pending": 12}
    assert statuses(engine, dead[12:]) == {"dead": 18}
    assert retry_runs(engine, limit=100) == 18


def test_filters_by_task_queue_and_time(engine: sa.Engine) -> None:
    mails = many(engine, mail, 10)                 # queue mail
    reports = many(engine, report, 10)             # queue default
    with engine.begin() as conn:                   # a run with steps on two queues
        pipes = [flowq.enqueue(conn, two, n=i).id for i in range(3)]
        conn.execute(sa.text(
            "INSERT INTO flowq.jobs (run_id, task, step, step_index, queue, args) "
            "SELECT run_id, task, 'two_b', 1, 'second', args FROM flowq.steps "
            "WHERE run_id = ANY(:ids)"), {"ids": pipes})
    kill(engine, mails[:5], ago=timedelta(days=3))
    kill(engine, mails[5:])
    kill(engine, reports[:5], ago=timedelta(hours=5))
    kill(engine, pipes)

    def ids(**filters: Any) -> set[int]:
        return {r.run_id for r in list_runs(engine, status="dead", limit=1000, **filters)}

    assert ids(task="rd_mail") == set(mails)
    assert ids(queue="mail") == set(mails)
    assert ids(queue="second") == ids(queue="first") == set(pipes)  # any step on the queue
    assert ids(since="4h") == set(mails[5:] + pipes)
    assert ids(since="1d") == set(mails[5:] + pipes + reports[:5])
    assert ids(since=timedelta(hours=6)) == set(mails[5:] + pipes + reports[:5])
    assert ids(until="1d") == set(mails[:5])
    assert ids(since="4d", until="1h") == set(mails[:5] + reports[:5])
    at = datetime.now(timezone.utc) - timedelta(days=1)
    assert ids(until=at, task="rd_mail") == set(mails[:5])
    assert ids(until=at.isoformat(), queue="mail") == set(mails[:5])
    assert ids(task="rd_report", queue="mail") == set()
    assert ids(task="nobody") == set()
    # Not only dead runs: the filters apply to any status.
    assert {r.run_id for r in list_runs(engine, task="rd_report", status="pending")} == set(
        reports[5:])

    assert retry_runs(engine, task="rd_mail", since="1d") == 5
    assert statuses(engine, mails[5:]) == {"pending": 5}
    assert retry_runs(engine, queue="second") == 3
    assert statuses(engine, pipes) == {"pending": 6}
    assert retry_runs(engine, until="2h") == 10
    assert retry_runs(engine) == 0
    assert retry_runs(engine, task="nobody", queue="nowhere") == 0


def test_list_pages_with_before(engine: sa.Engine, db_url: str) -> None:
    runs = many(engine, report, 25)
    newest_first = runs[::-1]
    page = list_runs(engine, limit=10)
    assert [r.run_id for r in page] == newest_first[:10]
    page2 = list_runs(engine, limit=10, before=page[-1].run_id)
    assert [r.run_id for r in page2] == newest_first[10:20]

    data = cli_json(db_url, "list", "--limit", "10")
    assert [r["run_id"] for r in data["runs"]] == newest_first[:10]
    assert data["next_before"] == newest_first[9]
    data = cli_json(db_url, "list", "--limit", "10", "--before", str(data["next_before"]))
    assert [r["run_id"] for r in data["runs"]] == newest_first[10:20]
    data = cli_json(db_url, "list", "--limit", "10", "--before", str(data["next_before"]))
    assert [r["run_id"] for r in data["runs"]] == newest_first[20:]
    assert data["next_before"] is None
    data = cli_json(db_url, "list", "--limit", "5", "--before", str(newest_first[19]))
    assert [r["run_id"] for r in data["runs"]] == newest_first[20:]
    assert data["next_before"] is None  # exactly five were left: no next page

    code, out, _ = cli(db_url, "list", "--limit", "10", "--task", "rd_report")
    assert code == 0
    assert f"flowq runs list --before {newest_first[9]}" in out
    code, out, _ = cli(db_url, "list", "--limit", "30", "--task", "rd_report", "--since", "1h")
    assert code == 0 and "more:" not in out
    assert len([line for line in out.splitlines() if "  rd_report  " in line]) == 25
    code, out, _ = cli(db_url, "list", "--task", "rd_mail")
    assert code == 0 and out.startswith("no runs.")


def test_the_cli_retries_with_filters(engine: sa.Engine, db_url: str) -> None:
    mails = many(engine, mail, 6)
    reports = many(engine, report, 4)
    kill(engine, mails + reports)
    code, out, err = cli(db_url, "retry", "--status", "dead", "--task", "rd_report")
    assert (code, out.strip(), err) == (0, "retried 4 run(s).", said())
    assert cli_json(db_url, "retry", "--status", "dead", "--queue", "mail", "--limit", "2") == {
        "retried": 2}
    assert cli_json(db_url, "retry", "--status", "dead", "--since", "2024-01-01T00:00:00Z",
                    "--until", "1w") == {"retried": 0}
    assert cli_json(db_url, "retry", "--status", "dead", "--since", "1h") == {"retried": 4}
    assert statuses(engine, mails + reports) == {"pending": 10}


def test_nothing_matching_says_zero_and_exits_zero(engine: sa.Engine, db_url: str) -> None:
    assert cli(db_url, "retry", "--status", "dead") == (0, "retried 0 run(s).\n", said())
    kill(engine, many(engine, mail, 2), ago=timedelta(hours=1))
    for filters in (["--task", "nobody"], ["--queue", "nowhere"], ["--since", "30m"],
                    ["--until", "2000-01-01"], ["--task", "rd_report", "--queue", "mail"]):
        assert cli(db_url, "retry", "--status", "dead", *filters) == (
            0, "retried 0 run(s).\n", said()), filters
    assert cli(db_url, "retry", "--status", "dead")[1] == "retried 2 run(s).\n"


def test_a_run_that_stops_being_dead_meanwhile_is_skipped(engine: sa.Engine) -> None:
    dead = many(engine, mail, 3)
    kill(engine, dead)
    result: list[int] = []
    with engine.connect() as other:
        with other.begin():
            # Holds run dead[1]'s row while the redrive picks its batch, then cancels it.
            other.execute(sa.text("SELECT id FROM flowq.job_history WHERE run_id = :r "
                                  "FOR UPDATE"), {"r": dead[1]})
            redrive = threading.Thread(target=lambda: result.append(retry_runs(engine)))
            redrive.start()
            wait_until(lambda: scalar(
                engine, "SELECT count(*) FROM pg_stat_activity WHERE datname = "
                        "current_database() AND wait_event_type = 'Lock'") > 0,
                message="the redrive to wait for the row lock")
            other.execute(sa.text("UPDATE flowq.job_history SET status = 'cancelled' "
                                  "WHERE run_id = :r"), {"r": dead[1]})
        redrive.join(30)
    assert result == [2]
    assert statuses(engine, [dead[1]]) == {"cancelled": 1}
    assert statuses(engine, [dead[0], dead[2]]) == {"pending": 2}


def test_a_connection_in_a_transaction_is_joined(engine: sa.Engine) -> None:
    dead = many(engine, mail, 7)
    kill(engine, dead)
    with engine.connect() as conn:
        conn.begin()
        assert retry_runs(conn, batch_size=2) == 7
        conn.rollback()
    assert statuses(engine, dead) == {"dead": 7}
    with engine.connect() as conn:  # no transaction of the caller's: each batch committed
        assert retry_runs(conn, batch_size=2) == 7
    assert statuses(engine, dead) == {"pending": 7}


def test_waiting_steps_and_workflows_are_retried_like_retry_run(engine: sa.Engine) -> None:
    """A dead step whose signal never came waits again, for its timeout (as `retry_run`)."""
    with engine.begin() as conn:
        run = flowq.enqueue(conn, report, n=1)
        conn.execute(sa.text(
            "INSERT INTO flowq.signals (run_id, name, step, timeout_s, reached_at) "
            "VALUES (:r, 'go', 'rd_report', 60, now())"), {"r": run.id})
    kill(engine, [run.id])
    assert retry_runs(engine) == 1
    [row] = job_rows(engine)
    assert row.status == "waiting"
    assert scalar(engine, "SELECT run_at > now() + interval '50 seconds' FROM flowq.steps")


# -- bad input ----------------------------------------------------------------------------------


def test_parse_when() -> None:
    assert parse_when("90s") == timedelta(seconds=90)
    assert parse_when("1h30m") == timedelta(minutes=90)
    assert parse_when(" 2d ") == timedelta(days=2)
    assert parse_when("1w") == timedelta(weeks=1)
    assert parse_when("1.5h") == timedelta(minutes=90)
    assert parse_when("2024-05-01T10:00:00Z") == datetime(2024, 5, 1, 10, tzinfo=timezone.utc)
    assert parse_when("2024-05-01T10:00+02:00") == datetime(
        2024, 5, 1, 8, tzinfo=timezone.utc)
    local = parse_when("2024-05-01")
    assert isinstance(local, datetime) and local.tzinfo is not None  # local time
    for bad in ("yesterday", "", "-1h", "1y", "5", "2024-13-01"):
        with pytest.raises(flowq.InvalidArgumentsError, match="cannot read"):
            parse_when(bad)


@pytest.mark.parametrize(("args", "message"), [
    (["--since", "yesterday"], "cannot read 'yesterday' as a time"),
    (["--until", "1y"], "cannot read '1y' as a time"),
    (["--since", "1h", "--until", "2h"], "is not before until"),
    (["--queue", "bad queue!"], "queue name 'bad queue!' is not valid"),
    (["--task", "no spaces"], "task name 'no spaces' is not valid"),
    (["--limit", "0"], "0 is not in the range x>=1"),
    (["--batch-size", "0"], "0 is not in the range"),
])
def test_bad_filters_are_clear_errors(db_url: str, args: list[str], message: str) -> None:
    code, out, err = cli(db_url, "retry", "--status", "dead", *args)
    assert code == 2 and out == ""
    assert message in err
    assert "Traceback" not in err


def test_run_id_or_status_exactly_one(db_url: str) -> None:
    for args, message in (([], "give a RUN_ID, or --status dead"),
                          (["5", "--status", "dead"], "not both"),
                          (["5", "--task", "x"], "--task filter(s) the runs of --status dead"),
                          (["--status", "pending"], "'pending' is not 'dead'")):
        code, out, err = cli(db_url, "retry", *args)
        assert code == 2 and out == "", args
        assert message in err, (args, err)
    code, _, err = cli(db_url, "list", "--since", "soon")
    assert code == 2 and "cannot read 'soon' as a time" in err
    code, _, err = cli(db_url, "list", "--before", "0")
    assert code == 2


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"status": "pending"}, "only dead runs can be retried"),
    ({"limit": 0}, "limit must be an integer of at least 1"),
    ({"batch_size": 0}, "batch_size must be an integer of at least 1"),
    ({"since": datetime(2024, 1, 1)}, "since must be a timezone-aware datetime"),
    ({"since": timedelta(hours=-1)}, "since must be a duration ago of at least 0"),
    ({"until": 5}, "until must be a datetime, a timedelta or text"),
    ({"queue": ""}, "queue name '' is not valid"),
    ({"task": "a b"}, "task name 'a b' is not valid"),
    ({"since": "1h", "until": "1d"}, "is not before until"),
])
def test_bad_filters_in_the_api(engine: sa.Engine, kwargs: dict[str, Any],
                                message: str) -> None:
    with pytest.raises(flowq.FlowqError, match=message):
        retry_runs(engine, **kwargs)


def test_bad_list_filters_in_the_api(engine: sa.Engine) -> None:
    with pytest.raises(flowq.InvalidArgumentsError, match="status must be one of"):
        list_runs(engine, status="zombie")  # type: ignore[arg-type]
    with pytest.raises(flowq.InvalidArgumentsError, match="before"):
        list_runs(engine, before=0)


def test_a_bulk_retry_reports_each_batch(engine: sa.Engine) -> None:
    kill(engine, many(engine, mail, 5))
    totals: list[int] = []
    assert retry_runs(engine, batch_size=2, on_batch=totals.append) == 5
    assert totals == [2, 4, 5]
