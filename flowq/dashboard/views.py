"""The dashboard's pages of one queue, of the schedules and of the batches (GET).

- **A queue** (`/queues/{name}`): its state (paused in the warning colour), its limits, its
  charts (`reads.activity` of that queue), its running jobs (of the `reads.RUNNING_ROWS`
  longest running) and its due runs (the oldest `PAGE_SIZE`), with pause or resume.
- **Schedules** (`/schedules`): every schedule the app defines or the schema records
  (`flowq.ops.schedules.list_schedules`) with its next `NEXT_TICKS` ticks and its last run,
  and "Run now" (`run_schedule_now`). A schedule has no enabled flag: it is declared in code,
  so it is turned off by removing it from the app (the page says so).
- **Batches** (`/batches`): `session.batch()` blocks, newest first, `reads.BATCH_ROWS` a page,
  each with a progress bar of its runs' ends and its callback's state.
"""

from __future__ import annotations

from datetime import datetime
from typing import Final

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from flowq.dashboard import reads
from flowq.dashboard.site import PAGE_SIZE, Dashboard, parse_run_id
from flowq.dashboard.svg import chart
from flowq.define.app import live_apps
from flowq.errors import InvalidArgumentsError
from flowq.names import validate_queue
from flowq.ops import runs as runs_api
from flowq.ops.schedules import list_schedules
from flowq.ops.status import status as read_status

__all__ = ["NEXT_TICKS", "view_routes"]

# How many of a schedule's coming ticks its row lists.
NEXT_TICKS: Final = 3


def view_routes(d: Dashboard) -> list[Route]:
    """The queue, schedules and batches pages, on `d`."""

    async def queue(request: Request) -> Response:
        name = validate_queue(request.path_params["name"])
        window = request.query_params.get("window") or "hour"
        st = await d.read(read_status)
        info = next((q for q in st.queues if q.name == name), None)
        act = await d.read(reads.activity, window, queue=name)
        running = [j for j in await d.read(reads.running_jobs) if j.queue == name]
        due = await d.read(runs_api.list_runs, status="pending", queue=name, limit=PAGE_SIZE)
        times = await d.read(reads.due_times, [r.run_id for r in due])
        return d.render(request, "queue.html", page="queues", name=name, q=info, st=st,
                        act=act, chart=chart, running=running, due=due, times=times,
                        shown_max=reads.RUNNING_ROWS)

    async def schedules(request: Request) -> Response:
        apps = d.apps if d.apps is not None else live_apps(d.schema)
        # The next ticks come from the app that defines them (several apps of one schema
        # are unusual: the first with schedules is asked).
        app = next((a for a in apps if a.schedules), None)
        found = await d.read(lambda engine, schema: list_schedules(engine, app, schema=schema))
        defined = {s.name: s for app in apps for s in app.schedules}
        coming: dict[str, list[datetime]] = {}
        for info in found:
            s = defined.get(info.name)
            if s is not None and info.next_tick is not None:
                ticks = [info.next_tick]
                while len(ticks) < NEXT_TICKS:
                    after = s.next_tick(ticks[-1])
                    if after is None:
                        break
                    ticks.append(after)
                coming[info.name] = ticks
        return d.render(request, "schedules.html", page="schedules", found=found,
                        coming=coming, known=bool(apps), defined=defined)

    async def batches(request: Request) -> Response:
        text = request.query_params.get("before")
        before = None
        if text:
            before = parse_run_id(text)
            if before is None:
                raise InvalidArgumentsError(f"before must be a batch id, got {text[:40]!r}")
        found = await d.read(reads.batches, before)
        older = found[-1].id if len(found) >= reads.BATCH_ROWS else None
        return d.render(request, "batches.html", page="batches", found=found, older=older)

    return [
        Route("/queues/{name}", d.page(queue), name="queue"),
        Route("/schedules", d.page(schedules), name="schedules"),
        Route("/batches", d.page(batches), name="batches"),
    ]
