"""The dashboard's pages (GET) and its login forms: what each page reads and how much it shows.

Pages: queues (`/`, with the charts of `?window=hour|day`), workers (and what each runs
now), runs (filters as lists of the known tasks and queues, find by id or idempotency key,
`?args=` searches the arguments, due times, `PAGE_SIZE` a page, older pages by `?before=`),
a run (its graph, timeline, attempts and steps: `flowq.dashboard.runview`), and the dead
letters (a queue's page, schedules and batches are `flowq.dashboard.views`);
`/refresh?every=N` sets the auto-refresh cookie and goes back. Each reads through the same public functions as the CLI (`flowq.ops.status.status`, `flowq.runs`) and the
dashboard's bounded reads (`flowq.dashboard.reads`). A run page shows at most
`MAX_STEP_ROWS` steps, and its arguments, result and error cells share
`STEPS_BUDGET` characters (each between `CELL_MIN_CHARS` and `SHOWN_CHARS`), so that a run of
huge values still renders a page a browser can hold. `login` and `logout` are POST forms of
their own: `login` takes the token, `logout` ends a token login, CSRF-checked.
"""

from __future__ import annotations

from typing import Any, Final
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from flowq.dashboard import reads, runview
from flowq.dashboard.auth import SESSION_COOKIE
from flowq.dashboard.site import (
    HEADERS,
    PAGE_SIZE,
    REFRESH_CHOICES,
    REFRESH_COOKIE,
    REFRESH_MAX_AGE,
    SHOWN_CHARS,
    Dashboard,
    parse_run_id,
    run_id_of,
)
from flowq.dashboard.svg import chart, graph, timeline
from flowq.errors import InvalidArgumentsError, RunNotFoundError
from flowq.ops import runs as runs_api
from flowq.ops.status import status as read_status

__all__ = ["page_routes"]

# What a run page's steps table may show in all (characters before escaping): each of the
# arguments, result and error cells gets its share, between CELL_MIN_CHARS and SHOWN_CHARS.
STEPS_BUDGET: Final = 1_500_000
CELL_MIN_CHARS: Final = 500
MAX_STEP_ROWS: Final = 500


def _filters(request: Request) -> dict[str, str | None]:
    return {k: (request.query_params.get(k) or "").strip() or None
            for k in ("status", "task", "queue", "version")}


def _version(f: dict[str, str | None]) -> int | None:
    """The runs filter's pipeline version: a whole number of at least 1 (the rule of
    `flowq runs list --version`, `flowq.ops.filters`), else one sentence."""
    text = f["version"]
    if text is None:
        return None
    if not text.isascii() or not text.isdigit() or len(text) > 10:
        raise InvalidArgumentsError(f"version must be a whole number, got {text[:40]!r}")
    return int(text)


def _before(request: Request) -> int | None:
    text = request.query_params.get("before")
    if not text:
        return None
    value = parse_run_id(text)
    if value is None:
        raise InvalidArgumentsError(f"before must be a run id, got {text[:40]!r}")
    return value


def _older(filters: dict[str, str | None], found: list[runs_api.RunSummary]) -> str | None:
    """The query string of the next (older) page, if this one is full."""
    if len(found) < PAGE_SIZE:
        return None
    return urlencode({**{k: v for k, v in filters.items() if v}, "before": found[-1].run_id})


