"""The worker fault suite, for workflows: DAG joins, maps, signals and run control, run by
real `flowq worker` processes (and one race played step by step on two connections).

The pipelines are in tests/apps/workflow_fault_app.py. Their steps write a ledger row through
`ctx.session`, which commits with the step's success and with what that success does to the
graph (create a child, count towards a join, create a map's instances), or not at all. So
whatever happens to the workers, the end is checked the same way: every step of every run
exists once (`flowq.jobs` holds one row per (run_id, step), one per map index for a mapped
step), has one ledger row written by the attempt the row records, and a join received its
parents' results, exactly those the ledger says they produced.

Time is never asserted; tests wait on conditions with generous deadlines, with short poll,
heartbeat and reap intervals to stay fast.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import pytest
import sqlalchemy as sa
import workflow_fault_app as wfa
from click.testing import CliRunner
from support import (
    Row,
    Spawn,
    WorkerProcess,
    backends,
    held_by,
    held_when_killed,
    scalar,
    stop_workers,
)
from support import rows as query
from support import spawn_ready as spawn_workers

import flowq
from flowq.cli import main
from flowq.db.runner import runner
from flowq.db.schema import JOIN_SHARDS
from flowq.db.store import Store
from flowq.ops.runs import cancel_run, get_run, retry_run
from flowq.testing import job_rows, wait_until
from flowq.testing.draining import run_claimed

APP = "workflow_fault_app:app"
FAST = ["--poll-interval", "0.1", "--stale-after", "2", "--heartbeat-interval", "0.5",
        "--reap-interval", "0.5"]
# Where no worker is killed: a busy machine's late heartbeat must not cost a step an attempt
# (attempts are asserted exactly), while waits still expire soon after their timeout.
STEADY = ["--poll-interval", "0.1", "--stale-after", "30", "--heartbeat-interval", "1",
          "--reap-interval", "0.3"]
DIAMOND = ("start", "left", "right", "join")
RACING = 100  # runs signalled while they go on, in the signals test, started this far apart
RACING_GAP = 0.02


# -- helpers ----------------------------------------------------------------------------------

def switch(engine: sa.Engine, name: str) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO workflow_switches (name) VALUES (:n)"), {"n": name})


def spawn_ready(spawn_worker: Spawn, engine: sa.Engine, url: str, n: int, *args: str
                ) -> list[WorkerProcess]:
    """Start `n` workers and wait until each is up (listening)."""
    return spawn_workers(spawn_worker, engine, APP, url, n, *args)


def describe_rows(rows: Iterable[Row]) -> list[str]:
    return [f"job {r.id} run {r.run_id} {r.step}#{r.step_index}[{r.map_index}] {r.status} "
            f"attempts={r.attempts} locked_by={r.locked_by} run_at={r.run_at} "
            f"error={(r.last_error or '').splitlines()[:1]}" for r in rows]


def wait_finished(engine: sa.Engine, run_ids: Sequence[int], *, leaf: str,
                  timeout: float) -> None:
    """Wait until every run in `run_ids` has its `leaf` step succeeded and nothing pending,
    running or waiting. AssertionError at once if a step ended dead or cancelled, or with the
    unfinished steps at the deadline."""
    ids = list(run_ids)

    def done() -> bool:
        bad = job_rows(engine, where="run_id = ANY(:ids) AND status IN ('dead', 'cancelled')",
                       ids=ids)
        assert not bad, f"steps ended unsuccessfully: {describe_rows(bad)[:20]}"
        left, leaves = query(engine, """
            SELECT count(*) FILTER (WHERE status IN ('pending', 'running', 'waiting')),
                   count(*) FILTER (WHERE step = :leaf AND status = 'succeeded')
              FROM flowq.steps WHERE run_id = ANY(:ids)""", ids=ids, leaf=leaf)[0]
        return left == 0 and leaves == len(ids)

    try:
        wait_until(done, timeout=timeout, interval=0.2, message=f"{len(ids)} runs to end")
    except AssertionError as exc:
        if "timed out" not in str(exc):
            raise
        rest = job_rows(engine, where="run_id = ANY(:ids) AND status IN "
                                      "('pending', 'running', 'waiting')", ids=ids)
        raise AssertionError(f"{exc}; {len(rest)} unfinished steps: "
                             f"{describe_rows(rest)[:20]}") from None


def ledger_by_step(engine: sa.Engine, run_ids: Sequence[int]
                   ) -> dict[tuple[int, str], list[Row]]:
    entries: dict[tuple[int, str], list[Row]] = defaultdict(list)
    for e in query(engine, "SELECT * FROM workflow_ledger WHERE run_id = ANY(:ids) ORDER BY id",
                   ids=list(run_ids)):
        entries[e.run_id, e.step].append(e)
    return entries


def assert_diamonds_exact(engine: sa.Engine, run_ids: Sequence[int], ns: Sequence[int], *,
                          ledgered: Sequence[str] = DIAMOND) -> dict[tuple[int, str], Row]:
    """Every run (its `n` in `ns`) succeeded with its four steps once each; each step in
    `ledgered` has exactly one ledger row, written by the attempt the row records; the join
    received exactly its parents' results and added them up. Returns the rows by (run, step)."""
    ids = list(run_ids)
    jobs: dict[tuple[int, str], list[Row]] = defaultdict(list)
    for j in job_rows(engine, where="run_id = ANY(:ids)", ids=ids):
        jobs[j.run_id, j.step].append(j)
    entries = ledger_by_step(engine, ids)
    wrong: list[str] = []
    for run_id, n in zip(ids, ns, strict=True):
        rows = {step: jobs.get((run_id, step), []) for step in DIAMOND}
        if any(len(r) != 1 or r[0].status != "succeeded" for r in rows.values()):
            wrong.append(f"run {run_id}: steps {describe_rows(r for rs in rows.values() for r in rs)}")
            continue
        one = {step: r[0] for step, r in rows.items()}
        for step in ledgered:
            found = entries.get((run_id, step), [])
            j = one[step]
            if len(found) != 1:
                wrong.append(f"run {run_id}: step {step} (job {j.id}, attempts {j.attempts}) "
                             f"has {len(found)} ledger rows: {found}")
            elif (found[0].job_id, found[0].attempt) != (j.id, j.attempts):
                wrong.append(f"run {run_id}: ledger row {found[0]} is not the attempt of job "
                             f"{j.id} that succeeded ({j.attempts})")
        left, right, join = one["left"].result, one["right"].result, one["join"].result
        if (left["v"], right["v"], join["sum"], join["n"]) != (n + 1, n * 10, 11 * n + 1, n):
            wrong.append(f"run {run_id} (n={n}): left {left}, right {right}, join {join}")
        found = entries.get((run_id, "join"), [])
        j_entry = found[0] if len(found) == 1 else None
        if j_entry is None or j_entry.payload != {"left": left, "right": right}:
            wrong.append(f"run {run_id}: the join received {j_entry and j_entry.payload}, "
                         f"its parents returned {left} and {right}")
        for step in ("left", "right"):
            if step in ledgered and len(entries.get((run_id, step), [])) == 1:
                e = entries[run_id, step][0]
                if one[step].result["by"] != f"{step}:{e.job_id}:{e.attempt}:{e.pid}":
                    wrong.append(f"run {run_id}: {step}'s result {one[step].result} is not "
                                 f"from its committed attempt {e}")
    strays = [e for (run_id, step), found in entries.items() for e in found
              if step not in ledgered or run_id not in set(ids)]
    assert not wrong, f"{len(wrong)} problem(s): " + "\n".join(wrong[:20])
    assert not strays, f"unexpected ledger rows: {strays[:20]}"
    # The join counters: one per run, brought to zero once.
    counters = query(engine, "SELECT run_id, step, remaining, parents FROM flowq.joins "
                             "WHERE run_id = ANY(:ids)", ids=ids)
    assert sorted((c.run_id, c.step, c.remaining, c.parents) for c in counters) == \
        sorted((r, "join", 0, 2) for r in ids)
    return {key: rows[0] for key, rows in jobs.items()}


