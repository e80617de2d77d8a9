"""The definition-time type check of a pipeline's edges: a step's declared return type against
what the step after it takes, so a misfit fails when the pipeline is built (at import),
not in a worker after the steps before it ran.

How a result reaches the next step is the worker's rule (`flowq.worker.graph`), followed
here, never restated differently:

- a step with one parent is called with that parent's result as its keyword arguments: a
  dict, or None for no arguments (anything else ends the step `dead`);
- a step with several parents (a join) gets each parent's result as the keyword named after
  that parent;
- a step waiting for a signal gets the payload under the signal's name (its type is not
  known here, so that parameter is never checked);
- a step mapped with `flowq.each()` gets each item, and the step after it the list of the
  instances' results: a parent that may be mapped (its own parent's return type does not rule
  out `each()`) is not checked.

Conservative: it refuses only what certainly does not fit. A type is compared only when both
sides are made of what JSON carries (`str`, `int`, `float`, `bool`, `None`, `list`/`tuple`,
`dict` and TypedDicts, their generics, unions and Literals); `Any`, `object`, type variables,
other classes, unannotated parameters and annotations that do not resolve (a forward
reference to a `TYPE_CHECKING` import) are never an error. A union is refused only when none
of its members fits. Keys are checked only for a TypedDict: a plain `dict[str, X]` may hold
any key.
"""

from __future__ import annotations

import contextlib
import inspect
import types
import typing
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Literal, Union

from flowq.define.step import Step
from flowq.errors import ConfigurationError

__all__ = ["check_step_types", "declared_types"]

# The classes a value has once stored as JSON and read back, by the declared class: a tuple
# comes back as a list.
_JSON_KINDS: Final[dict[type, type]] = {
    str: str, int: int, float: float, bool: bool, type(None): type(None),
    list: list, tuple: list, dict: dict,
}


# Resolved annotations by handler: a step is looked at as a child and again as each child's
# parent, and resolving string annotations (~50 us a handler) would otherwise be most of the
# time it takes to define a step. Weak, so that a discarded app's handlers are not kept.
_RESOLVED: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


class _Annotations:
    """One annotation to resolve on its own, with a function's globals (`get_type_hints`
    reads any object's `__annotations__`)."""

    def __init__(self, name: str, annotation: object) -> None:
        self.__annotations__ = {name: annotation}


def declared_types(fn: Callable[..., Any]) -> Mapping[str, Any]:
    """The resolved annotations of `fn` ('return' for its return type); the ones that do not
    resolve (a forward reference to a `TYPE_CHECKING` import, a typo) are left out, the
    others kept. Never raises: a handler without annotations has none."""
    try:
        return _RESOLVED[fn]
    except (KeyError, TypeError):  # TypeError: not weakly referable, resolved every time
        pass
    resolved = _resolve(fn)
    with contextlib.suppress(TypeError):
        _RESOLVED[fn] = resolved
    return resolved


