"""`flowq runs ...` in-process (click's runner), for the tests of the runs commands."""

from __future__ import annotations

import json
from typing import Any

from click.testing import CliRunner

from flowq.cli import main


def cli(db_url: str, *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["runs", *args, "--database-url", db_url])
    return result.exit_code, result.stdout, result.stderr


def cli_json(db_url: str, *args: str) -> dict[str, Any]:
    code, out, err = cli(db_url, *args, "--json")
    assert code == 0, err
    data: dict[str, Any] = json.loads(out)
    return data
