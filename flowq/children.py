"""Deprecated: `flowq.children` is `flowq.durable.children`, the same module; this alias goes in flowq 0.2."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowq.deprecated import alias

if TYPE_CHECKING:
    from flowq.durable.children import *  # noqa: F403
else:
    alias(__name__, "flowq.durable.children")
