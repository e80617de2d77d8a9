"""The dashboard's ASGI application (`create_app`): server-rendered pages, no JavaScript.

Pages: queues (`/`), workers, runs (filters, find by id or idempotency key), a run with its
steps, and the dead letters. Every read goes through the same public functions as the CLI
(`flowq.status.status`, `flowq.runs`, `flowq.queues`), in a thread so the event loop never
waits on PostgreSQL. Actions (retry, cancel, pause, resume, bulk retry) are POST forms, only
when `allow_actions` is set, authenticated and CSRF-checked (`flowq.dashboard.auth`).

Every value shown comes from users (arguments, results, error texts, task and queue names)
and is escaped by Jinja's autoescape; a Content-Security-Policy forbids scripts altogether,
so even a missed escape could not run one. Long values are cut for display.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Final
from urllib.parse import urlencode, urlsplit

import jinja2
import sqlalchemy as sa
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from flowq import queues as queues_api
from flowq import runs as runs_api
from flowq.cli.common import age_cell, limits_cell
from flowq.dashboard.auth import CSRF_COOKIE, SESSION_COOKIE, SESSION_MAX_AGE, Guard
from flowq.db import create_engine, mask_secrets
from flowq.db.schema import DEFAULT_SCHEMA, STATUSES
from flowq.errors import (
    ConfigurationError,
    DatabaseUnavailableError,
    FlowqError,
    InvalidArgumentsError,
    InvalidQueueError,
    RunNotFoundError,
    RunStateError,
)
from flowq.status import status as read_status
from flowq.storable import first_line

__all__ = ["create_app"]

PAGE_SIZE: Final = 50
# A value longer than this is cut on the page (the JSON of `flowq runs show --json` has it all).
SHOWN_CHARS: Final = 20_000
# What a run page's steps table may show in all (characters before escaping): each of the
# arguments, result and error cells gets its share, between CELL_MIN_CHARS and SHOWN_CHARS.
STEPS_BUDGET: Final = 1_500_000
CELL_MIN_CHARS: Final = 500
MAX_STEP_ROWS: Final = 500
MAX_RUN_ID: Final = 2**63 - 1
FLASH_COOKIE: Final = "flowq_flash"
_HEADERS: Final = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; "
                               "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

Endpoint = Callable[[Request], Awaitable[Response]]


def _shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """A JSON value as indented text for a <pre>, cut to `limit` characters."""
    text = value if isinstance(value, str) else json.dumps(value, indent=2, ensure_ascii=False,
                                                            default=str)
    if len(text) > limit:
        return f"{text[:limit]}\n… ({len(text) - limit:,} more characters)"
    return text


def parse_run_id(text: str) -> int | None:
    """`text` as a run id (ASCII digits, within bigint), else None."""
    if not (text.isascii() and text.isdigit()) or len(text) > 19:
        return None
    value = int(text)
    return value if 0 < value <= MAX_RUN_ID else None


def _run_id_of(request: Request) -> int:
    run_id = parse_run_id(request.path_params["run_id"])
    if run_id is None:
        raise RunNotFoundError(f"no run {request.path_params['run_id'][:40]!r} exists (run ids "
                               "are positive 64-bit integers)")
    return run_id


def _when(value: Any) -> str:
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M:%S")


class _Dashboard:
    """The state behind the routes: the engine, the schema, the guard and the templates."""

    def __init__(self, engine: sa.Engine, schema: str, allow_actions: bool, guard: Guard,
                 title: str, allowed_hosts: frozenset[str] | None) -> None:
        self.engine = engine
        self.allowed_hosts = allowed_hosts
        self.schema = schema
        self.allow_actions = allow_actions
        self.guard = guard
        self.title = title
        self.env = jinja2.Environment(
            loader=jinja2.PackageLoader("flowq.dashboard", "templates"),
            autoescape=True, undefined=jinja2.StrictUndefined)
        self.env.filters.update(shown=_shown, when=_when, age=age_cell,
                                first_line=lambda text: first_line(text)[:300])
        self.env.globals.update(limits=limits_cell, statuses=STATUSES)

    # -- rendering ------------------------------------------------------------------------

    def render(self, request: Request, template: str, status_code: int = 200,
               **context: Any) -> HTMLResponse:
        csrf = request.cookies.get(CSRF_COOKIE) or secrets.token_urlsafe(32)
        flash = request.cookies.get(FLASH_COOKIE)
        html = self.env.get_template(template).render(
            request=request, title=self.title, csrf=csrf, flash=flash,
            logged_in=SESSION_COOKIE in request.cookies and self.guard.authenticated(request),
            actions=self.allow_actions, url=lambda route, **p: request.url_for(route, **p).path,
            **context)
        response = HTMLResponse(html, status_code=status_code, headers=_HEADERS)
        if request.cookies.get(CSRF_COOKIE) != csrf:
            self.cookie(request, response, CSRF_COOKIE, csrf)
        if flash is not None:
            response.delete_cookie(FLASH_COOKIE, path=self.base(request))
        return response

    def cookie(self, request: Request, response: Response, name: str, value: str,
               max_age: int | None = None) -> None:
        """Set one of the dashboard's cookies: HttpOnly, SameSite=Strict, on its own path,
        and Secure when the page was served over HTTPS."""
        response.set_cookie(name, value, max_age=max_age, path=self.base(request),
                            httponly=True, samesite="strict",
                            secure=request.url.scheme == "https")

    @staticmethod
    def base(request: Request) -> str:
        return request.url_for("queues").path

    def error(self, request: Request, status_code: int, message: str) -> HTMLResponse:
        return self.render(request, "error.html", status_code=status_code, message=message)

    def redirect(self, request: Request, to: str, flash: str) -> RedirectResponse:
        response = RedirectResponse(to, status_code=303, headers=_HEADERS)
        self.cookie(request, response, FLASH_COOKIE, flash[:500])
        return response

    def back(self, request: Request, form: Any, fallback: str) -> str:
        """Where a form goes after its action: its `next` field when it is a path of this
        dashboard (never another site), else `fallback`."""
        target = form.get("next")
        if not isinstance(target, str) or not target.startswith("/"):
            return fallback
        base = self.base(request)
        # "/ops/flowq/../../elsewhere" must not climb out of a mount point.
        norm = posixpath.normpath(target) + ("/" if target.endswith("/") else "")
        if norm == base.rstrip("/"):
            norm = base
        for candidate in (target, norm):
            parts = urlsplit(candidate)
            if (parts.scheme or parts.netloc or candidate.startswith("//")
                    or not candidate.startswith(base)):
                return fallback
        return norm

    # -- guards ---------------------------------------------------------------------------

    def page(self, fn: Endpoint) -> Endpoint:
        """A GET page: authenticated (a `?token=` logs in), errors as plain pages."""

        async def endpoint(request: Request) -> Response:
            if not self.host_ok(request):
                return self.wrong_host()
            token = request.query_params.get("token")
            if token is not None and self.guard.token is not None:
                if not self.guard.token_ok(token):
                    return self.login(request, "wrong token.", 401)
                rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
                response = RedirectResponse(
                    request.url.path + ("?" + urlencode(rest) if rest else ""), status_code=303)
                self.set_session(request, response)
                return response
            if not self.guard.authenticated(request):
                return self.login(request, None, 401)
            return await self.guarded(request, fn)

        return endpoint

    def action(self, fn: Endpoint) -> Endpoint:
        """A POST: refused unless actions are on, authenticated, and CSRF-checked."""

        async def endpoint(request: Request) -> Response:
            if not self.host_ok(request):
                return self.wrong_host()
            if not self.allow_actions:
                return self.error(request, 403, "This dashboard is read-only: start it with "
                                  "--allow-actions (and a --token or --basic-auth) to retry, "
                                  "cancel, pause or resume.")
            if not self.guard.authenticated(request):
                return self.login(request, "log in to act.", 401)
            form = await request.form(max_files=0, max_fields=PAGE_SIZE * 20 + 10)
            refused = self.csrf_refusal(request, form)
            if refused is not None:
                return refused
            request.state.form = form
            return await self.guarded(request, fn)

        return endpoint

    def csrf_refusal(self, request: Request, form: Any) -> Response | None:
        """The 403 page for a form whose CSRF token is missing or wrong, else None."""
        submitted = form.get("csrf")
        if self.guard.csrf_ok(request, submitted if isinstance(submitted, str) else None):
            return None
        return self.error(request, 403, "The form's CSRF token is missing or does not match: "
                          "reload the page and try again.")

    def host_ok(self, request: Request) -> bool:
        """With `allowed_hosts`, the Host header must name one of them: a dashboard on
        127.0.0.1 answers only as localhost, so a page elsewhere cannot reach it through
        DNS rebinding (its own name pointed at 127.0.0.1)."""
        if self.allowed_hosts is None:
            return True
        host = urlsplit("//" + request.headers.get("host", "")).hostname
        return host is not None and host.lower() in self.allowed_hosts

    def wrong_host(self) -> Response:
        return PlainTextResponse("This dashboard answers only at its own address (the Host "
                                 "header names another).", status_code=421, headers=_HEADERS)

    async def guarded(self, request: Request, fn: Endpoint) -> Response:
        try:
            return await fn(request)
        except RunNotFoundError as exc:
            return self.error(request, 404, str(exc))
        except RunStateError as exc:
            return self.error(request, 409, str(exc))
        except (InvalidArgumentsError, InvalidQueueError, ConfigurationError) as exc:
            return self.error(request, 400, str(exc))
        except DatabaseUnavailableError as exc:
            return self.error(request, 503, str(exc))
        except FlowqError as exc:
            return self.error(request, 500, str(exc))
        except sa.exc.OperationalError as exc:
            return self.error(request, 503, "cannot reach the database: "
                              f"{mask_secrets(first_line(exc.orig or exc))}")
        except sa.exc.TimeoutError:
            return self.error(request, 503, "no database connection is free (the dashboard's "
                              "connection pool is exhausted): try again in a moment.")
        except sa.exc.DBAPIError as exc:
            code = getattr(exc.orig, "sqlstate", None)
            if code in ("42P01", "3F000"):  # undefined table, invalid schema name
                return self.error(request, 500, f"the database has no flowq schema "
                                  f"{self.schema!r} (or it is not migrated): run "
                                  "`flowq migrate`, or give the dashboard the right schema.")
            return self.error(request, 500, "the database refused a query: "
                              f"{mask_secrets(first_line(exc.orig or exc))}")

    def login(self, request: Request, problem: str | None, status_code: int) -> HTMLResponse:
        response = self.render(request, "login.html", status_code=status_code, problem=problem,
                               token_login=self.guard.token is not None,
                               next=request.url.path)
        if self.guard.basic_auth is not None:
            response.headers["WWW-Authenticate"] = 'Basic realm="flowq", charset="UTF-8"'
        else:
            response.headers["WWW-Authenticate"] = 'Bearer realm="flowq"'
        return response

    def set_session(self, request: Request, response: Response) -> None:
        self.cookie(request, response, SESSION_COOKIE, self.guard.session_value(),
                    max_age=SESSION_MAX_AGE)

    def read(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Awaitable[Any]:
        return run_in_threadpool(fn, self.engine, *args, schema=self.schema, **kwargs)


def _filters(request: Request) -> dict[str, str | None]:
    return {k: (request.query_params.get(k) or "").strip() or None
            for k in ("status", "task", "queue")}


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


def _routes(d: _Dashboard) -> list[Route]:
    async def queues(request: Request) -> Response:
        st = await d.read(read_status)
        return d.render(request, "queues.html", page="queues", st=st)

    async def workers(request: Request) -> Response:
        st = await d.read(read_status)
        return d.render(request, "workers.html", page="workers", st=st)

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
                                find=find, older=None,
                                problem="No run has that id or idempotency key.")
            return RedirectResponse(request.url_for("run", run_id=run_id).path, status_code=303)
        found = await d.read(runs_api.list_runs, status=f["status"], task=f["task"],
                             queue=f["queue"], before=_before(request), limit=PAGE_SIZE)
        older = _older(f, found)
        return d.render(request, "runs.html", page="runs", found=found, filters=f, find="",
                        older=older, problem=None)

    async def run(request: Request) -> Response:
        info = await d.read(runs_api.get_run, _run_id_of(request))
        rows = min(len(info.steps), MAX_STEP_ROWS)
        cell = max(CELL_MIN_CHARS, min(SHOWN_CHARS, STEPS_BUDGET // max(1, 3 * rows)))
        return d.render(request, "run.html", page="runs", run=info, max_rows=MAX_STEP_ROWS,
                        cell=cell)

    async def dead(request: Request) -> Response:
        f = _filters(request)
        found = await d.read(runs_api.list_runs, status="dead", task=f["task"],
                             queue=f["queue"], before=_before(request), limit=PAGE_SIZE)
        errors = await d.read(runs_api.dead_steps, [r.run_id for r in found])
        older = _older(f, found)
        return d.render(request, "dead.html", page="dead", found=found, errors=errors,
                        filters=f, older=older)

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
        response = RedirectResponse(d.base(request), status_code=303, headers=_HEADERS)
        response.delete_cookie(SESSION_COOKIE, path=d.base(request))
        return response

    # -- actions --------------------------------------------------------------------------

    async def retry(request: Request) -> Response:
        run_id = _run_id_of(request)
        result = await d.read(runs_api.retry_run, run_id)
        return d.redirect(request, d.back(request, request.state.form, request.url_for("run", run_id=run_id).path),
                          f"Run {run_id}: {len(result.job_ids)} dead step(s) retried.")

    async def cancel(request: Request) -> Response:
        run_id = _run_id_of(request)
        result = await d.read(runs_api.cancel_run, run_id,
                              reason="cancelled from the flowq dashboard")
        what = ("cancelled" if result.changed else "was already cancelled")
        return d.redirect(request, d.back(request, request.state.form, request.url_for("run", run_id=run_id).path),
                          f"Run {run_id} {what}.")

    async def pause(request: Request) -> Response:
        return await _set_paused(request, True)

    async def resume(request: Request) -> Response:
        return await _set_paused(request, False)

    async def _set_paused(request: Request, paused: bool) -> Response:
        name = request.path_params["name"]
        fn = queues_api.pause if paused else queues_api.resume
        changed = await d.read(fn, name)
        verb = "paused" if paused else "resumed"
        note = f"Queue {name!r} {verb}." if changed else f"Queue {name!r} was already {verb}."
        return d.redirect(request, d.back(request, request.state.form, d.base(request)), note)

    async def retry_dead(request: Request) -> Response:
        form = request.state.form
        back = d.back(request, request.state.form, request.url_for("dead").path)
        if form.get("all") == "1":
            task = (form.get("task") or "").strip() or None
            queue = (form.get("queue") or "").strip() or None
            n = await d.read(runs_api.retry_runs, task=task, queue=queue)
            return d.redirect(request, back, f"{n} dead run(s) retried.")
        ids = []
        for value in form.getlist("run_id"):
            run_id = parse_run_id(value) if isinstance(value, str) else None
            if run_id is None:
                raise InvalidArgumentsError(f"run_id must be a run id, got {str(value)[:40]!r}")
            ids.append(run_id)
        if not ids:
            return d.redirect(request, back, "No run selected: tick the runs to retry.")
        retried, skipped = 0, 0
        for run_id in ids[:PAGE_SIZE * 20]:
            try:
                await d.read(runs_api.retry_run, run_id)
                retried += 1
            except (RunStateError, RunNotFoundError):
                skipped += 1  # retried, cancelled or pruned since the page was drawn
        note = f"{retried} dead run(s) retried."
        if skipped:
            note += f" {skipped} skipped: no longer dead."
        return d.redirect(request, back, note)

    return [
        Route("/", d.page(queues), name="queues"),
        Route("/workers", d.page(workers), name="workers"),
        Route("/runs", d.page(runs), name="runs"),
        Route("/runs/{run_id}", d.page(run), name="run"),
        Route("/dead", d.page(dead), name="dead"),
        Route("/login", login, methods=["POST"], name="login"),
        Route("/logout", logout, methods=["POST"], name="logout"),
        Route("/runs/{run_id}/retry", d.action(retry), methods=["POST"], name="retry"),
        Route("/runs/{run_id}/cancel", d.action(cancel), methods=["POST"], name="cancel"),
        Route("/queues/{name}/pause", d.action(pause), methods=["POST"], name="pause"),
        Route("/queues/{name}/resume", d.action(resume), methods=["POST"], name="resume"),
        Route("/dead/retry", d.action(retry_dead), methods=["POST"], name="retry_dead"),
    ]


def create_app(database: sa.Engine | str, *, schema: str = DEFAULT_SCHEMA,
               allow_actions: bool = False, token: str | None = None,
               basic_auth: tuple[str, str] | None = None, title: str = "flowq",
               allowed_hosts: Sequence[str] | None = None) -> Starlette:
    """The dashboard as an ASGI app, to serve (`flowq dashboard`) or mount in your own::

        app.mount("/flowq", create_app(engine, allow_actions=True, token=secret))

    `database`: an Engine (yours: not disposed here) or a URL (an engine made and disposed
    with the app). Read-only unless `allow_actions`, which needs `token` or `basic_auth`
    (`(user, password)`); either one also guards the pages themselves. `allowed_hosts`:
    the names the dashboard answers to (the Host header); others get 421. `flowq
    dashboard` on a loopback address allows only localhost, 127.0.0.1 and ::1."""
    guard = Guard(token=token, basic_auth=basic_auth)
    if allow_actions and not guard.required:
        raise ConfigurationError("a dashboard with actions needs a token or basic auth: "
                                 "pass token=... or basic_auth=(user, password)")
    owned = isinstance(database, str)
    engine = create_engine(database) if isinstance(database, str) else database
    hosts = None if allowed_hosts is None else frozenset(h.lower().strip("[]")
                                                         for h in allowed_hosts)
    d = _Dashboard(engine, schema, allow_actions, guard, title, hosts)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        if owned:
            engine.dispose()

    return Starlette(routes=_routes(d), lifespan=lifespan)
