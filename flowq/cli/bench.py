"""`flowq bench`: the flowq-bench distribution's command when it is installed, else how to get it.

The benchmark is not part of the flowq wheel: it lives in the repository's `bench/` folder as
a distribution of its own (`flowq-bench`, import package `flowq_bench`), which `make bench`
installs beside flowq. When it is importable, `bench` is its click command
(`flowq_bench.cli.bench`, options and contract as docs/benchmarks.md describes); when it is
not, `bench` takes any arguments and answers with one sentence saying how to install it,
exit code 2.
"""

from __future__ import annotations

from typing import Final

import click

from flowq.cli.group import UserError

__all__ = ["INSTALL_HINT", "bench"]

INSTALL_HINT: Final = ("flowq bench needs the flowq-bench package, which is not installed: "
                       "from a clone of flowq's repository run `make bench`, or "
                       "`pip install ./bench` into this environment.")


@click.command("bench", add_help_option=False,
               context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def missing(args: tuple[str, ...]) -> None:
    """Benchmark flowq (needs the flowq-bench package: `make bench` from a clone)."""
    raise UserError(INSTALL_HINT)


def _find() -> click.Command:
    try:
        from flowq_bench.cli import bench as installed
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "flowq_bench":
            raise  # installed, but something it imports is missing: show that
        return missing
    return installed


bench: Final[click.Command] = _find()
