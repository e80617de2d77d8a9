"""The dashboard's actions: retry or cancel a run, pause or resume a queue, retry dead runs,
cancel the ticked runs of a runs page, send a signal to a run, run a schedule now.

Each is a POST form wrapped by `Dashboard.action` (refused unless `allow_actions`,
authenticated and CSRF-checked), calls the same public functions as `flowq runs` and
`flowq queues` (`flowq.runs`, `flowq.queues`), and answers with a redirect to the form's
`next` page (when it is one of the dashboard's) carrying a one-line flash message. The bulk
retry takes the ticked runs of a dead-letters page (at most `PAGE_SIZE * 20`), or all dead
runs of a task or queue; a run retried, cancelled or pruned since the page was drawn is
counted as skipped, not an error.

A bulk action (retry dead runs, cancel the ticked runs) is confirmed on the server: its first
POST changes nothing and answers with a page that says what it will do (how many runs, which
filter) and repeats the form with `confirm=yes`; only that second POST acts. The browser
needs no script for it, and a replayed or forged first POST is harmless.

A signal (`/runs/{id}/signal`: `name`, `payload` as JSON, empty for null) goes through
`flowq.signal` in a transaction of its own; what it refuses (no step waits for that name,
a finished run, another payload already sent) is a 400 or 409 page with flowq's sentence.
"Run now" (`/schedules/{name}/run`) enqueues the schedule's task with its arguments off its
ticks (`flowq.ops.schedules.run_schedule_now`).
"""

from __future__ import annotations

import json
from typing import Any, Final

import sqlalchemy as sa
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from flowq.dashboard.site import PAGE_SIZE, Dashboard, parse_run_id, run_id_of
from flowq.define.app import live_apps
from flowq.enqueueing.sync import signal as send_signal
from flowq.errors import InvalidArgumentsError, RunNotFoundError, RunStateError
from flowq.ops import queues as queues_api
from flowq.ops import runs as runs_api
from flowq.ops.schedules import run_schedule_now

__all__ = ["BULK_SHOWN", "PAYLOAD_MAX_CHARS", "action_routes"]

# How many of a bulk action's run ids its confirmation page lists by number.
BULK_SHOWN: Final = 20
# The longest signal payload the form takes (characters of JSON).
PAYLOAD_MAX_CHARS: Final = 100_000
CONFIRM: Final = "yes"


