"""The JSON checker: what jsonb stores and gives back unchanged is accepted, the rest refused."""

from __future__ import annotations

import enum
import json
from collections import OrderedDict
from datetime import date, datetime, timezone
from decimal import Decimal
from types import MappingProxyType
from typing import Any
from uuid import UUID

import pytest
import sqlalchemy as sa

from flowq.jsonargs import JSONError, dumps_checked, find_json_problem


class Color(enum.IntEnum):
    RED = 1


class Money(float):
    """A float subclass (numpy.float64 is one): encoded as the float it is."""


class Items(list[Any]):
    pass


ACCEPTED: list[Any] = [
    None, True, False, 0, -7, 10**40, 0.1, 1.0, 1e-7, 5e-324, 1e16, 1e20, -2.5e17,
    1.7976931348623157e308, "", "plain", "ünïcödé ✓ 😀", "line\nbreak\ttab\u2028", "e+5",
    [], {}, [1, "a", None, [True]], {"a": {"b": [1.5, {"c": None}]}},
    OrderedDict(a=1), Color.RED, Money(2.5), Money(1e20), Items([1, Items([2])]),
    "a literal \\u0000 is not a NUL", {"k\\u0000": "\\"}, "\u00e9\u0000"[:1],
]


@pytest.mark.parametrize("value", ACCEPTED, ids=repr)
def test_accepted_values_round_trip_through_jsonb(engine: sa.Engine, value: Any) -> None:
    text = dumps_checked(value, "args")
    with engine.connect() as c:
        back = c.execute(sa.text("SELECT CAST(:j AS jsonb)"), {"j": text}).scalar()
    assert back == json.loads(json.dumps(value))
    assert type(back) is type(json.loads(json.dumps(value)))  # a float stays a float


def test_tuples_become_lists() -> None:
    assert json.loads(dumps_checked({"p": (1, (2, 3))}, "args")) == {"p": [1, [2, 3]]}


def test_output_is_compact_utf8() -> None:
    assert dumps_checked({"a": [1, "é"]}, "args") == '{"a":[1,"é"]}'


@pytest.mark.parametrize(("value", "path", "why"), [
    (datetime(2024, 1, 1, tzinfo=timezone.utc), "args", "datetime"),
    (date(2024, 1, 1), "args", "date"),
    ({1, 2}, "args", "set"),
    (frozenset(), "args", "frozenset"),
    (b"x", "args", "bytes"),
    (bytearray(b"x"), "args", "bytearray"),
    (Decimal("1.5"), "args", "Decimal"),
    (UUID(int=1), "args", "UUID"),
    (object(), "args", "object"),
    (MappingProxyType({}), "args", "mappingproxy"),
    (float("nan"), "args", "nan"),
    (float("inf"), "args", "inf"),
    (float("-inf"), "args", "-inf"),
    ("a\x00b", "args", "NUL"),
    ("\udc80", "args", "surrogate"),
    ({"a": [0, {"b": float("nan")}]}, "args['a'][1]['b']", "nan"),
    ({"a": ("ok", b"no")}, "args['a'][1]", "bytes"),
    ({1: "x"}, "args", "key 1 of type int"),
    ({None: "x"}, "args", "key None"),
    ({("t",): "x"}, "args", "tuple"),
    ({"k\x00": 1}, "args", "NUL"),
    ({"outer": {"\ud800": 1}}, "args['outer']", "surrogate"),
])
def test_rejected_values_name_the_path(value: Any, path: str, why: str) -> None:
    problem = find_json_problem(value, "args")
    assert problem is not None
    assert problem.startswith(path + " ")
    assert why in problem
    with pytest.raises(JSONError) as info:
        dumps_checked(value, "args")
    assert str(info.value) == problem
    assert isinstance(info.value, ValueError)


def test_depth_is_bounded() -> None:
    value: Any = 1
    for _ in range(150):
        value = [value]
    with pytest.raises(JSONError, match="nested more than"):
        dumps_checked(value, "args")


def test_circular_values_are_refused() -> None:
    value: list[Any] = []
    value.append(value)
    with pytest.raises(JSONError, match="nested more than"):
        dumps_checked({"a": value}, "args")


@pytest.mark.parametrize("value", [
    {"a": [1, {"b": {2: "x"}}]},          # a nested non-string key, which json would coerce
    {"a": ["ok", "x\x00"]},               # a NUL deep inside
    {"é": ["\udc80"]},                    # non-ASCII text and a lone surrogate
    {"a": [Money("nan")]},                 # NaN in a float subclass
])
def test_fast_path_misses_nothing(value: Any) -> None:
    """Whatever the one-pass encoder lets through must still be caught, with the path."""
    problem = find_json_problem(value, "args")
    assert problem is not None
    with pytest.raises(JSONError) as info:
        dumps_checked(value, "args")
    assert str(info.value) == problem


def test_first_problem_is_reported() -> None:
    problem = find_json_problem({"a": 1, "b": b"x", "c": {1}}, "args")
    assert problem is not None and problem.startswith("args['b']")
