"""`flowq deploy-check MODULE:APP`: could this code continue every run in flight?

Runs `flowq.ops.deploy.check_deploy` with the app's definitions (every version of every
pipeline) against `--database-url`: per pipeline, compatible, or which runs (how many, the
oldest, an example run id) it could not continue and why, and what the live workers serve.
The app is named as for every command: `MODULE:APP`, `--app MODULE:APP`, or FLOWQ_APP.
`--json` prints the report (stable keys). Exit code 0 when every run in flight can
continue, 1 when some cannot (for CI, before the deploy); a usage or database error is the
usual one-sentence error (exit code 2).
"""

from __future__ import annotations

import json

import click

from flowq.cli.common import app_parameters, load_app, open_engine, url_option

__all__ = ["deploy_check"]


@click.command("deploy-check")
@app_parameters("The app whose code to check", required=True)
@url_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON (stable keys).")
def deploy_check(app_spec: str, database_url: str | None, as_json: bool) -> None:
    """Check that MODULE:APP's code can continue every run in flight; exit 1 if not."""
    from flowq.ops.deploy import check_deploy

    app = load_app(app_spec)
    engine = open_engine(database_url, app.schema)
    try:
        report = check_deploy(engine, app)
    finally:
        engine.dispose()
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2, sort_keys=True, default=str))
    else:
        for line in report.lines() or ["no pipelines and no runs in flight"]:
            click.echo(line)
        click.echo("ok: the code can continue every run in flight" if report.ok else
                   f"not ok: {sum(s.runs for s in report.stranded):,} run(s) could not continue")
    if not report.ok:
        raise SystemExit(1)
