"""`flowq runs ...`: inspect and control runs (show, cancel, retry)."""

from __future__ import annotations

import click

__all__ = ["runs"]


@click.group()
def runs() -> None:
    """Inspect and control runs."""
