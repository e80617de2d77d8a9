"""The dashboard's ASGI application (`create_app`): server-rendered pages, no JavaScript.

`create_app` checks the options, makes the `Dashboard` (`flowq.dashboard.site`: templates,
cookies, guards, error pages) and mounts its routes: the pages and login forms
(`flowq.dashboard.pages`), the queue, schedules and batches pages (`flowq.dashboard.views`)
and, behind `allow_actions`, authentication and CSRF checks, the
actions (`flowq.dashboard.actions`: retry, cancel, pause, resume, bulk retry and cancel
behind a confirmation, send a signal, run a schedule now). Every read
and action goes through the same public functions as the CLI, in a thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import sqlalchemy as sa
from starlette.applications import Starlette

from flowq.dashboard.actions import action_routes
from flowq.dashboard.auth import Guard
from flowq.dashboard.pages import page_routes
from flowq.dashboard.site import Dashboard
from flowq.dashboard.views import view_routes
from flowq.db import create_engine
from flowq.errors import ConfigurationError
from flowq.names import DEFAULT_SCHEMA

if TYPE_CHECKING:
    from flowq.define.app import FlowQ

__all__ = ["create_app"]


def create_app(database: sa.Engine | str, *, schema: str = DEFAULT_SCHEMA,
               allow_actions: bool = False, token: str | None = None,
               basic_auth: tuple[str, str] | None = None, title: str = "flowq",
               allowed_hosts: Sequence[str] | None = None,
               app: FlowQ | None = None) -> Starlette:
    """The dashboard as an ASGI app, to serve (`flowq dashboard`) or mount in your own::

        app.mount("/flowq", create_app(engine, allow_actions=True, token=secret))

    `database`: an Engine (yours: not disposed here) or a URL (an engine made and disposed
    with the app). Read-only unless `allow_actions`, which needs `token` or `basic_auth`
    (`(user, password)`); either one also guards the pages themselves. `allowed_hosts`:
    the names the dashboard answers to (the Host header); others get 421. `flowq
    dashboard` on a loopback address allows only localhost, 127.0.0.1 and ::1. `app`: the
    app whose schedules the schedules page lists and runs (default: the apps of `schema`
    this process imported, as `flowq dashboard --app` does)."""
    guard = Guard(token=token, basic_auth=basic_auth)
    if allow_actions and not guard.required:
        raise ConfigurationError("a dashboard with actions needs a token or basic auth: "
                                 "pass token=... or basic_auth=(user, password)")
    owned = isinstance(database, str)
    engine = create_engine(database) if isinstance(database, str) else database
    hosts = None if allowed_hosts is None else frozenset(h.lower().strip("[]")
                                                         for h in allowed_hosts)
    d = Dashboard(engine, schema, allow_actions, guard, title, hosts,
                  None if app is None else [app])

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        if owned:
            engine.dispose()

    return Starlette(routes=[*page_routes(d), *view_routes(d), *action_routes(d)],
                     lifespan=lifespan)
