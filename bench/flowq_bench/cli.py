"""`flowq bench`'s command: its options and their defaults, turned into `Options` and a run.

flowq's CLI finds this command (`flowq.cli.bench`) when the flowq-bench distribution is
installed; the contract is docs/benchmarks.md's. Like `flowq demo`, it never reads
FLOWQ_DATABASE_URL or DATABASE_URL: without `--database-url` it starts an embedded
PostgreSQL, with it it creates and drops databases of its own on that server
(`flowq_bench.harness`), and it drops or truncates nothing it did not create.
With `--baseline PYTHON` and/or `--baseline-path DIR` it runs each scenario A B B A against
that other flowq instead (`flowq_bench.versus`), forwarding the options given here.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from flowq_bench import DEFAULT_SCENARIOS, SCENARIOS, Options, run_bench
from flowq_bench.options import BOUNDS, bounded

__all__ = ["bench"]

_F = TypeVar("_F", bound=Callable[..., Any])
# Options `--baseline` does not forward as given: it sets them per invocation itself.
_NOT_FORWARDED = frozenset({"database_url", "scenarios", "repeat", "json_out", "json_file",
                            "baseline", "baseline_path"})


class Bounded(click.ParamType[float]):
    """A number within `options.BOUNDS[option]`; anything else is a usage error in one
    sentence (`options.bounded` decides)."""

    def __init__(self, option: str) -> None:
        self.option = option
        self.name = BOUNDS[option].unit

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> float:
        try:
            return bounded(self.option, str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def _number(option: str, dest: str, help: str, default: str) -> Callable[[_F], _F]:
    """A `Bounded` option whose help ends with its bounds and its default."""
    return click.option(option, dest, type=Bounded(option), default=None,
                        metavar=BOUNDS[option].unit.split()[0].upper(),
                        help=f"{help}: {BOUNDS[option].describe()} [default: {default}].")


@click.command()
@click.option("--database-url", "database_url", metavar="URL", default=None,
              help="PostgreSQL server to create the bench's databases on; the role needs "
              "CREATEDB (default: a fresh embedded server; FLOWQ_DATABASE_URL and "
              "DATABASE_URL are ignored).")
@click.option("--scenario", "scenarios", multiple=True, metavar="NAME",
              help="Run only this scenario (repeatable): drain, drain-session, pipeline, "
              "dag (diamond runs with a join; --jobs counts steps), map (one run mapping "
              "10,000 items, then a join; --jobs sets the items, at most 100,000), limit "
              "(the drain on a queue with concurrency=50 beside the same drain unlimited, "
              "and the most jobs seen running at once), rate (a queue with Rate(200, per=1s) "
              "drained for 10 s: achieved start rate and burst), enqueue, latency, scale, "
              "soak, memory, pressure (a steady load beside an open snapshot, then a scanning "
              "reader), overload (one worker offered 0.5x to 4x its peak), checkpoint (jobs "
              "of 10 checkpoints against a raw loop writing 10 rows in 10 transactions; "
              "--jobs counts rows), sleep (2,000 runs of one ctx.sleep each on one worker, "
              "beside as many no-op jobs delayed as long; --jobs sets the runs), indexes "
              "(EXPLAIN ANALYZE of every feature statement over --rows retained rows; exit "
              "status 1 when one is not index-served). Default: all but limit, rate, soak, "
              "memory, pressure, overload, checkpoint, sleep and indexes.")
@click.option("--jobs", "n_jobs", type=click.IntRange(1), default=None,
              help="Jobs per drain (pipeline: steps; memory: the whole drain) "
              "[default: 50000, memory 1000000; --quick: 300].")
@click.option("--processes", "-p", type=click.IntRange(1, 64), default=None,
              help="Worker processes (and raw loop processes) [default: 2].")
@click.option("--concurrency", "-c", type=click.IntRange(1, 1000), default=None,
              help="Handlers per worker process [default: 128, drain-session 8; --quick: 8].")
@click.option("--drain-c", "drain_c", default=None, metavar="C1,C2",
              help="drain: the concurrencies flowq runs at, each against the same references "
                   "[default: 16,128; -c alone: just that one].")
@click.option("--retained", type=click.IntRange(0), default=None, metavar="N",
              help="scale: finished rows retained beside the pending ones [default: 1,000,000].")
@click.option("--rows", "index_rows", type=click.IntRange(2), default=None, metavar="N",
              help="indexes: finished rows retained in flowq.job_history [default: 10,000,000; "
              "--quick: 20,000].")
@click.option("--repeat", type=click.IntRange(1), default=None,
              help="Runs per figure; the table shows median and min-max [default: 3].")
@_number("--duration", "duration", "How long the soak runs", "600")
@_number("--pressure-phase", "pressure_phase",
         "pressure: how long each of its four phases lasts, the open snapshot's included",
         "30; --quick: 2")
@_number("--pressure-rate", "pressure_rate",
         "pressure: no-op jobs offered to its one worker", "2,000; --quick: 200")
@_number("--pressure-rows", "pressure_rows",
         "pressure: the business table the reader scans", "300,000; --quick: 20,000")
@_number("--overload-phase", "overload_phase",
         "overload: how long each offered load lasts, for each worker placement",
         "20; --quick: 1")
@_number("--sleep-seconds", "sleep_seconds",
         "sleep: how long each run's ctx.sleep (and each reference job's delay) lasts",
         "1; --quick: 0.5")
@click.option("--quick", is_flag=True, help="Tiny sizes and one run: checks it works.")
@click.option("--baseline", "baseline", metavar="PYTHON", default=None,
              type=click.Path(exists=True, dir_okay=False),
              help="Compare with the flowq another interpreter runs (another release, a "
              "branch): each scenario runs A B B A on the same server (A: that flowq, "
              "B: this one, each `python -m flowq bench` with the options given here that "
              "its bench knows), and every figure is printed with both medians, the ratio "
              "B/A and this side's raw references; a scenario or figure the baseline "
              "cannot measure is n/a. --repeat R: ceil(R/2) runs per invocation.")
@click.option("--baseline-path", "baseline_path", metavar="DIR", default=None,
              type=click.Path(exists=True, file_okay=False),
              help="The baseline's flowq checkout: DIR and DIR/bench go on its PYTHONPATH "
              "(e.g. a `git worktree add DIR v0.1.0`); without --baseline this interpreter "
              "runs it.")
@click.option("--json", "json_out", is_flag=True, help="Print JSON instead of the table.")
@click.option("--json-file", type=click.Path(dir_okay=False), default=None,
              help="Also write the JSON to this file.")
@click.pass_context
def bench(ctx: click.Context, database_url: str | None, scenarios: tuple[str, ...], n_jobs: int | None,
          processes: int | None, concurrency: int | None, drain_c: str | None,
          retained: int | None, index_rows: int | None, repeat: int | None, duration: float | None,
          pressure_phase: float | None, pressure_rate: float | None,
          pressure_rows: int | None, overload_phase: float | None,
          sleep_seconds: float | None, quick: bool,
          baseline: str | None, baseline_path: str | None,
          json_out: bool, json_file: str | None) -> None:
    """Benchmark flowq against raw-SQL references on --database-url or an embedded server.

    Every figure is measured beside its reference in the same run, on the same database;
    the embedded server (the default) is durable (fsync on). Creates and drops one database
    per scenario, so the role needs CREATEDB.
    """
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise click.UsageError(f"unknown scenario {unknown[0]!r}; choose from "
                               f"{', '.join(SCENARIOS)}")
    if database_url is not None:
        from flowq.db import normalize_url  # here: --help must not load SQLAlchemy

        normalize_url(database_url)
    options = Options.quick() if quick else Options()
    for knob, value in (("jobs", n_jobs), ("processes", processes),
                        ("concurrency", concurrency), ("repeat", repeat),
                        ("retained", retained), ("index_rows", index_rows),
                        ("duration", duration),
                        ("pressure_phase", pressure_phase),
                        ("pressure_rate", pressure_rate),
                        ("pressure_rows", pressure_rows),
                        ("overload_phase", overload_phase),
                        ("sleep_seconds", sleep_seconds)):
        if value is not None:
            setattr(options, knob, value)
    if drain_c is not None:
        try:
            cs = tuple(int(x) for x in drain_c.split(",") if x.strip())
        except ValueError:
            cs = ()
        if not cs or not all(1 <= c <= 1000 for c in cs):
            raise click.BadParameter("a comma-separated list of concurrencies (1-1000), "
                                     f"e.g. 16,128; got {drain_c!r}", param_hint="--drain-c")
        options.set_drain_concurrency(cs)
    def say(text: str) -> None:
        click.echo(text, err=True, nl=False)

    if baseline is not None or baseline_path is not None:
        table, doc = _versus(ctx, database_url, scenarios or DEFAULT_SCENARIOS,
                             options.repeat, (baseline, baseline_path), say)
    else:
        table, doc = run_bench(database_url, scenarios or DEFAULT_SCENARIOS, options,
                               progress=say, tty=sys.stderr.isatty())
    if json_file:
        with open(json_file, "w") as f:
            json.dump(doc, f, indent=2)
    click.echo(json.dumps(doc, indent=2) if json_out else table)
    if any(row.get("extra", {}).get("not_served")
           for row in doc.get("scenarios", {}).get("indexes", [])):
        sys.exit(1)  # a statement the indexes scenario found not index-served: the table says


def _given(ctx: click.Context) -> list[str]:
    """The options typed on the command line, as long options with their values, but those
    `--baseline` sets itself (`_NOT_FORWARDED`)."""
    argv: list[str] = []
    for param in ctx.command.params:
        name = param.name or ""
        if (name in _NOT_FORWARDED or not isinstance(param, click.Option)
                or ctx.get_parameter_source(name) is not ParameterSource.COMMANDLINE):
            continue
        flag = next(o for o in param.opts if o.startswith("--"))
        value = ctx.params[name]
        if param.is_flag:
            argv += [flag] if value else []
        else:
            argv += [flag, str(value)]
    return argv


def _versus(ctx: click.Context, url: str | None, names: Sequence[str], repeat: int,
            baseline: tuple[str | None, str | None], say: Callable[[str], None]
            ) -> tuple[str, dict[str, Any]]:
    from flowq_bench.versus import BaselineError, run_versus

    if baseline[0] is not None and not os.access(baseline[0], os.X_OK):
        raise click.BadParameter(f"{baseline[0]} is not executable: give the path of a Python "
                                 "interpreter.", param_hint="--baseline")
    try:
        return run_versus(url, names, _given(ctx), repeat, baseline, say)
    except BaselineError as exc:
        raise click.UsageError(str(exc)) from None
