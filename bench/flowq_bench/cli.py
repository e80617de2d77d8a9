"""`flowq bench`'s command: its options and their defaults, turned into `Options` and a run.

flowq's CLI finds this command (`flowq.cli.bench`) when the flowq-bench distribution is
installed; the contract is docs/benchmarks.md's. Like `flowq demo`, it never reads
FLOWQ_DATABASE_URL or DATABASE_URL: without `--database-url` it starts an embedded
PostgreSQL, with it it creates and drops databases of its own on that server
(`flowq_bench.harness`), and it drops or truncates nothing it did not create.
"""

from __future__ import annotations

import json
import sys

import click

from flowq_bench import DEFAULT_SCENARIOS, SCENARIOS, Options, run_bench

__all__ = ["bench"]


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
              "soak, memory. Default: all but limit, rate, soak and memory.")
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
@click.option("--repeat", type=click.IntRange(1), default=None,
              help="Runs per figure; the table shows median and min-max [default: 3].")
@click.option("--duration", type=click.FloatRange(1.0), default=None,
              help="Seconds the soak runs [default: 600].")
@click.option("--quick", is_flag=True, help="Tiny sizes and one run: checks it works.")
@click.option("--json", "json_out", is_flag=True, help="Print JSON instead of the table.")
@click.option("--json-file", type=click.Path(dir_okay=False), default=None,
              help="Also write the JSON to this file.")
def bench(database_url: str | None, scenarios: tuple[str, ...], n_jobs: int | None,
          processes: int | None, concurrency: int | None, drain_c: str | None,
          retained: int | None, repeat: int | None, duration: float | None, quick: bool, json_out: bool,
          json_file: str | None) -> None:
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
                        ("retained", retained),
                        ("duration", duration)):
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
    table, doc = run_bench(database_url, scenarios or DEFAULT_SCENARIOS, options,
                           progress=lambda m: click.echo(m, err=True, nl=False),
                           tty=sys.stderr.isatty())
    if json_file:
        with open(json_file, "w") as f:
            json.dump(doc, f, indent=2)
    click.echo(json.dumps(doc, indent=2) if json_out else table)
