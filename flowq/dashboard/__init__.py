"""The web dashboard (`flowq dashboard`, extra `flowq[dashboard]`): queues with charts over
time and a page per queue, workers and what they run, runs, a run's graph, timeline and
attempts, dead letters with a confirmed bulk retry, schedules, batches, signals to a waiting
run; read-only unless actions are enabled behind a token or basic auth. `create_app` gives the ASGI app to mount in your own (docs/observability.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowq.errors import ConfigurationError

if TYPE_CHECKING:
    from flowq.dashboard.app import create_app

__all__ = ["create_app"]

INSTALL_HINT = "the dashboard needs flowq's dashboard extra: pip install 'flowq[dashboard]'"


def __getattr__(name: str) -> Any:
    # Importing flowq.dashboard never fails; using it without the extra says what to install.
    if name == "create_app":
        try:
            from flowq.dashboard.app import create_app
        except ImportError as exc:
            raise ConfigurationError(f"{INSTALL_HINT} ({exc.name or exc} is missing)") from None
        return create_app
    raise AttributeError(name)
