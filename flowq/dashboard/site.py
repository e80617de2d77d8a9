"""The dashboard's plumbing behind every route: templates, cookies, guards and error pages.

`Dashboard` holds the engine, the schema, the `Guard` and the Jinja environment, and wraps
each endpoint: `page` (a GET: authenticated, a `?token=` logs in), `action` (a POST: refused
unless actions are on, authenticated and CSRF-checked, its form in `request.state.form`),
both answering only at an allowed Host and turning flowq and database errors into plain
pages (404, 409, 400, 503, 500) with passwords hidden. `read` runs a public read or write
function of flowq in a thread, so the event loop never waits on PostgreSQL.

Every value shown comes from users (arguments, results, error texts, task and queue names)
and is escaped by Jinja's autoescape; `HEADERS`' Content-Security-Policy forbids scripts
altogether, so even a missed escape could not run one. Long values are cut for display
(`SHOWN_CHARS`).
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import secrets
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlencode, urlsplit

import jinja2
import sqlalchemy as sa
from markupsafe import Markup
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response

from flowq.cli.common import age_cell, limits_cell
from flowq.dashboard.auth import CSRF_COOKIE, SESSION_COOKIE, SESSION_MAX_AGE, Guard
from flowq.db import mask_secrets
from flowq.db.schema import STATUSES
from flowq.define.shape import short
from flowq.errors import (
    ConfigurationError,
    DatabaseUnavailableError,
    FlowqError,
    InvalidArgumentsError,
    InvalidQueueError,
    RunNotFoundError,
    RunStateError,
    SignalError,
    UnknownTaskError,
)
from flowq.storable import first_line

if TYPE_CHECKING:
    from flowq.define.app import FlowQ

__all__ = ["HEADERS", "PAGE_SIZE", "REFRESH_CHOICES", "REFRESH_COOKIE", "REFRESH_MAX_AGE",
           "SHOWN_CHARS", "Dashboard", "Endpoint", "parse_run_id", "refresh_of", "run_id_of"]

PAGE_SIZE: Final = 50
# A value longer than this is cut on the page (the JSON of `flowq runs show --json` has it all).
SHOWN_CHARS: Final = 20_000
MAX_RUN_ID: Final = 2**63 - 1
FLASH_COOKIE: Final = "flowq_flash"
# Auto-refresh: the page reloads itself every so many seconds (`<meta http-equiv="refresh">`,
# no script), off by default; the choice is remembered in this cookie for a year.
REFRESH_COOKIE: Final = "flowq_refresh"
REFRESH_CHOICES: Final = (5, 15, 60)
REFRESH_MAX_AGE: Final = 365 * 86400
HEADERS: Final = {
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


def _bar(done: Any, total: Any) -> Markup:
    """A progress bar of `done` out of `total` (numbers, else nothing drawn) with its
    figures; both come from handlers, so anything else is shown as text, escaped."""
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool)
                  for v in (done, total))
    if not numbers or total <= 0 or done != done or total != total:  # NaN cannot reach jsonb
        text = _shown(done, 40) + ("" if total is None else f" / {_shown(total, 40)}")
        return Markup('<span class="figures">{}</span>').format(text)
    share = min(max(done / total, 0.0), 1.0)
    return Markup('<span class="bar" role="progressbar" aria-valuenow="{0}" aria-valuemin="0" '
                  'aria-valuemax="{1}"><span style="width:{2:.1f}%"></span></span>'
                  '<span class="figures">{0} / {1} ({3:.0f}%)</span>').format(
                      _shown(done, 40), _shown(total, 40), share * 100, share * 100)


def _stamp(text: Any) -> str:
    """An ISO time a handler's progress carries, as the page shows times (else as given)."""
    if isinstance(text, str):
        with contextlib.suppress(ValueError):
            return _when(datetime.fromisoformat(text))
    return _shown(text, 60)


def parse_run_id(text: str) -> int | None:
    """`text` as a run id (ASCII digits, within bigint), else None."""
    if not (text.isascii() and text.isdigit()) or len(text) > 19:
        return None
    value = int(text)
    return value if 0 < value <= MAX_RUN_ID else None


