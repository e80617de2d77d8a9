"""The import graph of flowq, read from the source: layers import downward, privates stay home.

The graph is computed from the AST of every module under flowq/, imports inside functions
included (they run too, only later) and `if TYPE_CHECKING:` imports excluded (they never
run). An import of a package's ancestor (`from flowq import __version__`) is no edge: the
ancestor is always imported first, whatever the module does.

- No cycle among flowq's modules at run time, except the ones in `ALLOWED_CYCLES`, each
  documented there. A new cycle fails with its modules and the imports that close it.
- `flowq/define/` (what users declare) imports nothing above it: not the enqueue layer, the
  database layer, the worker, the operations, the CLI or the dashboard, nor SQLAlchemy or
  psycopg; at run time the one exception is `ALLOWED_UPWARD` (a definition enqueueing itself).
- No module imports another flowq module's `_private` name (`ALLOWED_PRIVATE` lists what is
  left).
- No module outside `flowq/db` imports `flowq.db.sql`, not even for types: the statements are
  private to the database layer, and everything else calls the verbs of `flowq.db.store`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import flowq

ROOT = Path(flowq.__file__).parent

# Each allowed strongly connected component, as its set of modules, with why it is one.
ALLOWED_CYCLES: dict[frozenset[str], str] = {
    # `Task.enqueue` / `.options(...).enqueue` / `.aenqueue` (flowq.define.pipeline) call the
    # enqueue layer, which imports the definitions: the one documented upward import.
    # The enqueue modules import the definitions (`Pipeline`, and `find_definition` to check
    # an enqueue by name), so the component holds flowq.define.app as well; and
    # flowq.enqueueing.batch, which every enqueue tells of the runs it created.
    frozenset({"flowq.define.app", "flowq.define.pipeline", "flowq.enqueueing.prepare",
               "flowq.enqueueing.sync", "flowq.enqueueing.aio", "flowq.enqueueing.signals",
               "flowq.enqueueing.batch"}):
        "Task.enqueue",
}
# The run-time imports out of flowq/define/ into a layer above, as (importer, imported).
ALLOWED_UPWARD: frozenset[tuple[str, str]] = frozenset({
    ("flowq.define.pipeline", "flowq.enqueueing.prepare"),
    ("flowq.define.pipeline", "flowq.enqueueing.sync"),
    ("flowq.define.pipeline", "flowq.enqueueing.aio"),
})
ABOVE_DEFINE = ("flowq.enqueueing", "flowq.db", "flowq.worker", "flowq.ops", "flowq.cli",
                "flowq.dashboard", "flowq.queries", "flowq.schema", "flowq.direct",
                "flowq.migrations", "flowq.durable", "flowq.tracing", "flowq.metrics",
                "flowq.testing", "flowq.local", "flowq_bench", "sqlalchemy", "psycopg")
# (importer, module, name) of the `_private` imports across modules still left: none (the
# test kit's borrowings from the worker gave way to flowq.worker.attempt and .writes).
ALLOWED_PRIVATE: frozenset[tuple[str, str, str]] = frozenset()


@dataclass(frozen=True)
class Import:
    importer: str
    module: str  # the flowq module (or the top-level package outside flowq) imported
    names: tuple[str, ...]  # the names taken from it (empty for `import x`)
    line: int
    in_function: bool


def _modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        if package:
            parts.pop()
        found[".".join(parts)] = (path, package)
    return found


MODULES = _modules()


def _resolve(name: str) -> str:
    """The module `name` is or lies in (a dotted name may end in an attribute)."""
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str) -> Iterator[Import]:
    path, package = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))

    def walk(node: ast.AST, in_function: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    yield from walk_one(other, in_function)
                continue
            yield from walk_one(child, in_function)

    def walk_one(node: ast.AST, in_function: bool) -> Iterator[Import]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name) if alias.name.startswith("flowq") else (
                    alias.name.partition(".")[0])
                yield Import(module, target, (), node.lineno, in_function)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module if package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            if not source.startswith("flowq"):
                yield Import(module, source.partition(".")[0], (), node.lineno, in_function)
                return
            plain: list[str] = []
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in MODULES:  # `from flowq import tracing`: the submodule itself
                    yield Import(module, full, (), node.lineno, in_function)
                else:
                    plain.append(alias.name)
            if plain:
                yield Import(module, _resolve(source), tuple(plain), node.lineno, in_function)
        else:
            yield from walk(node, in_function or isinstance(
                node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))

    yield from walk(tree, False)


IMPORTS = [i for m in MODULES for i in _imports(m)]


def _is_ancestor(package: str, module: str) -> bool:
    return module.startswith(package + ".")


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in IMPORTS:
        if i.module in MODULES and i.module != i.importer and not _is_ancestor(
                i.module, i.importer):
            graph[i.importer].add(i.module)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(component)
    return found


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(map(sorted, strongly_connected(graph))) == [["a", "b", "c"], ["d", "e"]]


def test_no_import_cycle_beyond_the_documented_one() -> None:
    graph = _graph()
    unexpected = [c for c in strongly_connected(graph) if frozenset(c) not in ALLOWED_CYCLES]
    report = []
    for component in unexpected:
        edges = sorted(f"  {i.importer}:{i.line} imports {i.module}" for i in IMPORTS
                       if i.importer in component and i.module in component
                       and i.module in graph[i.importer])
        report.append(f"cycle of {sorted(component)}:\n" + "\n".join(edges))
    assert not unexpected, "\n".join(report)


def test_the_allowed_cycles_are_still_cycles() -> None:
    """An allow-list entry that no longer describes a component is stale: remove it."""
    components = {frozenset(c) for c in strongly_connected(_graph())}
    assert set(ALLOWED_CYCLES) <= components


def test_definitions_import_nothing_above_them() -> None:
    wrong = sorted(
        f"{i.importer}:{i.line} imports {i.module}" + (" (in a function)" if i.in_function
                                                        else "")
        for i in IMPORTS
        if i.importer.startswith("flowq.define")
        and any(i.module == a or i.module.startswith(a + ".") for a in ABOVE_DEFINE)
        and not (i.in_function and (i.importer, i.module) in ALLOWED_UPWARD))
    assert not wrong, "\n".join(wrong)


def test_no_private_name_crosses_a_module_boundary() -> None:
    crossing = {(i.importer, i.module, name) for i in IMPORTS
                if i.module in MODULES and i.module != i.importer
                for name in i.names
                if name.startswith("_") and not name.startswith("__")}
    assert crossing <= ALLOWED_PRIVATE, "\n".join(
        f"{importer} imports {name} from {module}"
        for importer, module, name in sorted(crossing - ALLOWED_PRIVATE))


def _all_imports_of(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every import in `path`, `if TYPE_CHECKING:` ones included."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.lineno, node.module
            yield from ((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)


def test_only_the_database_layer_imports_its_statements() -> None:
    """`flowq.db.sql` is private to `flowq/db`: everything else calls the store's verbs
    (`flowq.db.store`), which build every statement's parameters in one place. Type-only
    imports count: a `Queries` passed around is a statement picked by name elsewhere."""
    wrong = sorted(
        f"{module}:{line} imports {name}"
        for module, (path, _) in MODULES.items() if not module.startswith("flowq.db")
        for line, name in _all_imports_of(path)
        if name == "flowq.db.sql" or name.startswith("flowq.db.sql."))
    assert not wrong, "\n".join(wrong)