def assert_one_row_per_step(engine: sa.Engine, run_ids: Sequence[int]) -> None:
    """flowq.jobs holds no (run_id, step) twice, map instances apart (one per map_index)."""
    twice = query(engine, """
        SELECT run_id, step, map_index, count(*) FROM flowq.steps WHERE run_id = ANY(:ids)
         GROUP BY run_id, step, map_index HAVING count(*) > 1""", ids=list(run_ids))
    assert not twice, f"steps created more than once: {twice[:20]}"


def run_statuses(engine: sa.Engine, run_ids: Iterable[int]) -> dict[int, str]:
    """Each run's status, as `flowq.ops.runs.get_run` derives it."""
    return {r: get_run(engine, r).status for r in run_ids}


def cli(db_url: str, *args: str) -> dict[str, Any]:
    """`flowq ARGS --json`, in-process; its parsed output."""
    out = CliRunner().invoke(main, [*args, "--json", "--database-url", db_url])
    assert out.exit_code == 0, (out.output, out.exception)
    result: dict[str, Any] = json.loads(out.stdout)
    return result


# -- 1. diamonds under a SIGKILL --------------------------------------------------------------

@pytest.mark.slow
def test_sigkill_mid_diamonds_every_join_once(ledger: sa.Engine, db_url: str,
                                              spawn_worker: Spawn) -> None:
    """1,000 diamond runs over two workers; one of them is killed (SIGKILL) while it holds
    steps of at least two kinds, past a random point of progress, and a replacement starts.
    Every run succeeds with each of its four steps once, once in the ledger, and every join
    received both parents' committed results."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    runs = 1000
    workers = spawn_ready(spawn_worker, ledger, db_url, 2, "--concurrency", "8", *FAST)
    ns = list(range(runs))
    with ledger.begin() as conn:
        run_ids = flowq.enqueue_many(conn, wfa.diamond, [{"n": n, "sleep": 0.04} for n in ns])
    progress = int(4 * runs * rng.uniform(0.2, 0.5))
    victim = rng.choice(workers)

    def mid_run() -> list[Row]:
        if scalar(ledger, "SELECT count(*) FROM flowq.steps WHERE status = 'succeeded'") \
                < progress:
            return []
        held = held_by(ledger, victim.pid)
        return held if len({r.step for r in held}) >= 2 else []

    wait_until(mid_run, timeout=120, interval=0.02,
               message=f"the victim holding two kinds of steps past {progress} (seed {seed})")
    victim.signal(signal.SIGKILL)
    victim.wait()
    killed = {r.id: r for r in held_when_killed(ledger, victim.pid)}
    workers.remove(victim)
    workers.append(spawn_worker(APP, db_url, "--concurrency", "8", *FAST))

    wait_finished(ledger, run_ids, leaf="join", timeout=240)
    assert_one_row_per_step(ledger, run_ids)
    rows = assert_diamonds_exact(ledger, run_ids, ns)
    assert set(run_statuses(ledger, run_ids).values()) == {"succeeded"}
    assert killed, f"no step was held by the killed worker (seed {seed})"
    by_id = {j.id: j for j in rows.values()}
    for job_id in killed:
        j = by_id[job_id]
        assert j.attempts >= 2 and j.last_error.startswith("WorkerLost:"), (seed, j)
        (e,) = ledger_by_step(ledger, [j.run_id])[j.run_id, j.step]
        assert e.pid != victim.pid, (seed, e)
    sample = rng.sample(run_ids, 5)
    for run_id in sample:
        info = get_run(ledger, run_id)
        n = ns[run_ids.index(run_id)]
        assert info.status == "succeeded" and info.result["sum"] == 11 * n + 1, info
    stop_workers(*workers)


# -- 2. a map of 10,000 items -----------------------------------------------------------------

def assert_map_exact(engine: sa.Engine, run_id: int, count: int, *, sleep: float = 0.0,
                     session: bool = False) -> list[Row]:
    """The run of `wf_fan` over `count` items succeeded: `split` and `total` once each (once
    in the ledger), one `work` instance per item (each once in the ledger, with the attempt
    that succeeded, when the instances write through ctx.session), and `total` received the
    instances' results in item order. Returns the instances, by item."""
    values = [wfa.item_value(i) for i in range(count)]
    expected = {"count": count, "sum": sum(values),
                "weighted": sum(k * v for k, v in enumerate(values)), "in_order": True,
                "head": values[:3], "tail": values[-3:]}
    assert_one_row_per_step(engine, [run_id])
    by_step: dict[str, list[Row]] = defaultdict(list)
    for r in job_rows(engine, where="run_id = :r", r=run_id):
        by_step[r.step].append(r)
    assert sorted(by_step) == ["split", "total", "work"]
    assert len(by_step["split"]) == 1 and len(by_step["total"]) == 1
    (total,) = by_step["total"]
    assert total.status == "succeeded" and total.result == expected, total.result
    assert total.joined and total.map_index is None
    instances = sorted(by_step["work"], key=lambda r: r.map_index)
    assert [r.map_index for r in instances] == list(range(count))
    assert all(r.status == "succeeded" for r in instances)
    assert [r.result for r in instances] == values
    item = {**({"sleep": sleep} if sleep else {}), **({"session": True} if session else {})}
    assert all(r.args == {"i": r.map_index, **item} for r in instances)
    # The steps that write the ledger did once; the join counter went to zero once.
    entries = ledger_by_step(engine, [run_id])
    assert sorted((step, len(e)) for (_, step), e in entries.items()) == \
        [("split", 1), ("total", 1)] + ([("work", count)] if session else [])
    if session:
        done = {(e.job_id, e.attempt, e.payload["i"]) for e in entries[run_id, "work"]}
        assert done == {(r.id, r.attempts, r.map_index) for r in instances}
    assert entries[run_id, "total"][0].payload == expected
    assert query(engine, "SELECT step, remaining, parents FROM flowq.joins WHERE run_id = :r",
                 r=run_id) == [("total", 0, 1)]
    info = get_run(engine, run_id)
    assert info.status == "succeeded" and info.result == expected
    group = {g.step: g for g in info.graph}
    assert group["work"].instances == count and group["work"].counts == {"succeeded": count}
    return instances


