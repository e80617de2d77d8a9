"""`flowq runs ...`: inspect and control runs (list, show, cancel, retry, fork).

Each command prints a small table for people, or with `--json` one JSON object whose keys
are stable (`RunInfo.to_dict()` and friends in `flowq.runs`), for scripts. Errors are one
sentence on stderr with exit code 2 (an unknown run id, retrying a run that is not dead, a
filter that cannot be read). The SQL lives in `flowq.db`, the logic in
`flowq.ops.runs`; this module parses options and calls it (a run as text:
`flowq.cli.runtext`). Options: `--database-url` (default: FLOWQ_DATABASE_URL, then
DATABASE_URL), `--schema` (default "flowq"), `--json`; `list` and `retry --status dead` also
filter by `--task`, `--queue`, `--since`/`--until` (an ISO time, or a duration ago: 1h, 30m,
2d) and `--limit`; `list` pages with `--before RUN_ID` (it prints the next page's).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Final, cast

import click

from flowq.cli.common import (
    Phase,
    app_parameters,
    load_app,
    open_engine,
    schema_option,
    table,
    url_option,
)
from flowq.cli.group import UserError
from flowq.cli.runtext import describe, when_text
from flowq.errors import InvalidArgumentsError

if TYPE_CHECKING:
    from flowq.db.schema import Status
    from flowq.ops.runs import ForkPlan, KnownNames

__all__ = ["DEFAULT_RETRY_BATCH", "STATUSES", "runs"]

# `flowq.db.schema.STATUSES` and `flowq.ops.runs.DEFAULT_RETRY_BATCH`, repeated so that
# `--help` imports no database library (tests/unit/test_cli_startup.py holds each copy to
# its original); the runs API is imported when a command runs.
STATUSES: Final = ("pending", "running", "succeeded", "dead", "cancelled", "waiting")
DEFAULT_RETRY_BATCH: Final = 500

json_option = click.option("--json", "as_json", is_flag=True,
                           help="Print one JSON object (stable keys) instead of a table.")


def _parse_when(ctx: click.Context, param: click.Parameter,
                value: str | None) -> datetime | timedelta | None:
    """`--since`/`--until`: an ISO 8601 time or a duration ago (`flowq.ops.runs.parse_when`)."""
    if value is None:
        return None
    from flowq.ops.runs import parse_when

    try:
        return parse_when(value)
    except InvalidArgumentsError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


_WHEN_DOC = "an ISO time (no offset: local time) or a duration ago: 90s, 30m, 1h, 2d, 1w"


def _filter_options(fn: Any) -> Any:
    for option in reversed([
        click.option("--task", default=None, metavar="TASK",
                     help="Only runs of this task or pipeline."),
        click.option("--queue", default=None, metavar="QUEUE",
                     help="Only runs with a step on this queue."),
        click.option("--since", metavar="WHEN", default=None, callback=_parse_when,
                     help=f"Only runs created at or after WHEN: {_WHEN_DOC}."),
        click.option("--until", metavar="WHEN", default=None, callback=_parse_when,
                     help="Only runs created before WHEN (same forms as --since)."),
    ]):
        fn = option(fn)
    return fn


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
@_filter_options
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 10_000),
              help="Runs per page.")
@click.option("--before", type=click.IntRange(min=1), default=None, metavar="RUN_ID",
              help="Start below this run id: the next page (printed after each full page).")
@click.option("--version", "version", type=click.IntRange(min=1), default=None, metavar="N",
              help="Only runs started on pipeline version N (with --task: of that pipeline).")
@json_option
def list_command(database_url: str | None, schema: str, status: str | None, task: str | None,
                 queue: str | None, since: datetime | timedelta | None,
                 until: datetime | timedelta | None, limit: int, before: int | None,
                 version: int | None, as_json: bool) -> None:
    """List runs, newest first, a page at a time; filter by status, task, queue and time."""
    from flowq.ops.runs import known_names, list_runs, unserved_jobs

    engine = open_engine(database_url, schema)
    try:
        found = list_runs(engine, status=cast("Status | None", status), task=task,
                          queue=queue, since=since, until=until, before=before,
                          limit=limit + 1, schema=schema, version=version)
        unserved = unserved_jobs(engine, schema=schema)
        known = (known_names(engine, schema=schema)
                 if not found and (task is not None or queue is not None) else None)
    finally:
        engine.dispose()
    next_before = found[limit - 1].run_id if len(found) > limit else None
    found = found[:limit]
    rows = [[str(r.run_id), r.task, r.status, f"{r.step_index}:{r.step or '-'}",
             when_text(r.created_at), when_text(r.finished_at), r.idempotency_key or ""]
            for r in found]
    text = (table(["run", "task", "status", "step", "created", "finished", "key"], rows)
            if found else "no runs." + _no_match_hint(known, task, queue))
    if next_before is not None:
        text += (f"\nmore: the next page is `flowq runs list --before {next_before}` with "
                 "the same filters.")
    for u in unserved:
        text += (f"\nwarning: {u.jobs} due job(s) of task {u.task!r} on queue {u.queue!r} "
                 f"are served by no live worker (oldest due {u.oldest_due_s:,.0f}s ago): start "
                 f"one whose app defines {u.task!r} with --queues including {u.queue!r}.")
    _emit(as_json, {"runs": [r.to_dict() for r in found], "next_before": next_before,
                    "unserved": [u.to_dict() for u in unserved]}, text)


def _no_match_hint(known: KnownNames | None, task: str | None, queue: str | None) -> str:
    """' (no recent run has task 'x': did you mean 'y'?)' for a --task or --queue filter
    that names nothing the database knows of (a typo, most often), else ''."""
    if known is None:
        return ""
    from flowq.define.app import did_you_mean

    hints = []
    for what, name, names in (("task", task, known.tasks), ("queue", queue, known.queues)):
        if name is not None and name not in names:
            hint = did_you_mean(name, names)
            hints.append(f"no recent run has {what} {name!r}" + (f": {hint}" if hint else ""))
    return f" ({'; '.join(hints)})" if hints else ""


@runs.command("show")
@click.argument("run_id", type=int)
@url_option
@schema_option
@app_parameters("An app to import, so that the run shows each step's parents and its "
                "result from its leaves",
                positional=False)
@json_option
def show_command(run_id: int, database_url: str | None, schema: str, app_spec: str | None,
                 as_json: bool) -> None:
    """Show a run and each of its steps (a mapped step's instances aggregated): status,
    attempts, timings, last error, result."""
    if app_spec is not None:
        load_app(app_spec)  # registers its definitions, which `get_run` looks up
    from flowq.ops.runs import get_run

    engine = open_engine(database_url, schema)
    try:
        run = get_run(engine, run_id, schema=schema)
    finally:
        engine.dispose()
    _emit(as_json, run.to_dict(), describe(run))


@runs.command("cancel")
@click.argument("run_id", type=int)
@url_option
@schema_option
@json_option
def cancel_command(run_id: int, database_url: str | None, schema: str, as_json: bool) -> None:
    """Cancel a run: pending steps end cancelled; a running step finishes without a successor."""
    from flowq.ops.runs import cancel_run

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
        if res.child_runs:
            parts.append(f"cancelled {len(res.child_runs)} child run(s) "
                         f"{', '.join(map(str, res.child_runs[:20]))}"
                         f"{' ...' if len(res.child_runs) > 20 else ''}")
        summary = f"run {run_id}: " + "; ".join(parts) + "."
        if res.run.status == "dead":
            summary += " The run itself stays dead (retry it, or leave it)."
    _emit(as_json, res.to_dict(), summary + "\n\n" + describe(res.run))


@runs.command("retry")
@click.argument("run_id", type=int, required=False)
@url_option
@schema_option
@click.option("--status", type=click.Choice(["dead"]), default=None,
              help="Retry every dead run matching the filters (instead of one RUN_ID).")
@_filter_options
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Retry at most this many runs (oldest first).")
@click.option("--batch-size", type=click.IntRange(1, 100_000), default=DEFAULT_RETRY_BATCH,
              show_default=True, help="Runs retried per transaction.")
@json_option
def retry_command(run_id: int | None, database_url: str | None, schema: str,
                  status: str | None, task: str | None, queue: str | None,
                  since: datetime | timedelta | None, until: datetime | timedelta | None,
                  limit: int | None, batch_size: int, as_json: bool) -> None:
    """Retry a dead run from the step that died, keeping the results of the steps before it;
    or, with --status dead, every dead run matching the filters, in batches."""
    from flowq.ops.runs import retry_run, retry_runs

    filters = {"--task": task, "--queue": queue, "--since": since, "--until": until,
               "--limit": limit}
    if run_id is not None and status is not None:
        raise UserError("give either a RUN_ID or --status dead (to retry many runs), not both")
    if run_id is None and status is None:
        raise UserError("give a RUN_ID, or --status dead (with --task, --queue, --since, "
                        "--until, --limit) to retry every dead run that matches")
    if run_id is None:
        engine = open_engine(database_url, schema)
        phase = Phase(f"retrying the dead runs that match, {batch_size:,} per transaction")
        try:
            n = retry_runs(engine, task=task, queue=queue, since=since, until=until,
                           limit=limit, batch_size=batch_size, schema=schema,
                           on_batch=lambda total: phase.update(total, "run(s) retried"))
        finally:
            phase.done()
            engine.dispose()
        _emit(as_json, {"retried": n}, f"retried {n} run(s).")
        return
    given = [name for name, value in filters.items() if value is not None]
    if given:
        raise UserError(f"{', '.join(given)} filter(s) the runs of --status dead; a RUN_ID "
                        "names one run: drop them, or the RUN_ID")
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
          + describe(res.run))


def _fork_text(plan: ForkPlan) -> str:
    """What a fork runs again and reuses, for people (`--json` has it all)."""
    lines = [f"  run the steps {', '.join(map(repr, plan.steps))} with input "
             f"{json.dumps(plan.args)[:200]};"]
    mine = [c for c in plan.checkpoints if c.step == plan.from_step]
    if not mine:
        lines.append(f"  step {plan.from_step!r} recorded no checkpoints there: nothing to reuse.")
    for c in mine:
        what = "reuse  " if c.reused else "RUN AGAIN"
        lines.append(f"  {what:9} {c.kind} {json.dumps(c.name)[:80]} of {c.step!r}")
    later = [c for c in plan.checkpoints if c.step != plan.from_step]
    for c in later[:50]:
        lines.append(f"  RUN AGAIN {c.kind} {json.dumps(c.name)[:80]} of {c.step!r} "
                     "(a later step runs afresh)")
    if len(later) > 50:
        lines.append(f"  ... and {len(later) - 50} more records of later steps (see --json)")
    return "\n".join(lines) + "\n"


@runs.command("fork")
@click.argument("run_id", type=int)
@click.option("--from", "from_step", required=True, metavar="STEP",
              help="The step the new run starts at; the steps before it are not run again.")
@click.option("--args", "args_json", default=None, metavar="JSON",
              help="The step's input as a JSON object, instead of the one the old run "
                   "recorded.")
@click.option("--redo-checkpoints", is_flag=True,
              help="Run the step's recorded checkpoints again (by default the fork reuses "
                   "their recorded results: a charge is not made twice).")
@click.option("--redo-from", "redo_from", default=None, metavar="NAME",
              help="Run checkpoint NAME and those after it again; reuse the ones before it.")
@click.option("--dry-run", is_flag=True,
              help="List what the fork would run again and reuse; change nothing.")
@app_parameters("The app whose code the new run runs", positional=False, required=True)
@url_option
@schema_option
@json_option
def fork_command(run_id: int, from_step: str, args_json: str | None, redo_checkpoints: bool,
                 redo_from: str | None, dry_run: bool, app_spec: str,
                 database_url: str | None, schema: str, as_json: bool) -> None:
    """Start a new run from a step of an ended run, reusing the outputs the steps before it
    recorded and the checkpoints the step recorded; the old run is left as it is, and the
    new one is linked to it."""
    args: dict[str, Any] | None = None
    if args_json is not None:
        try:
            parsed = json.loads(args_json)
        except ValueError as exc:
            raise UserError(f"--args is not JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise UserError(f"--args must be a JSON object of the step's keywords, got "
                            f"{type(parsed).__name__}")
        args = parsed
    load_app(app_spec)
    from flowq.ops.runs import fork, get_run, plan_fork

    engine = open_engine(database_url, schema)
    try:
        if dry_run:
            plan = plan_fork(engine, run_id, from_step=from_step, args=args,
                             redo_checkpoints=redo_checkpoints, redo_from=redo_from,
                             schema=schema, via="cli")
        else:
            forked = fork(engine, run_id, from_step=from_step, args=args,
                          redo_checkpoints=redo_checkpoints, redo_from=redo_from,
                          schema=schema, via="cli")
            new = get_run(engine, forked.run_id, schema=schema)
    finally:
        engine.dispose()
    if dry_run:
        _emit(as_json, {"dry_run": True, **plan.to_dict()},
              f"dry run: nothing was changed. A fork of run {run_id} from step "
              f"{plan.from_step!r} would:\n" + _fork_text(plan))
        return
    _emit(as_json, {**forked.to_dict(), "run": new.to_dict()},
          f"run {forked.run_id} forked from run {run_id} at step {forked.from_step!r}.\n"
          + _fork_text(forked.plan) + "\n" + describe(new))