def run_id_of(request: Request) -> int:
    """The route's `{run_id}`, or RunNotFoundError (a 404 page) when it is not a run id."""
    run_id = parse_run_id(request.path_params["run_id"])
    if run_id is None:
        raise RunNotFoundError(f"no run {request.path_params['run_id'][:40]!r} exists (run ids "
                               "are positive 64-bit integers)")
    return run_id


def _when(value: Any) -> str:
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M:%S")


def _duration(seconds: Any) -> str:
    """Seconds as a short duration: 0.25 s, 12.4 s, 3 min 05 s, 2 h 04 min."""
    if seconds is None:
        return "-"
    s = float(seconds)
    if s < 60:
        return f"{s:.3g} s" if s < 10 else f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def refresh_of(request: Request) -> int | None:
    """The auto-refresh period this browser chose (its cookie), None when off."""
    text = request.cookies.get(REFRESH_COOKIE, "")
    return int(text) if text.isdigit() and int(text) in REFRESH_CHOICES else None


# A page's query longer than this is not carried in its links back to it (a `find` of a
# megabyte would otherwise be repeated in every auto-refresh link).
HERE_MAX_CHARS: Final = 2000


def _here(request: Request) -> str:
    """This page's path and query, for a form's `next` (checked by `Dashboard.back`)."""
    query = request.url.query
    return request.url.path + (f"?{query}" if query and len(query) <= HERE_MAX_CHARS else "")


class Dashboard:
    """The state behind the routes: the engine, the schema, the guard and the templates."""

    def __init__(self, engine: sa.Engine, schema: str, allow_actions: bool, guard: Guard,
                 title: str, allowed_hosts: frozenset[str] | None,
                 apps: list[FlowQ] | None = None) -> None:
        self.engine = engine
        self.apps = apps  # None: the live apps of the schema (`flowq dashboard --app`)
        self.allowed_hosts = allowed_hosts
        self.schema = schema
        self.allow_actions = allow_actions
        self.guard = guard
        self.title = title
        self.env = jinja2.Environment(
            loader=jinja2.PackageLoader("flowq.dashboard", "templates"),
            autoescape=True, undefined=jinja2.StrictUndefined)
        self.env.filters.update(shown=_shown, when=_when, age=age_cell, duration=_duration,
                                stamp=_stamp,
                                first_line=lambda text: first_line(text)[:300])
        self.env.globals.update(limits=limits_cell, statuses=STATUSES, bar=_bar,
                                short_fingerprint=short)

    # -- rendering ------------------------------------------------------------------------

    def render(self, request: Request, template: str, status_code: int = 200,
               **context: Any) -> HTMLResponse:
        csrf = request.cookies.get(CSRF_COOKIE) or secrets.token_urlsafe(32)
        flash = request.cookies.get(FLASH_COOKIE)
        html = self.env.get_template(template).render(
            request=request, title=self.title, csrf=csrf, flash=flash,
            logged_in=SESSION_COOKIE in request.cookies and self.guard.authenticated(request),
            actions=self.allow_actions, url=lambda route, **p: request.url_for(route, **p).path,
            refresh=refresh_of(request) if context.get("refreshable", True) else None,
            refresh_choices=REFRESH_CHOICES, here=_here(request), **context)
        response = HTMLResponse(html, status_code=status_code, headers=HEADERS)
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
        return self.render(request, "error.html", status_code=status_code, message=message,
                           refreshable=False)

    def redirect(self, request: Request, to: str, flash: str) -> RedirectResponse:
        response = RedirectResponse(to, status_code=303, headers=HEADERS)
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
                                 "header names another).", status_code=421, headers=HEADERS)

    async def guarded(self, request: Request, fn: Endpoint) -> Response:
        try:
            return await fn(request)
        except (RunNotFoundError, UnknownTaskError) as exc:
            return self.error(request, 404, str(exc))
        except RunStateError as exc:
            return self.error(request, 409, str(exc))
        except (InvalidArgumentsError, InvalidQueueError, ConfigurationError,
                SignalError) as exc:
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
                               refreshable=False,
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


