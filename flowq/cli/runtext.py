"""A run as `flowq runs` prints it for people: `describe` (its steps, failed attempts,
progress, checkpoints, parent and children) and the cells of its tables (`when_text`,
`error_cell`, `counts_text`).

Times are this machine's local time; errors and user-given text are cut to `ERROR_CHARS` on
one line; long sections show their first few entries and count the rest (`--json` has them
all): `SHOWN_DEAD_INSTANCES` (5), `SHOWN_CHECKPOINTS` (20), `SHOWN_CHILDREN` (20),
`SHOWN_PROGRESS` (5). Like every command module, it imports no database library.
"""

from __future__ import annotations

import contextlib
import json
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final

from flowq.cli.common import table
from flowq.storable import first_line

if TYPE_CHECKING:
    from flowq.ops.runs import RunInfo

__all__ = ["ERROR_CHARS", "counts_text", "describe", "error_cell", "when_text"]

ERROR_CHARS: Final = 70


def when_text(value: datetime | None) -> str:
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def error_cell(text: str | None, earlier: bool = False) -> str:
    line = first_line(text or "")
    if earlier and line:  # the step succeeded after it: not why the step ended
        line = f"(earlier attempt) {line}"
    return line if len(line) <= ERROR_CHARS else line[: ERROR_CHARS - 1] + "…"


# Dead map instances whose errors `runs show` lists (the rest are counted).
SHOWN_DEAD_INSTANCES: Final = 5
# Checkpoints `runs show` lists (the rest are counted; --json has them).
SHOWN_CHECKPOINTS: Final = 20
SHOWN_CHILDREN: Final = 20  # of the run's children (--json has up to CHILDREN_SHOWN)


def counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {status}" for status, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def describe(run: RunInfo) -> str:
    """What `flowq runs show` prints of `run` (and `cancel`, `retry`, `fork` after acting)."""
    head = f"run {run.run_id}  {run.task}  {run.status}"
    if run.cancel_requested and run.finished_at is None:
        head += " (a running step was asked to stop; it creates no successor)"
    lines = [head, f"created {when_text(run.created_at)}  finished {when_text(run.finished_at)}"]
    if run.idempotency_key is not None:
        lines.append(f"idempotency key {run.idempotency_key}")
    if run.forked_from is not None:
        lines.append(f"forked from run {run.forked_from} (`flowq runs show {run.forked_from}`)")
    if run.deadline is not None:
        lines.append(f"deadline {when_text(run.deadline)}")
    if run.fingerprint is not None:
        from flowq.define.shape import short  # here: `--help` imports no definitions

        version = "an unrecorded version" if run.version is None else f"version {run.version}"
        lines.append(f"started on {version} ({short(run.fingerprint)})")
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
                         counts_text(group.counts),
                         str(group.attempts), s.queue, "-", "-", "",
                         ", ".join(group.parents or ())])
            continue
        rows.append([str(s.index), s.step or "-", s.status, f"{s.attempts}/{s.max_attempts}",
                     s.queue, str(s.job_id), when_text(s.finished_at),
                     error_cell(s.last_error, s.last_error_earlier),
                     ", ".join(group.parents or ()) if group else ""])
    lines += ["", table(["#", "step", "status", "attempts", "queue", "job", "finished",
                          "last error", "after"], rows)]
    for g in run.graph:
        if g.instances is not None:
            lines.append(f"{g.step} ×{g.instances}: {counts_text(g.counts)}")  # noqa: RUF001
    for s in dead_instances[:SHOWN_DEAD_INSTANCES]:
        lines.append(f"  {s.step}[{s.map_index}] (job {s.job_id}) dead: "
                     f"{error_cell(s.last_error)}")
    if len(dead_instances) > SHOWN_DEAD_INSTANCES:
        lines.append(f"  ... and {len(dead_instances) - SHOWN_DEAD_INSTANCES} more dead "
                     "instances (--json lists every row)")
    lines += _progress_lines(run)
    # The attempts that failed (kept in attempt_log), of the steps that are not mapped.
    failed = [(s, a) for s in run.steps if s.map_index is None for a in s.history if a.error]
    if failed:
        lines += ["", "failed attempts:"]
        lines += [f"  {s.step or '-'} attempt {a.attempt}: started {when_text(a.started_at)} on "
                  f"{a.worker or '-'}: {error_cell(a.error)}" for s, a in failed]
    lines += _checkpoint_lines(run)
    lines += _family_lines(run)
    return "\n".join(lines)