def page_routes(d: Dashboard) -> list[Route]:
    """The pages and the login and logout forms, on `d`."""

    async def queues(request: Request) -> Response:
        window = request.query_params.get("window") or "hour"
        st = await d.read(read_status)
        act = await d.read(reads.activity, window)
        return d.render(request, "queues.html", page="queues", st=st, act=act, chart=chart,
                        activity_rows=reads.ACTIVITY_ROWS)

    async def workers(request: Request) -> Response:
        st = await d.read(read_status)
        running = await d.read(reads.running_jobs)
        by_worker: dict[str, list[reads.RunningJob]] = {}
        for job in running:
            by_worker.setdefault(job.worker or "", []).append(job)
        return d.render(request, "workers.html", page="workers", st=st, by_worker=by_worker,
                        running=running, shown_max=reads.RUNNING_ROWS)

    async def refresh(request: Request) -> Response:
        """Turn auto-refresh off (`every=0`) or on every `every` seconds, then go back."""
        every = request.query_params.get("every", "")
        response = RedirectResponse(d.back(request, request.query_params, d.base(request)),
                                    status_code=303, headers=HEADERS)
        if every.isdigit() and int(every) in REFRESH_CHOICES:
            d.cookie(request, response, REFRESH_COOKIE, every, max_age=REFRESH_MAX_AGE)
        else:
            response.delete_cookie(REFRESH_COOKIE, path=d.base(request))
        return response

    async def runs(request: Request) -> Response:
        f = _filters(request)
        find = (request.query_params.get("find") or "").strip()
        if find:
            run_id = parse_run_id(find)
            if run_id is not None:
                try:
                    await d.read(runs_api.get_run, run_id)
                except RunNotFoundError:
                    run_id = None
            if run_id is None and "\x00" not in find:  # no key can hold a NUL
                run_id = await d.read(runs_api.find_run, find)
            if run_id is None:
                return d.render(request, "runs.html", page="runs", found=[], filters=f,
                                find=find, older=None, due={}, search="", matches=None,
                                problem="No run has that id or idempotency key.",
                                **await _choices(f))
            return RedirectResponse(request.url_for("run", run_id=run_id).path, status_code=303)
        search = (request.query_params.get("args") or "").strip()
        matches, problem = None, None
        if search:
            matches = await d.read(reads.search_args, reads.parse_search(search))
            if matches is None:
                problem = (f"The search of the arguments was stopped after "
                           f"{reads.SEARCH_TIMEOUT_MS // 1000} s (no index serves it): "
                           "search with a more selective value.")
                matches = []
        found = await d.read(runs_api.list_runs, status=f["status"], task=f["task"],
                             queue=f["queue"], before=_before(request), limit=PAGE_SIZE,
                             version=_version(f))
        due = await d.read(reads.due_times, [r.run_id for r in found if r.status == "pending"])
        older = _older(f, found)
        return d.render(request, "runs.html", page="runs", found=found, filters=f, find="",
                        older=older, problem=problem, due=due, search=search,
                        matches=matches,
                        **await _choices(f))

    async def _choices(f: dict[str, str | None]) -> dict[str, Any]:
        """The filters' lists (the known tasks and queues, and the current choice), and the
        database's time."""
        tasks = await d.read(reads.known_tasks)
        st = await d.read(read_status)
        queues = [q.name for q in st.queues]
        for name, known in (("task", tasks), ("queue", queues)):
            value = f[name]
            if value and value not in known:
                known.insert(0, value)
        return {"tasks": tasks, "queues": queues, "now": st.at}

    async def run(request: Request) -> Response:
        info = await d.read(runs_api.get_run, run_id_of(request))
        rows = min(len(info.steps), MAX_STEP_ROWS)
        cell = max(CELL_MIN_CHARS, min(SHOWN_CHARS, STEPS_BUDGET // max(1, 3 * rows)))
        definition = runview.definition_of(info, d.schema)
        now = await d.read(reads.database_now)
        signals = {s.job_id: runview.signal_of(s, definition) for s in info.steps
                   if s.status == "waiting"}
        return d.render(request, "run.html", page="runs", run=info, max_rows=MAX_STEP_ROWS,
                        cell=cell, dag=graph(runview.nodes(info, definition)),
                        timeline=timeline(runview.bars(info), now),
                        attempts=runview.attempts(info), attempt_rows=runview.ATTEMPT_ROWS,
                        timeline_rows=runview.TIMELINE_ROWS, signals=signals,
                        known=definition is not None)

    async def dead(request: Request) -> Response:
        f = _filters(request)
        found = await d.read(runs_api.list_runs, status="dead", task=f["task"],
                             queue=f["queue"], before=_before(request), limit=PAGE_SIZE)
        errors = await d.read(runs_api.dead_steps, [r.run_id for r in found])
        older = _older(f, found)
        return d.render(request, "dead.html", page="dead", found=found, errors=errors,
                        filters=f, older=older, **await _choices(f))

    async def login(request: Request) -> Response:
        if not d.host_ok(request):
            return d.wrong_host()
        if d.guard.token is None:
            return d.error(request, 404, "This dashboard has no token login.")
        form = await request.form(max_files=0, max_fields=10)
        token = form.get("token")
        if not isinstance(token, str) or not d.guard.token_ok(token):
            return d.login(request, "wrong token.", 401)
        response = RedirectResponse(d.back(request, form, d.base(request)), status_code=303)
        d.set_session(request, response)
        return response

    async def logout(request: Request) -> Response:
        """End a token login (CSRF-checked like every form; a GET cannot log anyone out)."""
        if not d.host_ok(request):
            return d.wrong_host()
        refused = d.csrf_refusal(request, await request.form(max_files=0, max_fields=10))
        if refused is not None:
            return refused
        # Ended on the server: a copy of the cookie is refused from now on.
        d.guard.end_session(request.cookies.get(SESSION_COOKIE))
        response = RedirectResponse(d.base(request), status_code=303, headers=HEADERS)
        response.delete_cookie(SESSION_COOKIE, path=d.base(request))
        return response

    return [
        Route("/", d.page(queues), name="queues"),
        Route("/workers", d.page(workers), name="workers"),
        Route("/runs", d.page(runs), name="runs"),
        Route("/runs/{run_id}", d.page(run), name="run"),
        Route("/dead", d.page(dead), name="dead"),
        Route("/refresh", d.page(refresh), name="refresh"),
        Route("/login", login, methods=["POST"], name="login"),
        Route("/logout", logout, methods=["POST"], name="logout"),
    ]
