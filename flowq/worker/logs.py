"""Structured log lines for the worker: `key=value` text or one JSON object per line.

Every job line carries `job_id`, `run_id`, `task`, `step`, `attempt` and, when it ran,
`duration_ms`. Failures, retries (with their delay), dead jobs and reaped jobs are logged at
WARNING or above, always; the per-job success line is INFO and can be switched off
(`--no-job-log`) so it costs no throughput.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Literal

__all__ = ["ERROR", "INFO", "LOGGER_NAME", "WARNING", "configure_logging", "log_event", "logger"]

INFO, WARNING, ERROR = logging.INFO, logging.WARNING, logging.ERROR
LOGGER_NAME = "flowq"
logger = logging.getLogger(LOGGER_NAME)

_STD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        fields = " ".join(f"{k}={_text(v)}" for k, v in record.__dict__.items()
                          if k not in _STD)
        line = f"{ts}.{int(record.msecs):03d}Z {record.levelname:<7} {record.getMessage()}"
        if fields:
            line += " " + fields
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _text(v: Any) -> str:
    s = str(v)
    return json.dumps(s) if (not s or any(c in s for c in ' "=\n')) else s


class _JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        data.update({k: v for k, v in record.__dict__.items() if k not in _STD})
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)


def configure_logging(fmt: Literal["text", "json"] = "text", level: str = "INFO") -> None:
    """Send flowq's logs to stderr in `fmt`; idempotent."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JSONFormatter() if fmt == "json" else _TextFormatter())
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False


def log_event(level: int, event: str, **fields: Any) -> None:
    """Log `event` with structured `fields` (skipped cheaply when the level is off)."""
    if logger.isEnabledFor(level):
        logger.log(level, event, extra=fields)
