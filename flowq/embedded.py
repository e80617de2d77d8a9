"""Deprecated: `flowq.embedded` is `flowq.local.postgres`, the same module; this alias goes in flowq 0.2."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowq.deprecated import alias

if TYPE_CHECKING:
    from flowq.local.postgres import *  # noqa: F403
else:
    alias(__name__, "flowq.local.postgres")