def action_routes(d: Dashboard) -> list[Route]:
    """The action forms, on `d`."""

    async def retry(request: Request) -> Response:
        run_id = run_id_of(request)
        result = await d.read(runs_api.retry_run, run_id)
        return d.redirect(request, d.back(request, request.state.form, request.url_for("run", run_id=run_id).path),
                          f"Run {run_id}: {len(result.job_ids)} dead step(s) retried.")

    async def cancel(request: Request) -> Response:
        run_id = run_id_of(request)
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

    def confirm(request: Request, back: str, question: str, button: str,
                fields: list[tuple[str, str]], ids: list[int]) -> Response:
        """The page that asks before a bulk action (see the module docstring)."""
        return d.render(request, "confirm.html", page="", refreshable=False,
                        question=question, button=button, action=request.url.path,
                        fields=[("next", back), *fields, *(("run_id", str(i)) for i in ids)],
                        shown=ids[:BULK_SHOWN], more=max(0, len(ids) - BULK_SHOWN), back=back)

    async def retry_dead(request: Request) -> Response:
        form = request.state.form
        back = d.back(request, request.state.form, request.url_for("dead").path)
        confirmed = form.get("confirm") == CONFIRM
        if form.get("all") == "1":
            task = (form.get("task") or "").strip() or None
            queue = (form.get("queue") or "").strip() or None
            if not confirmed:
                # Checked (a bad filter is a 400 here, not on the second page) and counted.
                dead = await d.read(runs_api.list_runs, status="dead", task=task,
                                    queue=queue, limit=PAGE_SIZE * 20 + 1)
                if not dead:
                    return d.redirect(request, back, "No dead run matches: nothing to retry.")
                many = (f"more than {PAGE_SIZE * 20:,}" if len(dead) > PAGE_SIZE * 20
                        else f"{len(dead):,}")
                where = " and ".join(f"{k} {v!r}" for k, v in (("task", task), ("queue", queue))
                                     if v)
                return confirm(request, back,
                               f"Retry every dead run{' of ' + where if where else ''}: "
                               f"{many} run(s) now, and any that dies before you confirm?",
                               "Retry them all",
                               [("all", "1"), ("task", task or ""), ("queue", queue or "")], [])
            n = await d.read(runs_api.retry_runs, task=task, queue=queue)
            return d.redirect(request, back, f"{n} dead run(s) retried.")
        ids = _run_ids(form.getlist("run_id"))
        if not ids:
            return d.redirect(request, back, "No run selected: tick the runs to retry.")
        if not confirmed:
            return confirm(request, back, f"Retry the {len(ids[:PAGE_SIZE * 20])} selected "
                           "dead run(s)?", "Retry them", [], ids[:PAGE_SIZE * 20])
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

    async def cancel_runs(request: Request) -> Response:
        """Cancel the ticked runs of a runs page (at most `PAGE_SIZE * 20`), each through
        `cancel_run` (the rule of what a cancel does lives there)."""
        form = request.state.form
        back = d.back(request, form, request.url_for("runs").path)
        ids = _run_ids(form.getlist("run_id"))
        if not ids:
            return d.redirect(request, back, "No run selected: tick the runs to cancel.")
        if form.get("confirm") != CONFIRM:
            return confirm(request, back, f"Cancel the {len(ids[:PAGE_SIZE * 20])} selected "
                           "run(s)? Their unfinished steps stop (a running one at its next "
                           "check) and their children are cancelled too.", "Cancel them", [],
                           ids[:PAGE_SIZE * 20])
        cancelled, already, skipped = 0, 0, 0
        for run_id in ids[:PAGE_SIZE * 20]:
            try:
                result = await d.read(runs_api.cancel_run, run_id,
                                      reason="cancelled from the flowq dashboard")
            except (RunStateError, RunNotFoundError):
                skipped += 1  # finished or pruned since the page was drawn
                continue
            if result.changed:
                cancelled += 1
            else:
                already += 1
        note = f"{cancelled} run(s) cancelled."
        if already:
            note += f" {already} already cancelled."
        if skipped:
            note += f" {skipped} skipped: no longer there or finished."
        return d.redirect(request, back, note)

    async def signal(request: Request) -> Response:
        run_id = run_id_of(request)
        form = request.state.form
        name = form.get("name")
        text = form.get("payload") or ""
        if not isinstance(name, str) or not name.strip():
            raise InvalidArgumentsError("a signal needs a name: the one the waiting step's "
                                        "wait_for gives")
        if not isinstance(text, str) or len(text) > PAYLOAD_MAX_CHARS:
            raise InvalidArgumentsError(f"the payload must be JSON of at most "
                                        f"{PAYLOAD_MAX_CHARS:,} characters")
        try:
            payload = json.loads(text) if text.strip() else None
        except ValueError as exc:
            raise InvalidArgumentsError(f"the payload is not JSON ({exc}): write e.g. "
                                        '{"approved": true}, or leave it empty for null') from None
        sent = await d.read(_send, run_id, name.strip(), payload)
        note = (f"Signal {name.strip()!r} sent to run {run_id}." if sent
                else f"Run {run_id} already had signal {name.strip()!r} with that payload.")
        return d.redirect(request, d.back(request, form, request.url_for("run", run_id=run_id).path),
                          note)

    async def run_schedule(request: Request) -> Response:
        name = request.path_params["name"]
        apps = d.apps if d.apps is not None else live_apps(d.schema)
        run_id = await d.read(run_schedule_now, apps, name)
        return d.redirect(request, d.back(request, request.state.form,
                                          request.url_for("schedules").path),
                          f"Schedule {name!r} enqueued as run {run_id}.")

    return [
        Route("/runs/{run_id}/signal", d.action(signal), methods=["POST"], name="signal"),
        Route("/schedules/{name}/run", d.action(run_schedule), methods=["POST"],
              name="run_schedule"),
        Route("/runs/cancel", d.action(cancel_runs), methods=["POST"], name="cancel_runs"),
        Route("/runs/{run_id}/retry", d.action(retry), methods=["POST"], name="retry"),
        Route("/runs/{run_id}/cancel", d.action(cancel), methods=["POST"], name="cancel"),
        Route("/queues/{name}/pause", d.action(pause), methods=["POST"], name="pause"),
        Route("/queues/{name}/resume", d.action(resume), methods=["POST"], name="resume"),
        Route("/dead/retry", d.action(retry_dead), methods=["POST"], name="retry_dead"),
    ]


def _run_ids(values: list[Any]) -> list[int]:
    """A form's ticked run ids, each checked (a 400 page for anything else)."""
    ids = []
    for value in values:
        run_id = parse_run_id(value) if isinstance(value, str) else None
        if run_id is None:
            raise InvalidArgumentsError(f"run_id must be a run id, got {str(value)[:40]!r}")
        ids.append(run_id)
    return ids


def _send(engine: sa.Engine, run_id: int, name: str, payload: Any, *, schema: str) -> bool:
    """Signal `name` to run `run_id` in a transaction of its own; False when the same signal
    was sent before."""
    with engine.begin() as conn:
        return send_signal(conn, run_id, name, payload, schema=schema).created
