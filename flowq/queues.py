"""Deprecated: `flowq.queues` was split into `flowq.define.queues` (MAX_LIMIT, QueueConfig, Rate)
and `flowq.ops.queues` (QueueInfo, list_queues, pause, resume); this shim goes in flowq 0.2.
"""

from __future__ import annotations

from flowq.define.queues import MAX_LIMIT, QueueConfig, Rate
from flowq.deprecated import warn_moved
from flowq.ops.queues import QueueInfo, list_queues, pause, resume

__all__ = ["MAX_LIMIT", "QueueConfig", "QueueInfo", "Rate", "list_queues", "pause", "resume"]

warn_moved(__name__, "flowq.define.queues or flowq.ops.queues")