def _family_lines(run: RunInfo) -> list[str]:
    """The run's parent and children (`ctx.start_child`): `flowq runs show ID` of each."""
    out = []
    if run.parent is not None:
        p = run.parent
        where = p.step if p.map_index is None else f"{p.step}[{p.map_index}]"
        out += ["", f"parent: run {p.run_id} (step {error_cell(json.dumps(where))}, "
                    f"{p.name})"]
    if run.children:
        out += ["", f"children ({len(run.children)}):"]
        for c in run.children[:SHOWN_CHILDREN]:
            where = c.step if c.map_index is None else f"{c.step}[{c.map_index}]"
            out.append(f"  run {c.run_id} {c.status or 'gone'} (from step "
                       f"{error_cell(json.dumps(where))}, {c.name})  {when_text(c.created_at)}")
        if len(run.children) > SHOWN_CHILDREN:
            out.append(f"  ... and {len(run.children) - SHOWN_CHILDREN} more "
                       "(--json lists them)")
    return out


def _checkpoint_lines(run: RunInfo) -> list[str]:
    """The checkpoints section: names and results are the user's, so they are printed as
    JSON (no control character reaches the terminal) and cut."""
    if not run.checkpoints:
        return []
    out = ["", "checkpoints:"]
    for c in run.checkpoints[:SHOWN_CHECKPOINTS]:
        where = c.step if c.map_index is None else f"{c.step}[{c.map_index}]"
        position = "-" if c.position < 0 else str(c.position)
        out.append(f"  {where} #{position} {error_cell(json.dumps(c.name))}: "
                   f"{error_cell(json.dumps(c.result))}  {when_text(c.created_at)}")
    if len(run.checkpoints) > SHOWN_CHECKPOINTS:
        out.append(f"  ... and {len(run.checkpoints) - SHOWN_CHECKPOINTS} more "
                   "(--json lists them)")
    return out
# Steps whose `ctx.progress` `runs show` prints (the rest are counted; --json has them all).
SHOWN_PROGRESS: Final = 5


def _number(value: float) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:,.6g}"


def _progress_text(progress: dict[str, Any]) -> str:
    """`3/10 (30%) message, at TIME` from a step's stored progress (written by a worker:
    any JSON, so every part is read defensively)."""
    done: Any = progress.get("done")
    total: Any = progress.get("total")
    known = isinstance(done, int | float) and not isinstance(done, bool)
    text = _number(done) if known else "?"
    if isinstance(total, int | float) and not isinstance(total, bool):
        text += f"/{_number(total)}"
        if known and total > 0:
            with contextlib.suppress(OverflowError):
                text += f" ({100 * float(done) / float(total):.0f}%)"
    message = progress.get("message")
    if isinstance(message, str) and message:
        text += f" {error_cell(message)}"
    at = progress.get("at")
    if isinstance(at, str):
        with contextlib.suppress(ValueError):
            text += f", at {when_text(datetime.fromisoformat(at))}"
    return text


def _progress_lines(run: RunInfo) -> list[str]:
    reported = [s for s in run.steps if s.progress]
    if not reported:
        return []
    lines = ["", "progress:"]
    lines += [f"  {s.step or '-'}{'' if s.map_index is None else f'[{s.map_index}]'} "
              f"(job {s.job_id}, {s.status}): {_progress_text(s.progress or {})}"
              for s in reported[:SHOWN_PROGRESS]]
    if len(reported) > SHOWN_PROGRESS:
        lines.append(f"  ... and {len(reported) - SHOWN_PROGRESS} more (--json lists them)")
    return lines
