"""The dashboard's actions: retry or cancel a run, pause or resume a queue, retry dead runs,
cancel the ticked runs of a runs page.

Each is a POST form wrapped by `Dashboard.action` (refused unless `allow_actions`,
authenticated and CSRF-checked), calls the same public functions as `flowq runs` and
`flowq queues` (`flowq.runs`, `flowq.queues`), and answers with a redirect to the form's
`next` page (when it is one of the dashboard's) carrying a one-line flash message. The bulk
retry takes the ticked runs of a dead-letters page (at most `PAGE_SIZE * 20`), or all dead
runs of a task or queue; a run retried, cancelled or pruned since the page was drawn is
counted as skipped, not an error.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from flowq.dashboard.site import PAGE_SIZE, Dashboard, parse_run_id, run_id_of
from flowq.errors import InvalidArgumentsError, RunNotFoundError, RunStateError
from flowq.ops import queues as queues_api
from flowq.ops import runs as runs_api

__all__ = ["action_routes"]


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

    async def retry_dead(request: Request) -> Response:
        form = request.state.form
        back = d.back(request, request.state.form, request.url_for("dead").path)
        if form.get("all") == "1":
            task = (form.get("task") or "").strip() or None
            queue = (form.get("queue") or "").strip() or None
            n = await d.read(runs_api.retry_runs, task=task, queue=queue)
            return d.redirect(request, back, f"{n} dead run(s) retried.")
        ids = _run_ids(form.getlist("run_id"))
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

    async def cancel_runs(request: Request) -> Response:
        """Cancel the ticked runs of a runs page (at most `PAGE_SIZE * 20`), each through
        `cancel_run` (the rule of what a cancel does lives there)."""
        form = request.state.form
        back = d.back(request, form, request.url_for("runs").path)
        ids = _run_ids(form.getlist("run_id"))
        if not ids:
            return d.redirect(request, back, "No run selected: tick the runs to cancel.")
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

    return [
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
