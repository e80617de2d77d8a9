"""Deprecated: `flowq.context` was split into `flowq.durable.context` (PROGRESS_MESSAGE_CHARS,
Context, progress_of) and `flowq.durable.session` (StepSession, commit_step_session); this shim
goes in flowq 0.2.
"""

from __future__ import annotations

from flowq.deprecated import warn_moved
from flowq.durable.context import PROGRESS_MESSAGE_CHARS, Context, progress_of
from flowq.durable.session import StepSession, commit_step_session

__all__ = ["PROGRESS_MESSAGE_CHARS", "Context", "StepSession", "commit_step_session", "progress_of"]

warn_moved(__name__, "flowq.durable.context or flowq.durable.session")
