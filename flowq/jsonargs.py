"""Checking that values are JSON that `jsonb` stores and gives back unchanged.

flowq never pickles. Arguments and step results travel as JSON; this module refuses, with the
path of the offending value, anything `jsonb` would reject or silently change: NaN and
Infinity, NUL characters and lone surrogates in strings, non-string dict keys, and types
that are not JSON at all (datetimes, sets, bytes, ORM instances, ...). Tuples are accepted
and come back as lists: JSON has no tuple.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["JSONError", "dumps_checked", "find_json_problem"]

_MAX_DEPTH = 100


class JSONError(ValueError):
    """A value is not storable as jsonb; the message names where and why."""


def _string_problem(s: str) -> str | None:
    if "\x00" in s:
        return "contains a NUL character, which PostgreSQL cannot store"
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return "contains a lone surrogate, which is not valid UTF-8"
    return None


def find_json_problem(value: Any, path: str, depth: int = 0) -> str | None:
    """Describe the first part of `value` that jsonb cannot round-trip, or return None."""
    if depth > _MAX_DEPTH:
        return f"{path} is nested more than {_MAX_DEPTH} levels deep"
    if value is None or value is True or value is False:
        return None
    t = type(value)
    if isinstance(value, str):
        problem = _string_problem(value)
        return f"{path} {problem}" if problem else None
    if t is int:
        return None
    if t is float:
        if math.isnan(value) or math.isinf(value):
            return f"{path} is {value!r}, which JSON cannot represent"
        return None
    if isinstance(value, Mapping) and isinstance(value, dict):
        for k, v in value.items():
            if type(k) is not str:
                return (f"{path} has the key {k!r} of type {type(k).__name__}: "
                        "JSON object keys must be strings")
            problem = _string_problem(k)
            if problem:
                return f"{path} has a key that {problem}"
            found = find_json_problem(v, f"{path}[{k!r}]", depth + 1)
            if found:
                return found
        return None
    if t is list or t is tuple:
        for i, v in enumerate(value):
            found = find_json_problem(v, f"{path}[{i}]", depth + 1)
            if found:
                return found
        return None
    if isinstance(value, bool | int) and not isinstance(value, float):
        return None  # int subclasses such as IntEnum serialise as plain numbers
    return (f"{path} is a {t.__module__}.{t.__qualname__}, which is not JSON "
            "(use str, int, float, bool, None, list or dict; convert it first, e.g. to an ISO "
            "string or an id)")


def dumps_checked(value: Any, what: str) -> str:
    """Serialise `value` to compact JSON text, or raise JSONError naming `what` and the path."""
    problem = find_json_problem(value, what)
    if problem:
        raise JSONError(problem)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
