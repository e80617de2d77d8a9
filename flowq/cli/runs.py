"""`flowq runs ...`: inspect and control runs (list, show, cancel, retry).

Each command prints a small table for people, or with `--json` one JSON object whose keys
are stable (`RunInfo.to_dict()` and friends in `flowq.runs`), for scripts. Errors are one
sentence on stderr with exit code 2 (an unknown run id, retrying a run that is not dead).
The SQL lives in `flowq.queries`, the logic in `flowq.runs`; this module only formats.
Options: `--database-url` (default: FLOWQ_DATABASE_URL, then DATABASE_URL), `--schema`
(default "flowq"), `--json`; `list` also `--status` and `--limit 50`.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Final, cast

import click

from flowq.cli.common import load_app, open_engine, schema_option, url_option
from flowq.runs import RunInfo, cancel_run, get_run, list_runs, retry_run, unserved_jobs
from flowq.schema import STATUSES, Status
from flowq.storable import first_line

__all__ = ["runs"]

ERROR_CHARS: Final = 70

json_option = click.option("--json", "as_json", is_flag=True,
                           help="Print one JSON object (stable keys) instead of a table.")


def _when(value: datetime | None) -> str:
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def _error_cell(text: str | None) -> str:
    line = first_line(text or "")
    return line if len(line) <= ERROR_CHARS else line[: ERROR_CHARS - 1] + "…"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
              for r in rows]
    return "\n".join(lines)


# Dead map instances whose errors `runs show` lists (the rest are counted).
SHOWN_DEAD_INSTANCES: Final = 5


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {status}" for status, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def _describe(run: RunInfo) -> str:
    head = f"run {run.run_id}  {run.task}  {run.status}"
    if run.cancel_requested and run.finished_at is None:
        head += " (a running step was asked to stop; it creates no successor)"
    lines = [head, f"created {_when(run.created_at)}  finished {_when(run.finished_at)}"]
    if run.idempotency_key is not None:
        lines.append(f"idempotency key {run.idempotency_key}")
    if run.status == "succeeded":
        lines.append(f"result {json.dumps(run.result)}")
    by_step = {g.step: g for g in run.graph}
    rows: list[list[str]] = []
    dead_instances = []
    mapped_shown: set[str] = set()
    for s in run.steps:
        group = by_step.get(s.step)
        if s.map_index is not None and group is not None:
            if s.status == "dead":
                dead_instances.append(s)
            if s.step in mapped_shown:
                continue
            mapped_shown.add(s.step)
            rows.append([str(s.index), f"{s.step} ×{group.instances}",  # noqa: RUF001
                         _counts(group.counts),
                         str(group.attempts), s.queue, "-", "-", "",
                         ", ".join(group.parents or ())])
            continue
        rows.append([str(s.index), s.step or "-", s.status, f"{s.attempts}/{s.max_attempts}",
                     s.queue, str(s.job_id), _when(s.finished_at), _error_cell(s.last_error),
                     ", ".join(group.parents or ()) if group else ""])
    lines += ["", _table(["#", "step", "status", "attempts", "queue", "job", "finished",
                          "last error", "after"], rows)]
    for g in run.graph:
        if g.instances is not None:
            lines.append(f"{g.step} ×{g.instances}: {_counts(g.counts)}")  # noqa: RUF001
    for s in dead_instances[:SHOWN_DEAD_INSTANCES]:
        lines.append(f"  {s.step}[{s.map_index}] (job {s.job_id}) dead: "
                     f"{_error_cell(s.last_error)}")
    if len(dead_instances) > SHOWN_DEAD_INSTANCES:
        lines.append(f"  ... and {len(dead_instances) - SHOWN_DEAD_INSTANCES} more dead "
                     "instances (--json lists every row)")
    return "\n".join(lines)


def _emit(as_json: bool, data: dict[str, Any], text: str) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True) if as_json else text)


@click.group()
def runs() -> None:
    """Inspect and control runs (a run is a task's or pipeline's chain of steps)."""


@runs.command("list")
@url_option
@schema_option
@click.option("--status", type=click.Choice(STATUSES), default=None,
              help="Only runs with this status.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 10_000))
@json_option
def list_command(database_url: str | None, schema: str, status: str | None, limit: int,
                 as_json: bool) -> None:
    """List the newest runs, newest first."""
    engine = open_engine(database_url, schema)
    try:
        found = list_runs(engine, status=cast("Status | None", status), limit=limit,
                          schema=schema)
        unserved = unserved_jobs(engine, schema=schema)
    finally:
        engine.dispose()
    rows = [[str(r.run_id), r.task, r.status, f"{r.step_index}:{r.step or '-'}",
             _when(r.created_at), _when(r.finished_at), r.idempotency_key or ""] for r in found]
    text = (_table(["run", "task", "status", "step", "created", "finished", "key"], rows)
            if found else "no runs.")
    for u in unserved:
        text += (f"\nwarning: {u.jobs} due job(s) of task {u.task!r} on queue {u.queue!r} "
                 f"are served by no live worker (oldest due {u.oldest_due_s:,.0f}s ago): start "
                 f"one whose app defines {u.task!r} with --queues including {u.queue!r}.")
    _emit(as_json, {"runs": [r.to_dict() for r in found],
                    "unserved": [u.to_dict() for u in unserved]}, text)


@runs.command("show")
@click.argument("run_id", type=int)
@url_option
@schema_option
@click.option("--app", "app_spec", default=None, metavar="MODULE:APP",
              help="Your app (as for `flowq worker`): shows each step's parents and the run's "
                   "result from its leaves.")
@json_option
def show_command(run_id: int, database_url: str | None, schema: str, app_spec: str | None,
                 as_json: bool) -> None:
    """Show a run and each of its steps (a mapped step's instances aggregated): status,
    attempts, timings, last error, result."""
    if app_spec is not None:
        load_app(app_spec)  # registers its definitions, which `get_run` looks up
    engine = open_engine(database_url, schema)
    try:
        run = get_run(engine, run_id, schema=schema)
    finally:
        engine.dispose()
    _emit(as_json, run.to_dict(), _describe(run))


@runs.command("cancel")
@click.argument("run_id", type=int)
@url_option
@schema_option
@json_option
def cancel_command(run_id: int, database_url: str | None, schema: str, as_json: bool) -> None:
    """Cancel a run: pending steps end cancelled; a running step finishes without a successor."""
    engine = open_engine(database_url, schema)
    try:
        res = cancel_run(engine, run_id, schema=schema, reason="cancelled by `flowq runs cancel`")
    finally:
        engine.dispose()
    if not res.changed:
        summary = f"run {run_id} was already cancelled; nothing changed."
    else:
        parts = []
        if res.cancelled:
            parts.append(f"cancelled pending job(s) {', '.join(map(str, res.cancelled))}")
        if res.cancel_requested:
            parts.append(f"asked running job(s) {', '.join(map(str, res.cancel_requested))} "
                         "to stop after their current attempt")
        summary = f"run {run_id}: " + "; ".join(parts) + "."
    _emit(as_json, res.to_dict(), summary + "\n\n" + _describe(res.run))


@runs.command("retry")
@click.argument("run_id", type=int)
@url_option
@schema_option
@json_option
def retry_command(run_id: int, database_url: str | None, schema: str, as_json: bool) -> None:
    """Retry a dead run from the step that died, keeping the results of the steps before it."""
    engine = open_engine(database_url, schema)
    try:
        res = retry_run(engine, run_id, schema=schema)
    finally:
        engine.dispose()
    _emit(as_json, res.to_dict(),
          (f"run {run_id}: step {res.step or '-'} (job {res.job_id}) runs again.\n\n"
           if len(res.job_ids) <= 1 else
           f"run {run_id}: {len(res.job_ids)} dead steps and instances run again (jobs "
           f"{', '.join(map(str, res.job_ids[:10]))}{', ...' if len(res.job_ids) > 10 else ''})."
           "\n\n")
          + _describe(res.run))
