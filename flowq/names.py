"""Names and identifiers flowq accepts, checked in one place: a leaf every layer may import.

- `validate_name(kind, name)`: a task, pipeline, step, schedule or signal name (1-200
  characters: a letter or `_`, then letters, digits, `_`, `-`, `.` or `:`);
- `validate_queue(name)`: a queue name (1-63 letters, digits, `_`, `-`, `.` or `:`);
  `DEFAULT_QUEUE` is "default";
- `validate_schema_name(name)`: the PostgreSQL schema of flowq's tables, a plain lower-case
  identifier; `DEFAULT_SCHEMA` is "flowq";
- `check_id(run_id)`: a run id, a positive 64-bit integer;
- `validate_priority(priority)`: an integer within +-`MAX_PRIORITY` (a `smallint`).

Each raises the error its callers document: ConfigurationError for names given when defining,
InvalidQueueError for a queue, RunNotFoundError for an id that cannot name a run,
InvalidArgumentsError for a priority.
"""

from __future__ import annotations

import re
from typing import Final

from flowq.errors import (
    ConfigurationError,
    InvalidArgumentsError,
    InvalidQueueError,
    RunNotFoundError,
)

__all__ = ["DEFAULT_QUEUE", "DEFAULT_SCHEMA", "MAX_PRIORITY", "check_id", "validate_name",
           "validate_priority", "validate_queue", "validate_schema_name"]

DEFAULT_QUEUE: Final = "default"
DEFAULT_SCHEMA: Final = "flowq"
MAX_PRIORITY: Final = 32767

_QUEUE_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,63}$")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:\-]{0,199}$")
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def validate_queue(queue: object) -> str:
    """Return `queue` if it is a plain queue name, else raise InvalidQueueError."""
    if not isinstance(queue, str) or not _QUEUE_RE.match(queue):
        raise InvalidQueueError(
            f"queue name {queue!r} is not valid: use 1-63 letters, digits, '_', '-', '.' or ':'."
        )
    return queue


def validate_name(kind: str, name: object) -> str:
    """Return `name` if it can name a `kind` ("task", "step", ...), else raise
    ConfigurationError naming the kind."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigurationError(
            f"{kind} name {name!r} is not valid: start with a letter or '_', then letters, "
            "digits, '_', '-', '.' or ':' (at most 200)."
        )
    return name


def validate_schema_name(name: str) -> str:
    """Return `name` if it is a plain lower-case SQL identifier, else raise ConfigurationError."""
    if not isinstance(name, str) or not _IDENTIFIER.match(name):
        raise ConfigurationError(
            f"flowq schema name {name!r} is not a plain identifier "
            "(lower-case letters, digits and '_', not starting with a digit, at most 63)."
        )
    return name


def check_id(run_id: object) -> int:
    """Return `run_id` if it can be a run's id, else raise RunNotFoundError."""
    if isinstance(run_id, bool) or not isinstance(run_id, int):
        raise RunNotFoundError(f"a run id is an integer, got {run_id!r}")
    if not 0 < run_id < 2**63:  # a bigint: anything else would be a database error
        raise RunNotFoundError(f"no run {run_id} exists (run ids are positive 64-bit integers)")
    return run_id


def validate_priority(priority: object) -> int:
    """Return `priority` if it is an integer a job's priority can hold, else raise
    InvalidArgumentsError."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not (
            -MAX_PRIORITY <= priority <= MAX_PRIORITY):
        raise InvalidArgumentsError(
            f"priority must be an integer between {-MAX_PRIORITY} and {MAX_PRIORITY} "
            f"(lower runs first), got {priority!r}"
        )
    return priority
