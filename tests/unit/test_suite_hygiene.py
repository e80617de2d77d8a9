"""flowq's own tests use flowq through its public names only, read from the tests' source.

A test that reaches a `_private` name breaks when flowq's insides move, though nothing a
user sees changed; where a test needs a seam, flowq gets a small public one instead. Every
module under tests/ is parsed, and these are reported:

- an import of a private flowq name (`from flowq.x import _y`, `import flowq._x`);
- an attribute `_x` read or set on anything but `self`/`cls` or a module from outside flowq
  (`sys._getframe` is not ours to judge), save the public API of named tuples and rows
  (`_asdict`, `_mapping`, ...);
- `monkeypatch.setattr(obj, "_x", ...)` (and `setattr`/`getattr`/`delattr`) on the same
  terms, and a dotted target string naming a private flowq attribute.

Reading flowq's source text (tests/unit/test_imports.py does) is not using a name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
# The public API of named tuples (and so of SQLAlchemy's Row), underscored to avoid fields.
NAMED_TUPLE_API = frozenset({"_asdict", "_fields", "_field_defaults", "_make", "_mapping",
                             "_replace", "_t", "_tuple"})
SETTERS = frozenset({"setattr", "getattr", "delattr", "hasattr"})


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _root(node: ast.expr) -> str | None:
    """The name an attribute chain or call chain starts from (`a` of `a.b().c`)."""
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _foreign_modules(tree: ast.Module) -> set[str]:
    """Names bound to modules (or their members) from outside flowq: `import sys`,
    `from opentelemetry import trace`, `trace = pytest.importorskip("opentelemetry.trace")`."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).partition(".")[0] for a in node.names
                         if not a.name.startswith("flowq"))
        elif isinstance(node, ast.ImportFrom) and not node.level and not (
                node.module or "").startswith("flowq"):
            names.update(a.asname or a.name for a in node.names)
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
              and isinstance(node.value.func, ast.Attribute)
              and node.value.func.attr == "importorskip" and node.value.args
              and isinstance(node.value.args[0], ast.Constant)
              and not str(node.value.args[0].value).startswith("flowq")):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def private_uses(source: str, filename: str = "<test>") -> Iterator[str]:
    """Each use of a private flowq name in a test module's source, as `line: what`."""
    tree = ast.parse(source, filename)
    foreign = _foreign_modules(tree) | {"self", "cls"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flowq"):
            module = node.module or ""
            for alias in node.names:
                if any(map(_private, module.split("."))) or _private(alias.name):
                    yield f"{node.lineno}: from {module} import {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("flowq") and any(map(_private, alias.name.split("."))):
                    yield f"{node.lineno}: import {alias.name}"
        elif (isinstance(node, ast.Attribute) and _private(node.attr)
              and node.attr not in NAMED_TUPLE_API and _root(node.value) not in foreign):
            yield f"{node.lineno}: .{node.attr}"
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name not in SETTERS:
                continue
            args = node.args
            if (len(args) >= 2 and isinstance(args[1], ast.Constant)
                    and isinstance(args[1].value, str) and _private(args[1].value)
                    and _root(args[0]) not in foreign):
                yield f"{node.lineno}: {name}(..., {args[1].value!r})"
            elif (args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str)
                  and args[0].value.startswith("flowq.")
                  and any(map(_private, args[0].value.split(".")))):
                yield f"{node.lineno}: {name}({args[0].value!r})"


def test_the_finder_finds_each_kind_of_use() -> None:
    source = '''
import sys
import flowq
import flowq._hidden
from flowq.tracing import _load, publish
from opentelemetry import trace
trace._TRACER = None
sys._getframe()
row._asdict()
flowq._EXPORTS
thing.part._attr = 1
self._mine = 2
monkeypatch.setattr(executor, "_spawn", None)
monkeypatch.setattr(trace, "_TRACER", None)
monkeypatch.setattr("flowq.tracing._tracer", None)
'''
    assert sorted(int(use.partition(":")[0]) for use in private_uses(source)) == [
        4, 5, 10, 11, 13, 15]


def test_no_test_uses_a_private_flowq_name() -> None:
    found = [f"{path.relative_to(TESTS)}:{use}"
             for path in sorted(TESTS.rglob("*.py"))
             for use in private_uses(path.read_text(), str(path))]
    assert not found, "private names of flowq used by tests (use or add a public one):\n" + (
        "\n".join(found))
