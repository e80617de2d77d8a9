"""Checking that values are JSON that `jsonb` stores and gives back unchanged.

flowq never pickles. Arguments and step results travel as JSON; this module refuses, with the
path of the offending value, anything `jsonb` would reject or silently change: NaN and
Infinity, NUL characters and lone surrogates in strings, non-string dict keys, and types
that are not JSON at all (datetimes, sets, bytes, ORM instances, ...). Tuples are accepted
and come back as lists: JSON has no tuple.

jsonb stores numbers as `numeric`, which turns `1e+20` into `100000000000000000000`: a float
that Python writes with a positive exponent (|x| >= 1e16) would come back as an int. Such
floats are written out in full with a `.0` so they come back as the same float. (-0.0 comes
back as 0.0, the one float jsonb cannot keep; they compare equal.)

Speed: `dumps_checked` sits on the enqueue and completion hot paths, so it encodes first with
a strict encoder (refuses NaN and unknown types), walks only the containers for the one thing
the encoder would silently change (non-string keys) and for depth, and scans the text for
NUL and lone surrogates. The path-naming walk, `find_json_problem`, runs only when one of
those says something is wrong, to write the message.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

__all__ = ["JSONError", "dumps_checked", "find_json_problem"]

_MAX_DEPTH = 100
_EXPONENT_FROM = 1e16  # where float.__repr__ switches to exponent notation


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
    if isinstance(value, float):  # numpy.float64 and other subclasses encode as floats
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
    if isinstance(value, list | tuple):
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


def _reject(value: Any) -> Any:
    raise TypeError(f"{type(value).__name__} is not JSON")


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False,
                            default=_reject)
_CONTAINERS = (dict, list, tuple)
_SURROGATE = re.compile("[\ud800-\udfff]")


def _dumps(value: Any) -> str:
    return _ENCODER.encode(value)


def _dumps_keeping_floats(value: Any) -> str:
    """Like `_dumps`, but big floats in positional notation (see the module docstring)."""
    if isinstance(value, float) and abs(value) >= _EXPONENT_FROM:
        # The shortest digits that read back as this float, positionally: an integer here.
        return f"{Decimal(repr(value)):f}.0"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_dumps(k)}:{_dumps_keeping_floats(v)}"
                              for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_dumps_keeping_floats(v) for v in value) + "]"
    return _dumps(value)


def _shape_ok(value: Any, depth: int = 0) -> bool:
    """Only string keys, and no deeper than the limit: what the encoder would not refuse."""
    if depth > _MAX_DEPTH:
        return False
    if isinstance(value, dict):
        for k, v in value.items():
            if type(k) is not str:
                return False
            if isinstance(v, _CONTAINERS) and not _shape_ok(v, depth + 1):
                return False
    elif isinstance(value, list | tuple):
        for v in value:
            if isinstance(v, _CONTAINERS) and not _shape_ok(v, depth + 1):
                return False
    return True


def dumps_checked(value: Any, what: str) -> str:
    """Serialise `value` to compact JSON text, or raise JSONError naming `what` and the path."""
    try:
        text: str | None = _dumps(value)
    except (TypeError, ValueError, RecursionError):  # unknown type, NaN, circular, too deep
        text = None
    if (text is None or not _shape_ok(value) or "\\u0000" in text
            or (not text.isascii() and _SURROGATE.search(text))):
        problem = find_json_problem(value, what)
        if problem:
            raise JSONError(problem)
        if text is None:  # pragma: no cover - the walk accepts nothing the encoder refuses
            raise JSONError(f"{what} cannot be encoded as JSON")
        # else: a false alarm, e.g. a string holding a literal backslash followed by "u0000"
    # The slow path only when an exponent may be present (possibly just inside a string).
    return _dumps_keeping_floats(value) if "e+" in text else text
