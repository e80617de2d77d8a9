"""Deprecated: `flowq.runs` is `flowq.ops.runs`, the same module; this alias goes in flowq 0.2."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowq.deprecated import alias

if TYPE_CHECKING:
    from flowq.ops.runs import *  # noqa: F403
else:
    alias(__name__, "flowq.ops.runs")
