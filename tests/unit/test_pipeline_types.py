"""A step's declared return type against what the next step takes, checked when the
pipeline is built (`flowq.define.typecheck`): a certain misfit is a ConfigurationError that
names both steps, the parameter and the types; Any, unannotated, generic or unresolvable
annotations are never one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict, TypeVar

import pytest

import flowq
from flowq.define.typecheck import declared_types

if TYPE_CHECKING:
    from decimal import Decimal  # never imported at run time: an unresolvable annotation

T = TypeVar("T")


class Order(TypedDict):
    order_id: int
    note: str


class Account(TypedDict):  # module level: annotations are strings, resolved in the globals
    account_id: int
    email: str


class Partial(TypedDict, total=False):
    order_id: int


def _pipeline() -> flowq.Pipeline:
    return flowq.FlowQ().pipeline("p")


def _refused(first: Callable[..., Any], second: Callable[..., Any], match: str,
             **options: Any) -> None:
    p = _pipeline()
    p.step()(first)
    with pytest.raises(flowq.ConfigurationError, match=match):
        p.step(**options)(second)
    assert [s.name for s in p.steps] == [first.__name__]


def _accepted(first: Callable[..., Any], second: Callable[..., Any], **options: Any) -> None:
    p = _pipeline()
    p.step()(first)
    p.step(**options)(second)
    assert [s.name for s in p.steps] == [first.__name__, second.__name__]


# -- what certainly does not fit ---------------------------------------------------------


def test_a_step_returning_a_non_dict_before_a_chained_step() -> None:
    def count(ctx: flowq.Context) -> int:
        return 1

    def ship(ctx: flowq.Context, order: str) -> None: ...

    _refused(count, ship, r"step 'count' is declared to return int, but a step followed by "
                          r"'ship' must return a dict \(its keyword arguments\) or None")


def test_a_typeddict_without_a_key_the_next_step_requires() -> None:
    def create(ctx: flowq.Context) -> Order:
        return {"order_id": 1, "note": ""}

    def ship(ctx: flowq.Context, order_id: int, address: str, note: str = "") -> None: ...

    _refused(create, ship, r"step 'ship' requires 'address', but Order \(what step 'create' "
                           r"is declared to return\) has no such key")


def test_a_typeddict_value_of_the_wrong_type() -> None:
    def create(ctx: flowq.Context) -> Order:
        return {"order_id": 1, "note": ""}

    def ship(ctx: flowq.Context, order_id: str, note: str) -> None: ...

    _refused(create, ship, r"step 'ship' takes order_id: str, but key 'order_id' of Order "
                           r"\(what step 'create' is declared to return\) is int")


def test_a_typeddict_key_the_next_step_does_not_take() -> None:
    def create(ctx: flowq.Context) -> Order:
        return {"order_id": 1, "note": ""}

    def ship(ctx: flowq.Context, order_id: int) -> None: ...

    _refused(create, ship, r"Order \(what step 'create' is declared to return\) has key\(s\) "
                           r"'note', which step 'ship' .* does not take")


def test_none_before_a_step_that_requires_arguments() -> None:
    def notify(ctx: flowq.Context) -> None: ...

    def ship(ctx: flowq.Context, order_id: int) -> None: ...

    _refused(notify, ship, r"step 'notify' is declared to return None, so step 'ship' is "
                           r"called without arguments, but it requires 'order_id'")


def test_a_join_parameter_of_the_wrong_type() -> None:
    p = _pipeline()

    @p.step()
    def start(ctx: flowq.Context) -> dict[str, Any]:
        return {}

    @p.step(parents=[start])
    def price(ctx: flowq.Context) -> float:
        return 1.0

    @p.step(parents=[start])
    def label(ctx: flowq.Context) -> str:
        return ""

    with pytest.raises(flowq.ConfigurationError,
                       match=r"step 'join' takes price: int, the result of its parent 'price', "
                             r"but step 'price' is declared to return float"):
        @p.step(parents=[price, label])
        def join(ctx: flowq.Context, price: int, label: str) -> None: ...


def test_a_union_none_of_whose_members_fit() -> None:
    def create(ctx: flowq.Context) -> Order:
        return {"order_id": 1, "note": ""}

    def ship(ctx: flowq.Context, order_id: str | list[int], note: str) -> None: ...

    _refused(create, ship, r"takes order_id: str \| list\[int\]")


# -- what may fit is accepted ----------------------------------------------------------------


def test_the_documented_chain_and_fitting_typeddicts() -> None:
    def create(ctx: flowq.Context) -> Order:
        return {"order_id": 1, "note": ""}

    def ship(ctx: flowq.Context, order_id: float, note: str | None, extra: int = 0) -> None: ...

    _accepted(create, ship)

    def partial(ctx: flowq.Context) -> Partial:
        return {}

    def optional(ctx: flowq.Context, order_id: int = 0) -> None: ...

    _accepted(partial, optional)

    def anything(ctx: flowq.Context, **kwargs: Any) -> None: ...

    _accepted(create, anything)


def test_a_waiting_step_gets_its_signal_whatever_the_parent_returns() -> None:
    def notify(ctx: flowq.Context) -> None: ...

    def approve(ctx: flowq.Context, approval: dict[str, Any]) -> None: ...

    _accepted(notify, approve, wait_for="approval")


@pytest.mark.parametrize("returns", [
    Any, object, dict, dict[str, int], Mapping[str, Any], Order | None, "T", "Decimal",
    "NoSuchName", Order | int, Literal["x"] | dict[str, Any],
])
def test_nothing_unknown_is_refused(returns: Any) -> None:
    def start(ctx: flowq.Context) -> None: ...

    start.__annotations__["return"] = returns

    def ship(ctx: flowq.Context, order_id: int, address: str) -> None: ...

    _accepted(start, ship)


def test_unannotated_and_unresolvable_steps_are_accepted() -> None:
    def bare(ctx):  # type: ignore[no-untyped-def]
        return 1

    def ship(ctx: flowq.Context, order_id: int) -> None: ...

    _accepted(bare, ship)

    def lazy(ctx: flowq.Context) -> Decimal:  # the name exists only for a type checker
        raise NotImplementedError

    _accepted(lazy, ship)
    assert declared_types(lazy) == {"ctx": flowq.Context}


def test_a_map_instance_and_the_join_after_it_are_not_checked_as_a_chain() -> None:
    p = _pipeline()

    @p.step()
    def split(ctx: flowq.Context) -> flowq.Each:
        return flowq.each([{"i": 1}])

    @p.step()
    def square(ctx: flowq.Context, i: int) -> int:  # a map instance: its result is no dict
        return i * i

    @p.step()
    def total(ctx: flowq.Context, square: list[int]) -> None: ...

    assert [s.name for s in p.steps] == ["split", "square", "total"]


def test_a_typed_pipeline_is_checked_the_same_way() -> None:
    app = flowq.FlowQ()

    @app.pipeline(name="orders")
    def create(ctx: flowq.Context, customer: str) -> Order:
        return {"order_id": 1, "note": customer}

    assert app.get("orders") is create and create.first.name == "create"
    with pytest.raises(flowq.ConfigurationError, match=r"step 'ship' takes order_id: str"):
        @create.step()
        def ship(ctx: flowq.Context, order_id: str, note: str) -> None: ...


def test_declared_types_never_raises_on_odd_handlers() -> None:
    class Handler:
        def __call__(self, ctx: flowq.Context, x: int) -> int:
            return x

        __hash__ = None  # type: ignore[assignment]  # neither hashable nor cached

    assert declared_types(functools.partial(print)) == {}
    assert declared_types(Handler()) == {}
    assert declared_types(Handler().__call__)["x"] is int


# -- the pipeline created from its first step ----------------------------------------------


def test_the_decorator_form_names_the_pipeline_after_its_first_step() -> None:
    app = flowq.FlowQ()

    @app.pipeline(queue="signups", priority=2, retry=flowq.Retry(), timeout=5)
    def signup(ctx: flowq.Context, email: str) -> None: ...

    assert app.get("signup") is signup and isinstance(signup, flowq.Pipeline)
    assert (signup.queue, signup.priority) == ("signups", 2)
    assert [(s.name, s.timeout, s.retry_given) for s in signup.steps] == [("signup", 5, True)]
    with pytest.raises(flowq.ConfigurationError, match="already registered"):
        app.pipeline(name="signup")(signup.first.fn)


@pytest.mark.parametrize("options", [{"retry": flowq.Retry()}, {"timeout": 5},
                                     {"name": "other"}])
def test_a_pipeline_by_name_takes_no_first_step_options(options: dict[str, Any]) -> None:
    app = flowq.FlowQ()
    with pytest.raises(flowq.ConfigurationError, match="for a first step"):
        app.pipeline("p", **options)  # type: ignore[call-overload]
    assert "p" not in app


def test_several_roots_are_typed_by_the_first_and_checked_at_enqueue() -> None:
    app = flowq.FlowQ()

    @app.pipeline()
    def fetch(ctx: flowq.Context, url: str, retries: int = 1) -> None: ...

    @fetch.step(parents=[])
    def audit(ctx: flowq.Context, url: str) -> None: ...

    fetch.check_start_arguments({"url": "u"})
    with pytest.raises(flowq.InvalidArgumentsError, match="step 'audit'"):
        fetch.check_start_arguments({"url": "u", "retries": 2})


def test_the_documented_message() -> None:
    """docs/pipelines.md (Types) quotes it: a wrong type is named before a key not taken."""
    app = flowq.FlowQ()

    @app.pipeline(name="signup")
    def create_account(ctx: flowq.Context, email: str) -> Account:
        return {"account_id": 7, "email": email}

    with pytest.raises(flowq.ConfigurationError) as refused:
        @create_account.step()
        def charge(ctx: flowq.Context, account_id: str) -> None: ...

    assert str(refused.value) == (
        "step 'charge' takes account_id: str, but key 'account_id' of Account (what step "
        "'create_account' is declared to return) is int")
    docs = (Path(__file__).parents[2] / "docs" / "pipelines.md").read_text()
    assert " ".join(str(refused.value).split()) in " ".join(docs.split())
