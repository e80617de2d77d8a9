"""Structured log lines for the worker: `key=value` text or one JSON object per line.

Every job line carries `job_id`, `run_id`, `task`, `step`, `attempt` and, when it ran,
`duration_ms`. Failures, retries (with their delay), dead jobs and reaped jobs are logged at
WARNING or above, always; the per-job success line is INFO and can be switched off
(`--no-job-log`) so it costs no throughput.

The fields travel twice, so that no logging setup loses them: as attributes of the record
(`extra=`, for structured handlers) and in the message itself (`record.getMessage()` is
`event key=value ...`), so an application's own `logging.basicConfig()`, pytest's caplog or
a framework's handler print the job id, task and error too. `configure_logging()` (also
`flowq.configure_logging`) installs flowq's own text or JSON formatter on the `flowq` logger;
the JSON formatter writes the bare event and the fields as keys.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Literal, TextIO

__all__ = ["DEBUG", "ERROR", "INFO", "LOGGER_NAME", "WARNING", "Event", "configure_logging", "log_event",
           "logger"]

DEBUG, INFO, WARNING, ERROR = logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR
LOGGER_NAME = "flowq"
logger = logging.getLogger(LOGGER_NAME)

_STD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class Event:
    """A log message that renders as `event key=value ...`; `.event` is the bare event."""

    __slots__ = ("event", "fields")

    def __init__(self, event: str, fields: dict[str, Any]) -> None:
        self.event = event
        self.fields = fields

    def __str__(self) -> str:
        if not self.fields:
            return self.event
        return self.event + " " + " ".join(f"{k}={_text(v)}" for k, v in self.fields.items())


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields of `record`: its Event's, else what `extra=` set on it."""
    if isinstance(record.msg, Event):
        return record.msg.fields
    return {k: v for k, v in record.__dict__.items() if k not in _STD}


def _bare(record: logging.LogRecord) -> tuple[str, bool]:
    """(the message without fields, whether the fields were in the message)."""
    if isinstance(record.msg, Event):
        return record.msg.event, True
    return record.getMessage(), False


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        fields = " ".join(f"{k}={_text(v)}" for k, v in _fields(record).items())
        line = f"{ts}.{int(record.msecs):03d}Z {record.levelname:<7} {_bare(record)[0]}"
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
            "event": _bare(record)[0],
        }
        data.update(_fields(record))
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)


def configure_logging(fmt: Literal["text", "json"] = "text", level: str = "INFO",
                      stream: TextIO | None = None) -> None:
    """Send flowq's logs (the `flowq` logger) to `stream` (default stderr) in `fmt`, `text`
    (`key=value`) or `json` (one object per line), at `level`; replaces flowq's handlers, so
    calling it again is harmless. Not needed for flowq's fields to show: every message
    carries them."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_JSONFormatter() if fmt == "json" else _TextFormatter())
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False


def log_event(level: int, event: str, **fields: Any) -> None:
    """Log `event` with structured `fields` (skipped cheaply when the level is off)."""
    if logger.isEnabledFor(level):
        extra = fields
        if not _STD.isdisjoint(fields):
            # `extra=` may not set a LogRecord's own attributes (logging raises KeyError): a
            # field named `created`, `name`, `args`... travels as the attribute `<name>_`, and
            # flowq's formatters, which read the fields from the Event, keep its own name.
            extra = {f"{k}_" if k in _STD else k: v for k, v in fields.items()}
        logger.log(level, Event(event, fields), extra=extra)
