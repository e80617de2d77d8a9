"""The error tree: every raise names a specific type drawn in errors.py, and each is public."""

from __future__ import annotations

import ast
from pathlib import Path

import flowq
from flowq import errors

ROOT = Path(flowq.__file__).parent


def test_no_module_raises_the_root_error_itself() -> None:
    """`FlowqError` is what a caller catches to catch everything; a raise names the subclass
    that says what went wrong, so a caller can catch just that."""
    bare = sorted(
        f"{path.relative_to(ROOT.parent)}:{node.lineno}"
        for path in ROOT.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
        and isinstance(node.exc.func, ast.Name) and node.exc.func.id == "FlowqError")
    assert not bare, "raise a subclass from flowq.errors instead: " + ", ".join(bare)


def test_every_error_is_drawn_in_the_tree_and_exported() -> None:
    tree = errors.__doc__ or ""
    for name in errors.__all__:
        value = getattr(errors, name)
        if isinstance(value, type) and issubclass(value, errors.FlowqError):
            assert name in tree, f"{name} is not drawn in flowq.errors' docstring"
        assert getattr(flowq, name) is value, f"flowq.{name} is not exported"
