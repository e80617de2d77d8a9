"""`flowq doctor`: check the database flowq runs on; each finding says what to do.

Runs `flowq.ops.doctor.doctor`: one line per check (OK, WARN or FAIL, what it found), and under a
WARN or FAIL what to do. `--json` prints the checks (stable keys). Exit code 1 when a check
FAILs, else 0; an unreachable database is the usual one-sentence error (exit code 2). A
database without the flowq schema is reported by the `schema` check, not refused.
"""

from __future__ import annotations

import json

import click

from flowq.cli.common import require_url, schema_option, url_option

__all__ = ["LONG_TRANSACTION_S", "doctor"]

# `flowq.ops.doctor.LONG_TRANSACTION_S`, repeated so that --help imports no database library
# (tests/unit/test_cli_startup.py holds the copy to the original).
LONG_TRANSACTION_S = 60.0


@click.command("doctor")
@url_option
@schema_option
@click.option("--long-transaction", "long_transaction_s", type=float,
              default=LONG_TRANSACTION_S, show_default=True, metavar="SECONDS",
              help="Report transactions holding the xmin horizon for longer than this.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (stable keys).")
def doctor(database_url: str | None, schema: str, long_transaction_s: float,
           as_json: bool) -> None:
    """Check schema version, table health, long transactions, autovacuum, LISTEN, pooler
    and clock skew; say what to do about each finding."""
    from flowq.db import create_engine
    from flowq.ops.doctor import doctor as run_doctor

    engine = create_engine(require_url(database_url))
    try:
        checks = run_doctor(engine, schema=schema, long_transaction_s=long_transaction_s)
    finally:
        engine.dispose()
    if as_json:
        click.echo(json.dumps({"checks": [c.to_dict() for c in checks]}, indent=2,
                              sort_keys=True, default=str))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            click.echo(f"{c.level:<4}  {c.name:<{width}}  {c.found}")
            if c.action:
                click.echo(f"{'':<4}  {'':<{width}}  -> {c.action}")
    if any(c.level == "FAIL" for c in checks):
        raise SystemExit(1)
