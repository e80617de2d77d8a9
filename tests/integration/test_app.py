"""The registry: definitions fail loudly at import time; enqueue validates against them."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
import tenacity

import flowq
from flowq.define.app import find_definition
from flowq.define.options import RESERVED_OPTIONS


def test_task_is_named_after_its_function_unless_named(app: flowq.FlowQ) -> None:
    @app.task()
    def send(ctx: object, to: str) -> str:
        return f"sent to {to}"

    @app.task(name="billing.charge")
    def charge(ctx: object) -> None: ...

    assert (send.name, charge.name) == ("send", "billing.charge")
    assert app.get("send") is send and "billing.charge" in app
    assert send(None, "bob") == "sent to bob"  # calling the task calls the handler
    assert send.steps[0].name == "send" and send.queue == "default"


def test_pipeline_steps_in_definition_order(app: flowq.FlowQ) -> None:
    onboard = app.pipeline("onboard", queue="signup")

    @onboard.step()
    def create(ctx: object, user_id: int) -> dict[str, int]:
        return {"account_id": 7}

    @onboard.step(queue="mail")
    def welcome(ctx: object, account_id: int) -> None: ...

    assert [s.name for s in onboard.steps] == ["create", "welcome"]
    assert [s.index for s in onboard.steps] == [0, 1]
    assert onboard.first is create and onboard.children(create) == [welcome]
    assert onboard.children(welcome) == [] and welcome.parents == ("create",)
    assert onboard.step_named("welcome") is welcome
    assert (create.queue, welcome.queue) == ("signup", "mail")
    assert app.queues == ["mail", "signup"]


def test_duplicate_names_are_refused(app: flowq.FlowQ) -> None:
    @app.task()
    def dup(ctx: object) -> None: ...

    with pytest.raises(flowq.ConfigurationError, match="already registered"):
        @app.task(name="dup")
        def other(ctx: object) -> None: ...

    with pytest.raises(flowq.ConfigurationError, match="already registered"):
        app.pipeline("dup")

    p = app.pipeline("p")

    @p.step()
    def s(ctx: object) -> None: ...

    with pytest.raises(flowq.ConfigurationError, match="already has a step named 's'"):
        @p.step(name="s")
        def s2(ctx: object) -> None: ...


def test_same_name_in_two_apps_is_fine() -> None:
    a, b = flowq.FlowQ(), flowq.FlowQ(schema="other_schema")

    @a.task(name="shared_name_two_apps")
    def t1(ctx: object) -> None: ...

    @b.task(name="shared_name_two_apps")
    def t2(ctx: object, x: int) -> None: ...

    assert find_definition("shared_name_two_apps", "flowq") is t1
    assert find_definition("shared_name_two_apps", "other_schema") is t2


@pytest.mark.parametrize("option", sorted(RESERVED_OPTIONS))
def test_reserved_option_names_cannot_be_handler_parameters(app: flowq.FlowQ,
                                                            option: str) -> None:
    ns: dict[str, Any] = {}
    exec(f"def handler(ctx, {option}): pass", ns)
    with pytest.raises(flowq.ConfigurationError, match=f"'{option}'.*reserved"):
        app.task()(ns["handler"])
    with pytest.raises(flowq.ConfigurationError, match="reserved"):
        app.pipeline(f"p_{option}").step()(ns["handler"])


def test_schema_is_reserved_because_enqueue_takes_it(app: flowq.FlowQ) -> None:
    # Otherwise `enqueue(task, schema="x")` would be taken as the flowq schema, and the
    # handler's argument silently never given.
    assert {"idempotency_key", "queue", "priority", "run_at", "delay", "schema"} <= RESERVED_OPTIONS


@pytest.mark.parametrize("source", [
    "def handler(): pass",
    "def handler(*, ctx): pass",
    "def handler(*args): pass",
    "def handler(**kwargs): pass",
])
def test_handler_without_ctx_is_refused(app: flowq.FlowQ, source: str) -> None:
    ns: dict[str, Any] = {}
    exec(source, ns)
    with pytest.raises(flowq.ConfigurationError, match="context as its first parameter"):
        app.task()(ns["handler"])


@pytest.mark.parametrize("queue", ["bad queue!", "q" * 64, "a/b", "ü"])
def test_invalid_queue_is_refused_at_definition(app: flowq.FlowQ, queue: str) -> None:
    with pytest.raises(flowq.InvalidQueueError, match="queue name"):
        app.task(name="tq", queue=queue)(lambda ctx: None)
    with pytest.raises(flowq.InvalidQueueError):
        app.pipeline("pq", queue=queue)
    p = app.pipeline("pq_ok")
    with pytest.raises(flowq.InvalidQueueError):
        p.step(name="sq", queue=queue)(lambda ctx: None)
    with pytest.raises(flowq.InvalidQueueError):
        flowq.FlowQ(default_queue=queue)


def test_invalid_names_and_options_are_refused(app: flowq.FlowQ) -> None:
    with pytest.raises(flowq.ConfigurationError, match="name"):
        app.pipeline("has space")
    with pytest.raises(flowq.ConfigurationError, match="name"):
        app.task(name="9starts_with_digit")(lambda ctx: None)
    with pytest.raises(flowq.ConfigurationError, match="timeout"):
        app.task(name="t_timeout", timeout=0)(lambda ctx: None)
    with pytest.raises(flowq.ConfigurationError, match="retry"):
        app.task(name="t_retry", retry=3)(lambda ctx: None)  # type: ignore[arg-type]
    with pytest.raises(flowq.ConfigurationError, match="schema"):
        flowq.FlowQ(schema="Bad-Schema")


def test_check_arguments_names_the_offending_argument(app: flowq.FlowQ) -> None:
    @app.task()
    def greet(ctx: object, name: str, polite: bool = True) -> None: ...

    step = greet.steps[0]
    step.check_arguments({"name": "x"})
    step.check_arguments({"name": "x", "polite": False})
    with pytest.raises(flowq.InvalidArgumentsError, match="'nmae'"):
        step.check_arguments({"nmae": "x"})  # missing `name` too: the typo is named
    with pytest.raises(flowq.InvalidArgumentsError, match="'name'"):
        step.check_arguments({})

    @app.task()
    def open_ended(ctx: object, **anything: Any) -> None: ...

    open_ended.steps[0].check_arguments({"whatever": 1})


def test_enqueue_of_an_empty_pipeline_is_refused(app: flowq.FlowQ, engine: sa.Engine) -> None:
    empty = app.pipeline("empty_pipeline")
    with engine.connect() as conn:
        with pytest.raises(flowq.ConfigurationError, match="no steps"):
            flowq.enqueue(conn, empty)
        with pytest.raises(flowq.ConfigurationError, match="no steps"):
            flowq.enqueue(conn, "empty_pipeline", queue="default")  # by name: the live app knows it
        conn.execute(sa.text("SELECT 1"))
    with pytest.raises(flowq.ConfigurationError, match="no steps"):
        app.check()


def test_pipeline_is_enqueued_at_its_first_step(app: flowq.FlowQ, engine: sa.Engine) -> None:
    flow = app.pipeline("flow", priority=4)

    @flow.step(queue="first_q", retry=flowq.Retry(stop=tenacity.stop_after_attempt(3)))
    def first(ctx: object, x: int) -> dict[str, int]:
        return {"y": x}

    @flow.step()
    def second(ctx: object, y: int) -> None: ...

    with engine.begin() as conn:
        with pytest.raises(flowq.InvalidArgumentsError):
            flowq.enqueue(conn, flow, y=1)  # validated against the first step only
        flowq.enqueue(conn, flow, x=1)
    with engine.connect() as c:
        row = c.execute(sa.text(
            "SELECT task, step, queue, priority, max_attempts FROM flowq.steps")).one()
    assert tuple(row) == ("flow", "first", "first_q", 4, 3)


def test_check_arguments_says_each_complaint_once(app: flowq.FlowQ) -> None:
    @app.task()
    def greet(ctx: object, name: str) -> None: ...

    def message(args: dict[str, Any]) -> str:
        with pytest.raises(flowq.InvalidArgumentsError) as info:
            greet.steps[0].check_arguments(args)
        return str(info.value).partition(f"{greet.steps[0].signature}: ")[2]

    assert message({"name": "x", "extra": 1}) == "unexpected keyword argument(s) 'extra'"
    assert message({"name": "x", "b": 1, "a": 2}) == "unexpected keyword argument(s) 'a', 'b'"
    assert message({"extra": 1}) == ("unexpected keyword argument(s) 'extra'; "
                                     "missing a required argument: 'name'")
    assert message({}) == "missing a required argument: 'name'"


def test_which_steps_a_run_starts_with_is_decided_by_the_pipeline(app: flowq.FlowQ) -> None:
    """`starts_many` (enqueue inserts a row per root; the worker starts a run enqueued by name
    the same way) and `check_start_arguments` (every root, a waiting one with its signal's
    slot) are the one decision both sides use."""
    chain = app.pipeline("chain")

    @chain.step()
    def first(ctx: flowq.Context, n: int) -> dict[str, int]:
        return {"n": n}

    @chain.step()
    def second(ctx: flowq.Context, n: int) -> None: ...

    assert not chain.starts_many
    chain.check_start_arguments({"n": 1})
    with pytest.raises(flowq.InvalidArgumentsError, match="step 'first'"):
        chain.check_start_arguments({"m": 1})

    delayed = app.pipeline("delayed")

    @delayed.step(delay=5)
    def later(ctx: flowq.Context) -> None: ...

    assert delayed.starts_many

    fan = app.pipeline("fan")

    @fan.step(parents=[])
    def left(ctx: flowq.Context, n: int) -> None: ...

    @fan.step(parents=[], wait_for="go")
    def right(ctx: flowq.Context, n: int, go: Any) -> None: ...

    assert fan.starts_many and [s.name for s in fan.roots] == ["left", "right"]
    fan.check_start_arguments({"n": 1}, "arguments for 'fan'")  # `go` arrives with the signal
    right.check_input({"n": 1})
    with pytest.raises(flowq.InvalidArgumentsError, match=r"arguments for 'fan'.*'left'.*'go'"):
        fan.check_start_arguments({"n": 1, "go": 2}, "arguments for 'fan'")


@pytest.mark.parametrize("priority", [40_000, -40_000, True, 1.5, "high"])
def test_a_priority_a_job_cannot_hold_is_refused_when_declared(priority: Any) -> None:
    """A priority out of the smallint's range (or not an integer) fails at definition, with
    the task's name, not at its first enqueue."""
    app = flowq.FlowQ()
    with pytest.raises(flowq.ConfigurationError, match=r"'too_high'.*priority"):
        app.task(name="too_high", priority=priority)(lambda ctx: None)
    with pytest.raises(flowq.ConfigurationError, match=r"'steps'.*priority"):
        app.pipeline("steps", priority=priority)
