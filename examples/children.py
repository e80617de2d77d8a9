"""Child runs: a step fans out into runs of its own and waits for them without a slot.

    .venv/bin/python examples/children.py [DATABASE_URL]

Without a URL argument it starts a throwaway embedded PostgreSQL (it never reads
FLOWQ_DATABASE_URL or DATABASE_URL: an example touches only the database it is given). It
migrates flowq's schema, publishes three albums with a one-slot worker in a thread of this
process, and prints each run with its children.

What it shows (docs/durable.md, "Child runs"):
- `ctx.start_child(resize, ...)` once per photo: each child commits with a checkpoint of its
  own, so the parent's crash after starting them (once per album) starts none twice;
- `ctx.wait_all(children)`: the parent suspends without holding the worker's one slot, so
  that slot runs the children, and is woken when they finish, with their results in order;
- a broken photo: its child ends dead, and the parent's wait raises `flowq.ChildFailed`;
- cancelling an album's run cancels its unfinished children.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from tenacity import stop_after_attempt, wait_fixed

import flowq
import flowq.local.postgres
from flowq.db import create_engine
from flowq.durable.context import Context
from flowq.ops.runs import cancel_run, get_run, wait_run

app = flowq.FlowQ()
calls: Counter[str] = Counter()
crashed: set[int] = set()
lock = threading.Lock()


@app.task(retry=flowq.Retry(stop=stop_after_attempt(1)))
def resize(ctx: Context, photo: str) -> dict[str, str]:
    with lock:
        calls["resize"] += 1
    if photo.endswith(".broken"):
        raise ValueError(f"cannot decode {photo}")
    if photo.endswith(".huge"):  # look again in an hour, without spending an attempt
        raise flowq.Snooze(3600, reason="a huge photo waits for a bigger machine")
    return {"thumbnail": f"{photo}@320"}


@app.task(retry=flowq.Retry(stop=stop_after_attempt(2), wait=wait_fixed(0)))
def publish(ctx: Context, album: str, photos: list[str]) -> dict[str, Any]:
    """Resize every photo in a child run, then publish the album with their thumbnails."""
    children = [ctx.start_child(resize, photo=p) for p in photos]
    with lock:
        first_time = ctx.run_id not in crashed
        crashed.add(ctx.run_id)
    if first_time:
        raise RuntimeError("the worker crashed right after starting the children")
    results = ctx.wait_all(children)
    return {"album": album, "thumbnails": [r["thumbnail"] for r in results]}


def poll(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def main(url: str | None) -> int:
    with flowq.local.postgres.database(url) as db_url:
        engine = create_engine(db_url)
        flowq.migrate(engine)
        albums = {"summer": ["beach.jpg", "dunes.jpg", "sunset.jpg"],
                  "winter": ["snow.jpg", "ice.broken"],
                  "archive": ["scan-1.huge", "scan-2.huge"]}
        with engine.begin() as conn:
            runs = {name: flowq.enqueue(conn, publish, album=name, photos=photos).id
                    for name, photos in albums.items()}

        worker = flowq.Worker(app, db_url, flowq.WorkerConfig(concurrency=1,
                                                              poll_interval=0.2))
        with worker.running():  # one slot: parents wait without it, children use it
            done = [wait_run(engine, runs[a], timeout=60) for a in ("summer", "winter")]
            archive = runs["archive"]
            poll(lambda: len(get_run(engine, archive).children) == 2,
                 "the archive's children to start")
            cancelled = cancel_run(engine, archive, reason="the archive is not published")
            done.append(wait_run(engine, archive, timeout=60))

        for info in done:
            print(f"run {info.run_id} ({info.task}): {info.status}, attempts "
                  f"{info.steps[-1].attempts}, result {info.result}")
            if info.status == "dead":
                print(f"  error: {(info.steps[-1].last_error or '').splitlines()[0]}")
            for c in info.children:
                print(f"  child run {c.run_id}: {c.status}")
        engine.dispose()
        children = sum(len(i.children) for i in done)
        print(f"summary: {children} children for {len(done)} albums, resize called "
              f"{calls['resize']} times, {len(cancelled.child_runs)} children cancelled "
              f"with the archive")
        ok = ([i.status for i in done] == ["succeeded", "dead", "cancelled"]
              and children == 7 and calls["resize"] == 7)
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