@pytest.mark.slow
def test_map_of_ten_thousand_items_joins_in_item_order(ledger: sa.Engine, db_url: str,
                                                       spawn_worker: Spawn) -> None:
    """`split` maps `work` over 10,000 items, one of which fails its first attempt; `total`
    runs once, after all of them, with their 10,000 results in item order. The instances
    do not use ctx.session, so their completions (and their counts towards `total`) are
    batched by the completer."""
    count = 10_000
    workers = spawn_ready(spawn_worker, ledger, db_url, 2, "--concurrency", "16",
                          "--no-job-log", *STEADY)
    with ledger.begin() as conn:
        run_id = flowq.enqueue(conn, wfa.fan, n=count).id
    wait_finished(ledger, [run_id], leaf="total", timeout=240)
    instances = assert_map_exact(ledger, run_id, count)
    flaky = instances[wfa.FLAKY_ITEM]
    assert flaky.attempts == 2 and "fails its first attempt" in flaky.last_error, flaky
    others = [r for r in instances if r.map_index != wfa.FLAKY_ITEM and r.attempts != 1]
    assert not others, describe_rows(others[:10])
    assert {g.step: g for g in get_run(ledger, run_id).graph}["work"].attempts == count + 1
    stop_workers(*workers)


@pytest.mark.parametrize("victim_holds", ["the mapping step", "instances",
                                          "session instances"])
