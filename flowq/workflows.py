"""Deprecated: `flowq.workflows` was split into `flowq.define.workflows` (MAX_MAP_BYTES,
MAX_MAP_ITEMS, Each, each) and `flowq.enqueueing.signals` (PreparedSignal, Signalled,
prepare_signal); this shim goes in flowq 0.2.
"""

from __future__ import annotations

from flowq.define.workflows import MAX_MAP_BYTES, MAX_MAP_ITEMS, Each, each
from flowq.deprecated import warn_moved
from flowq.enqueueing.signals import PreparedSignal, Signalled, prepare_signal

__all__ = ["MAX_MAP_BYTES", "MAX_MAP_ITEMS", "Each", "PreparedSignal", "Signalled", "each",
           "prepare_signal"]

warn_moved(__name__, "flowq.define.workflows or flowq.enqueueing.signals")