def _resolve(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # one bad annotation: resolve the others one by one
        pass
    annotations = getattr(fn, "__annotations__", None)
    if not isinstance(annotations, dict):
        return {}
    namespace = getattr(inspect.unwrap(fn), "__globals__", None)
    resolved: dict[str, Any] = {}
    for name, annotation in annotations.items():
        try:
            resolved.update(typing.get_type_hints(_Annotations(name, annotation),
                                                  globalns=namespace))
        except Exception:  # unresolvable: treated as unannotated
            continue
    return resolved


def _kinds(t: object) -> frozenset[type] | None:
    """The JSON classes a value of declared type `t` arrives as, or None when that is not
    known for certain (then nothing is checked against it)."""
    origin = typing.get_origin(t)
    if origin is Union or origin is types.UnionType:
        members = [_kinds(a) for a in typing.get_args(t)]
        if any(m is None for m in members):
            return None
        return frozenset().union(*typing.cast(list[frozenset[type]], members))
    if origin is Literal:
        values = typing.get_args(t)
        if all(type(v) in (str, int, bool, type(None)) for v in values):
            return frozenset(type(v) for v in values)
        return None
    if origin is not None:  # list[int], dict[str, X], tuple[int, ...]: by their class
        t = origin
    if t is None:
        t = type(None)
    if isinstance(t, type) and _is_typeddict(t):
        return frozenset({dict})
    if isinstance(t, type) and t in _JSON_KINDS:
        return frozenset({_JSON_KINDS[t]})
    return None


def _is_typeddict(t: type) -> bool:
    # typing's and typing_extensions' TypedDicts alike: a dict class with declared keys.
    return issubclass(t, dict) and hasattr(t, "__required_keys__")


def _fits(provided: type, expected: type) -> bool:
    # bool is an int and an int a float to a type checker, and JSON keeps each as it was.
    return provided is expected or (provided is bool and expected in (int, float)) or (
        provided is int and expected is float)


def _misfits(provided: object, expected: object) -> bool:
    """Whether no value of declared type `provided` fits a parameter of type `expected`."""
    given, wanted = _kinds(provided), _kinds(expected)
    if given is None or wanted is None:
        return False
    return not any(_fits(g, w) for g in given for w in wanted)


def _show(t: object) -> str:
    if t is None or t is type(None):
        return "None"
    if isinstance(t, type) and typing.get_origin(t) is None:
        return t.__qualname__
    return repr(t).replace("typing.", "")


def _may_map(step: Step[Any, Any]) -> bool:
    """Whether `step` may return `flowq.each()`: its return type does not rule it out."""
    returns = declared_types(step.fn).get("return", Any)
    return _kinds(returns) is None


def check_step_types(step: Step[Any, Any], parents: Sequence[Step[Any, Any]],
                     step_named: Callable[[str], Step[Any, Any] | None]) -> None:
    """Raise ConfigurationError if what `step`'s parents are declared to return certainly
    does not fit `step`'s parameters (see the module). `step_named` finds a parent's own
    parents (is it a map instance?)."""
    checked = [p for p in parents if not _maybe_mapped(p, step_named)]
    if not checked:
        return
    hints = declared_types(step.fn)
    if len(step.parents) > 1:
        for parent in checked:
            _check_join(step, hints, parent)
    else:
        _check_chain(step, hints, checked[0])


def _maybe_mapped(parent: Step[Any, Any],
                  step_named: Callable[[str], Step[Any, Any] | None]) -> bool:
    # A map instance's child gets the list of the instances' results, not the result.
    if len(parent.parents) != 1:
        return False
    grandparent = step_named(parent.parents[0])
    return grandparent is None or _may_map(grandparent)


def _check_join(step: Step[Any, Any], hints: Mapping[str, Any], parent: Step[Any, Any]) -> None:
    returns = declared_types(parent.fn).get("return")
    param = step.signature.parameters.get(parent.name)
    if returns is None or param is None or parent.name not in hints:
        return
    if _misfits(returns, hints[parent.name]):
        raise ConfigurationError(
            f"step {step.name!r} takes {parent.name}: {_show(hints[parent.name])}, the result "
            f"of its parent {parent.name!r}, but step {parent.name!r} is declared to return "
            f"{_show(returns)} (a step with several parents receives each parent's result "
            "as a keyword named after that parent)")


def _check_chain(step: Step[Any, Any], hints: Mapping[str, Any], parent: Step[Any, Any]) -> None:
    returns = declared_types(parent.fn).get("return")
    if returns is None:
        return
    kinds = _kinds(returns)
    if kinds is None:
        return
    if not kinds & {dict, type(None)}:
        raise ConfigurationError(
            f"step {parent.name!r} is declared to return {_show(returns)}, but a step "
            f"followed by {step.name!r} must return a dict (its keyword arguments) or None")
    params = [p for p in list(step.signature.parameters.values())[1:]
              if p.name != step.wait_for]
    takes = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = [n for n, p in takes.items() if p.default is p.empty]
    if kinds == {type(None)}:
        if required:
            raise ConfigurationError(
                f"step {parent.name!r} is declared to return None, so step {step.name!r} is "
                f"called without arguments, but it requires {', '.join(map(repr, required))}")
        return
    origin = typing.get_origin(returns) or returns
    if not (isinstance(origin, type) and _is_typeddict(origin)):
        return  # a dict of unknown keys
    _check_keys(step, hints, parent, origin, takes, required,
                any(p.kind is p.VAR_KEYWORD for p in params))


def _check_keys(step: Step[Any, Any], hints: Mapping[str, Any], parent: Step[Any, Any],
                returns: type, takes: dict[str, inspect.Parameter], required: list[str],
                any_keyword: bool) -> None:
    """A parent returning a TypedDict: its keys are the step's keyword arguments."""
    keys = declared_types(returns)
    declared = set(getattr(returns, "__required_keys__", ())) | set(
        getattr(returns, "__optional_keys__", ()))
    of = f"{returns.__qualname__} (what step {parent.name!r} is declared to return)"
    missing = [n for n in required if n not in declared]
    if missing:
        raise ConfigurationError(
            f"step {step.name!r} requires {', '.join(map(repr, missing))}, but {of} has no "
            f"such key: a step is called with its parent's result as keyword arguments")
    for name in takes:
        if name in keys and name in hints and _misfits(keys[name], hints[name]):
            raise ConfigurationError(
                f"step {step.name!r} takes {name}: {_show(hints[name])}, but key {name!r} of "
                f"{of} is {_show(keys[name])}")
    unknown = sorted(k for k in getattr(returns, "__required_keys__", ())
                     if k not in takes and k != step.wait_for)
    if unknown and not any_keyword:
        raise ConfigurationError(
            f"{of} has key(s) {', '.join(map(repr, unknown))}, which step {step.name!r} "
            f"{step.signature} does not take")