def test_sigkill_mid_map_creates_and_counts_each_instance_once(
        ledger: sa.Engine, db_url: str, spawn_worker: Spawn, victim_holds: str) -> None:
    """A worker is killed holding either `split` inside its open transaction (its ledger
    row written, its 3,000 instances not yet created), or map instances a third of the way
    or more through the map (plain ones, whose completions the completer batches, or ones
    that write through ctx.session, each committed with its own count on its shard of the
    join, `flowq.join_shards`); a replacement starts. What the victim held runs again, the
    instances are created once, and `total` is created once, after every instance counted
    exactly once."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    count = 3000
    workers = spawn_ready(spawn_worker, ledger, db_url, 2, "--concurrency", "8",
                          "--no-job-log", *FAST)
    hold = 30.0 if victim_holds == "the mapping step" else 0.0  # its first attempt only
    session = victim_holds == "session instances"
    with ledger.begin() as conn:
        run_id = flowq.enqueue(conn, wfa.fan, n=count, sleep=0.01, hold=hold,
                               session=session).id

    if victim_holds == "the mapping step":
        def holding() -> Any:
            for w in workers:
                held = [r for r in held_by(ledger, w.pid) if r.step == "split"]
                if held and backends(ledger, "session", pid=w.pid, state="idle in transaction"):
                    return w
            return None

        victim = wait_until(holding, timeout=60, message="split inside its transaction")
    else:
        progress = int(count * rng.uniform(0.3, 0.6))
        victim = rng.choice(workers)

        def mid_map() -> list[Row]:
            if scalar(ledger, "SELECT count(*) FROM flowq.steps WHERE step = 'work' AND "
                              "status = 'succeeded'") < progress:
                return []
            return [r for r in held_by(ledger, victim.pid) if r.step == "work"]

        wait_until(mid_map, timeout=120, interval=0.02,
                   message=f"the victim holding instances past {progress} (seed {seed})")
    victim.signal(signal.SIGKILL)
    victim.wait()
    killed = {r.id for r in held_when_killed(ledger, victim.pid)}
    workers.remove(victim)
    workers.append(spawn_worker(APP, db_url, "--concurrency", "8", "--no-job-log", *FAST))

    wait_finished(ledger, [run_id], leaf="total", timeout=180)
    assert_map_exact(ledger, run_id, count, sleep=0.01, session=session)
    assert scalar(ledger, "SELECT count(*) FROM flowq.join_shards WHERE run_id = :r "
                          "AND remaining = 0", r=run_id) == JOIN_SHARDS
    assert killed, f"nothing was held by the killed worker (seed {seed})"
    rows = {r.id: r for r in job_rows(ledger, where="run_id = :r", r=run_id)}
    for job_id in killed:
        r = rows[job_id]
        assert r.attempts >= 2 and r.last_error.startswith("WorkerLost:"), (seed, r)
    if victim_holds == "the mapping step":
        (split,) = (r for r in rows.values() if r.step == "split")
        assert split.id in killed and split.attempts >= 2
        (e,) = ledger_by_step(ledger, [run_id])[run_id, "split"]
        assert e.attempt == split.attempts and e.pid != victim.pid, (e, split)
    stop_workers(*workers)


# -- 3. signals across processes --------------------------------------------------------------

def test_signals_across_processes(ledger: sa.Engine, db_url: str,
                                  spawn_worker: Spawn) -> None:
    """Signals sent by this process to steps run by two worker processes:
    - committed before the step is reached (`early`), or after it waits (`late`), or at
      any moment while its run goes on (`RACING` runs): delivered once, the handler got
      the payload;
    - sent in a transaction that rolls back, before (`rb_early`) or after (`rb_late`) the
      step is reached: never delivered, the step stays `waiting` (and a later committed
      signal still gets through);
    - never sent, with a 1 s `wait_timeout` (`hasty`): the step ends dead with SignalTimeout,
      its handler never ran."""
    with ledger.begin() as conn:
        early, rb_early, late, rb_late = (
            flowq.enqueue(conn, wfa.approval, doc=name).id
            for name in ("early", "rb_early", "late", "rb_late"))
        hasty = flowq.enqueue(conn, wfa.hasty, doc="hasty").id
        # Due one after the other, each held a little: while later runs start, earlier ones
        # are in `request` or waiting in `publish`.
        racing = [flowq.enqueue(conn, wfa.approval, doc=f"racing-{i}", hold=0.02,
                                delay=RACING_GAP * i).id for i in range(RACING)]
        enqueued = time.monotonic()
    payloads: dict[int, Any] = {early: {"by": "ann", "n": 1}, late: {"by": "bob", "n": 2}}
    payloads.update({r: {"by": "racer", "run": r} for r in racing})

    with ledger.begin() as conn:
        sent = flowq.signal(conn, early, "approval", payloads[early])
    assert (sent.created, sent.delivered) == (True, False)  # kept until the step is reached
    with ledger.connect() as conn:
        assert flowq.signal(conn, rb_early, "approval", {"by": "nobody"}).created
        conn.rollback()

    with ledger.begin() as conn:  # the same payload again is ignored, another one refused
        assert not flowq.signal(conn, early, "approval", payloads[early]).created
    with ledger.begin() as conn, pytest.raises(flowq.SignalError, match="already sent"):
        flowq.signal(conn, early, "approval", {"by": "someone else"})

    workers = spawn_ready(spawn_worker, ledger, db_url, 2, "--concurrency", "8", *STEADY)
    rng = random.Random()
    for i, run_id in enumerate(racing):  # about when its `request` runs: before, during, after
        due = enqueued + RACING_GAP * i + rng.uniform(-0.02, 0.06)
        time.sleep(max(0.0, due - time.monotonic()))
        with ledger.begin() as conn:
            assert flowq.signal(conn, run_id, "approval", payloads[run_id]).created

    def waiting(run_id: int) -> bool:
        return bool(query(ledger, "SELECT 1 FROM flowq.steps WHERE run_id = :r AND step = "
                                  "'publish' AND status = 'waiting'", r=run_id))

    wait_until(lambda: waiting(late) and waiting(rb_late), timeout=60,
               message="`publish` of late and rb_late waiting")
    with ledger.connect() as conn:
        assert flowq.signal(conn, rb_late, "approval", {"by": "nobody"}).delivered
        conn.rollback()
    with ledger.begin() as conn:
        sent = flowq.signal(conn, late, "approval", payloads[late])
    assert (sent.created, sent.delivered) == (True, True)

    delivered = [early, late, *racing]
    wait_finished(ledger, delivered, leaf="publish", timeout=120)
    wait_until(lambda: query(ledger, "SELECT status FROM flowq.steps WHERE run_id = :r AND "
                                     "step = 'hurry'", r=hasty) == [("dead",)],
               timeout=60, message="`hurry` to time out")
    # A run that finished takes no signal, not even the same one again.
    with ledger.begin() as conn, pytest.raises(flowq.RunStateError, match="finished"):
        flowq.signal(conn, late, "approval", payloads[late])

    # Delivered once, with the payload, to the attempt that the row records.
    entries = ledger_by_step(ledger, [*delivered, rb_early, rb_late, hasty])
    for run_id in delivered:
        (row,) = job_rows(ledger, where="run_id = :r AND step = 'publish'", r=run_id)
        found = entries.get((run_id, "publish"), [])
        assert len(found) == 1, (run_id, found)
        assert found[0].payload["approval"] == payloads[run_id], found
        assert (found[0].job_id, found[0].attempt) == (row.id, row.attempts)
        assert row.result["approval"] == payloads[run_id] and row.attempts == 1, row
        assert len(entries[run_id, "request"]) == 1
    assert_one_row_per_step(ledger, [*delivered, rb_early, rb_late, hasty])
    before_reached = scalar(ledger, "SELECT count(*) FROM flowq.signals WHERE run_id = "
                                    "ANY(:ids) AND sent_at < reached_at", ids=racing)
    print(f"racing signals sent before their step was reached: {before_reached}/{RACING}")

    # The timed-out step: dead, SignalTimeout, its handler never ran; the run is dead.
    (hurry,) = job_rows(ledger, where="run_id = :r AND step = 'hurry'", r=hasty)
    assert hurry.status == "dead" and hurry.attempts == 1, hurry
    assert "SignalTimeout" in hurry.last_error, hurry.last_error
    assert (hasty, "hurry") not in entries and len(entries[hasty, "ask"]) == 1
    assert get_run(ledger, hasty).status == "dead"

    # The rolled-back signals were never delivered: still waiting, no payload anywhere,
    # several reaper passes after the timeout of `hurry` was noticed.
    for run_id in (rb_early, rb_late):
        assert waiting(run_id), job_rows(ledger, where="run_id = :r", r=run_id)
        (row,) = job_rows(ledger, where="run_id = :r AND step = 'publish'", r=run_id)
        assert "approval" not in row.args and row.attempts == 0, row
        assert (run_id, "publish") not in entries
        assert query(ledger, "SELECT payload, sent_at FROM flowq.signals WHERE run_id = :r",
                     r=run_id) == [(None, None)]
        assert get_run(ledger, run_id).status == "waiting"
    # A committed signal still gets through after a rolled-back one.
    for run_id in (rb_early, rb_late):
        with ledger.begin() as conn:
            assert flowq.signal(conn, run_id, "approval", {"by": "finally"}).delivered
    wait_finished(ledger, [rb_early, rb_late], leaf="publish", timeout=60)
    entries = ledger_by_step(ledger, [rb_early, rb_late])
    for run_id in (rb_early, rb_late):
        (e,) = entries[run_id, "publish"]
        assert e.payload["approval"] == {"by": "finally"}
    stop_workers(*workers)


# -- 4. retry and cancel of half-finished DAGs ------------------------------------------------

def test_retry_runs_only_the_dead_branch_then_the_join_once(ledger: sa.Engine, db_url: str,
                                                            spawn_worker: Spawn) -> None:
    """`right` dies (two attempts) while `left` succeeds: the run is dead, its join counter
    waits for one parent. Once fixed, a retry (by the CLI for one run, `retry_run` for the
    others) runs `right` again and nothing else; the join runs once with both results."""
    ns = list(range(6))
    with ledger.begin() as conn:
        run_ids = flowq.enqueue_many(conn, wfa.fixable, [{"n": n} for n in ns])
    workers = spawn_ready(spawn_worker, ledger, db_url, 2, "--concurrency", "4", *STEADY)

    def all_dead() -> bool:
        return set(run_statuses(ledger, run_ids).values()) == {"dead"}

    wait_until(all_dead, timeout=60, interval=0.2, message="every run to die")
    before = {(j.run_id, j.step): j for j in job_rows(ledger, where="run_id = ANY(:ids)",
                                                      ids=run_ids)}
    for run_id in run_ids:
        assert {s: before[run_id, s].status for s in ("start", "left", "right")} == \
            {"start": "succeeded", "left": "succeeded", "right": "dead"}
        assert (run_id, "join") not in before
        assert before[run_id, "right"].attempts == 2
        assert "not fixed yet (attempt 2)" in before[run_id, "right"].last_error
    assert sorted(query(ledger, "SELECT run_id, remaining FROM flowq.joins "
                                "WHERE run_id = ANY(:ids)", ids=run_ids)) == \
        sorted((r, 1) for r in run_ids)
    with pytest.raises(flowq.RunStateError):
        cancel_run(ledger, run_ids[0])

    switch(ledger, "fixed")
    out = cli(db_url, "runs", "retry", str(run_ids[0]))
    assert out["retried_job_ids"] == [before[run_ids[0], "right"].id], out
    for run_id in run_ids[1:]:
        res = retry_run(ledger, run_id)
        assert res.job_ids == (before[run_id, "right"].id,) and res.step == "right"
    wait_finished(ledger, run_ids, leaf="join", timeout=60)

    assert_one_row_per_step(ledger, run_ids)
    rows = assert_diamonds_exact(ledger, run_ids, ns)
    for run_id in run_ids:
        for step in ("start", "left"):  # kept, not re-run
            assert rows[run_id, step].attempts == 1
            assert rows[run_id, step].finished_at == before[run_id, step].finished_at
        assert rows[run_id, "right"].attempts == 1  # a fresh budget
        assert rows[run_id, "join"].attempts == 1
        info = get_run(ledger, run_id)
        assert info.status == "succeeded", info
    with pytest.raises(flowq.RunStateError):
        retry_run(ledger, run_ids[0])
    stop_workers(*workers)


def test_cancel_with_a_waiting_and_a_running_branch(ledger: sa.Engine, db_url: str,
                                                    spawn_worker: Spawn) -> None:
    """Cancelled while `hold` waits for its signal and `slow` runs: `hold` ends cancelled at
    once; `slow` finishes (its ledger row commits) but creates and counts nothing, so the
    join is never created; the run stays cancelled and refuses signals and retries."""
    ns = list(range(3))
    with ledger.begin() as conn:
        run_ids = flowq.enqueue_many(conn, wfa.gated, [{"n": n} for n in ns])
    workers = spawn_ready(spawn_worker, ledger, db_url, 1, "--concurrency", "4", *STEADY)

    def in_place() -> bool:
        rows = {(j.run_id, j.step): j.status for j in job_rows(
            ledger, where="run_id = ANY(:ids)", ids=run_ids)}
        return all(rows.get((r, "hold")) == "waiting" and rows.get((r, "slow")) == "running"
                   for r in run_ids)

    wait_until(in_place, timeout=60, message="hold waiting and slow running in every run")
    jobs = {(j.run_id, j.step): j for j in job_rows(ledger, where="run_id = ANY(:ids)",
                                                    ids=run_ids)}
    out = cli(db_url, "runs", "cancel", str(run_ids[0]))
    assert out["cancelled_job_ids"] == [jobs[run_ids[0], "hold"].id], out
    assert out["cancel_requested_job_ids"] == [jobs[run_ids[0], "slow"].id], out
    for run_id in run_ids[1:]:
        res = cancel_run(ledger, run_id)
        assert res.cancelled == (jobs[run_id, "hold"].id,)
        assert res.cancel_requested == (jobs[run_id, "slow"].id,)
        assert res.run.status == "cancelled"
    for run_id in run_ids:
        with ledger.begin() as conn, pytest.raises(flowq.RunStateError, match="cancelled"):
            flowq.signal(conn, run_id, "go", {"late": True})
        switch(ledger, f"release:{run_id}")

    wait_until(lambda: not job_rows(ledger, where="run_id = ANY(:ids) AND status IN "
                                                  "('pending', 'running', 'waiting')",
                                    ids=run_ids),
               timeout=60, message="slow to finish")
    entries = ledger_by_step(ledger, run_ids)
    for run_id in run_ids:
        rows = {j.step: j for j in job_rows(ledger, where="run_id = :r", r=run_id)}
        assert sorted(rows) == ["hold", "slow", "start"], describe_rows(rows.values())
        assert rows["hold"].status == "cancelled" and rows["hold"].attempts == 0
        assert rows["slow"].status == "succeeded" and rows["slow"].cancel_requested
        assert sorted((step, len(e)) for (r, step), e in entries.items() if r == run_id) == \
            [("slow", 1), ("start", 1)]
        # The join's counter was never touched: `hold` never ran, `slow` counted nothing.
        assert query(ledger, "SELECT remaining FROM flowq.joins WHERE run_id = :r",
                     r=run_id) == []
        info = get_run(ledger, run_id)
        assert info.status == "cancelled" and info.finished_at is not None, info
        with pytest.raises(flowq.RunStateError):
            retry_run(ledger, run_id)
        assert cancel_run(ledger, run_id).changed is False
    stop_workers(*workers)


# -- 5. two parents of a join completing at the same instant ----------------------------------

@pytest.mark.parametrize("first", ["left", "right"])
def test_join_created_once_when_parents_complete_concurrently(ledger: sa.Engine,
                                                              first: str) -> None:
    """Played step by step, without processes: both parents are claimed, then each completes
    on its own connection with the worker's statements. The first completion's transaction
    stays open while the second one's statement runs (it must wait on the join counter),
    then both commit: the join exists exactly once, with both inputs."""
    with ledger.begin() as conn:
        run_id = flowq.enqueue(conn, wfa.race, n=7, sleep=0.0).id
    with ledger.begin() as conn:
        [start] = Store(runner(conn, direct=False)).claim("default", 1, "test:0:race")
        assert run_claimed(conn, wfa.app, start, True)[0] == "succeeded"
    with ledger.begin() as conn:
        claimed = {j.step: j for j in Store(runner(conn, direct=False)).claim(
            "default", 10, "test:0:race")}
    assert sorted(claimed) == ["left", "right"]
    second = "right" if first == "left" else "left"

    done: dict[str, Any] = {}
    with ledger.connect() as a, ledger.connect() as b:
        a.begin()
        assert run_claimed(a, wfa.app, claimed[first], True)[0] == "succeeded"
        b_pid = b.execute(sa.text("SELECT pg_backend_pid()")).scalar()
        b.commit()

        def complete_second() -> None:
            try:
                b.begin()
                done["status"] = run_claimed(b, wfa.app, claimed[second], True)[0]
                b.commit()
            except BaseException as exc:  # reported by the main thread
                done["error"] = exc

        t = threading.Thread(target=complete_second)
        t.start()
        try:
            wait_until(lambda: scalar(ledger, "SELECT wait_event_type FROM pg_stat_activity "
                                              "WHERE pid = :p", p=b_pid) == "Lock",
                       timeout=30, message="the second completion waiting on the first")
            assert "status" not in done
        finally:
            a.commit()
            t.join(timeout=30)
    assert not t.is_alive() and "error" not in done, done
    assert done["status"] == "succeeded"

    joins = job_rows(ledger, where="run_id = :r AND step = 'join'", r=run_id)
    assert len(joins) == 1 and joins[0].status == "pending" and joins[0].joined, joins
    parents = {j.step: j for j in job_rows(ledger, where="run_id = :r AND step <> 'join'",
                                           r=run_id)}
    assert joins[0].args == {"left": parents["left"].result, "right": parents["right"].result}
    assert query(ledger, "SELECT remaining FROM flowq.joins WHERE run_id = :r",
                 r=run_id) == [(0,)]
    with ledger.begin() as conn:
        job = Store(runner(conn, direct=False)).claim("default", 10, "test:0:race")
        assert [r.step for r in job] == ["join"]
        assert run_claimed(conn, wfa.app, job[0], True)[0] == "succeeded"
    rows = assert_diamonds_exact(ledger, [run_id], [7], ledgered=["join"])
    assert rows[run_id, "join"].result["sum"] == 78


def test_join_created_once_under_concurrent_workers(ledger: sa.Engine, db_url: str,
                                                    spawn_worker: Spawn) -> None:
    """Many diamonds whose two branches take the same time, on two workers of eight slots:
    both parents of a join often complete at the same instant, on the two workers or in one
    completion batch of one worker (the branches here do not use ctx.session, so the
    completer batches them). Every join is created exactly once, with both inputs."""
    runs = 400
    ns = list(range(runs))
    workers = spawn_ready(spawn_worker, ledger, db_url, 2, "--concurrency", "8", *STEADY)
    with ledger.begin() as conn:
        run_ids = flowq.enqueue_many(conn, wfa.race, [{"n": n, "sleep": 0.03} for n in ns])
    wait_finished(ledger, run_ids, leaf="join", timeout=180)
    assert_one_row_per_step(ledger, run_ids)
    rows = assert_diamonds_exact(ledger, run_ids, ns, ledgered=["join"])
    assert set(run_statuses(ledger, run_ids).values()) == {"succeeded"}
    # How close the parents came (for the record: not asserted, time is not).
    same_statement = sum(rows[r, "left"].finished_at == rows[r, "right"].finished_at
                         for r in run_ids)
    cross_worker = sum(rows[r, "left"].result["by"].split(":")[3]
                       != rows[r, "right"].result["by"].split(":")[3] for r in run_ids)
    print(f"parents completed in one statement: {same_statement}/{runs}, "
          f"on two workers: {cross_worker}/{runs}")
    stop_workers(*workers)
