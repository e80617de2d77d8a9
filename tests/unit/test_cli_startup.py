"""`flowq --version` and `flowq --help` start at once; the lazy tables say what the code does.

`import flowq` loads nothing heavy (its public names resolve on first use) and the root
command imports a command's module only when that command runs, so the two commands people
type most import neither SQLAlchemy nor psycopg, alembic, tenacity or starlette. The tables
that make this lazy repeat facts the code also states (which module defines a public name,
each command's one-line help); these tests hold each copy to the original.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import flowq
from flowq.cli import COMMANDS, main
from flowq.cli.bench import INSTALL_HINT
from flowq.cli.group import FlowqGroup

HEAVY = ("sqlalchemy", "psycopg", "alembic", "tenacity", "starlette", "jinja2", "cronsim")
INIT = Path(flowq.__file__)


def exports_table() -> dict[str, tuple[str, ...]]:
    """flowq/__init__.py's table of which module defines each public name, as its source
    writes it (read like the `TYPE_CHECKING` block it is held to, not imported)."""
    tree = ast.parse(INIT.read_text())
    [table] = [node.value for node in tree.body if isinstance(node, ast.AnnAssign)
               and isinstance(node.target, ast.Name) and node.target.id == "_EXPORTS"]
    assert table is not None
    exports: dict[str, tuple[str, ...]] = ast.literal_eval(table)
    return exports


def imported_modules(*args: str) -> set[str]:
    """Every module `python -X importtime -m flowq *args` imports (importtime's own list)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "flowq", *args],
                          capture_output=True, text=True, timeout=60, check=True)
    return {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines()
            if line.startswith("import time:") and "[us]" not in line}


@pytest.mark.parametrize("args", [("--version",), ("--help",)])
def test_version_and_help_import_no_database_library(args: tuple[str, ...]) -> None:
    modules = imported_modules(*args)
    assert "flowq.cli" in modules  # importtime's list is the one we think it is
    heavy = sorted(m for m in modules if m.partition(".")[0] in HEAVY)
    assert not heavy, heavy
    # Nor any command module: --help lists them from the table.
    assert not [m for m in modules if m.startswith("flowq.cli.")
                and m not in ("flowq.cli.group",)], sorted(modules)


def modules_after(*args: str) -> set[str]:
    """Every module loaded once `flowq *args` ran. Read from `sys.modules`, not importtime:
    importtime lists only `import` statements, and a lazy command comes by `import_module`."""
    code = ("import json, sys; from flowq.cli import main\n"
            "try:\n"
            f"    main({list(args)!r})\n"
            "except SystemExit:\n"
            "    pass\n"
            "print(json.dumps(sorted(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    return set(json.loads(done.stdout.splitlines()[-1]))


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_command_help_imports_no_database_library(name: str) -> None:
    """A command's --help loads that command's module, but nothing heavy: each command
    imports the database layer, the runs API and the rest when it runs (and never alembic,
    which only migrating needs: `flowq.db.migrations` imports it inside those functions)."""
    modules = modules_after(name, "--help")
    assert COMMANDS[name][0].partition(":")[0] in modules  # the command was really loaded
    assert not sorted(m for m in modules if m.partition(".")[0] == "alembic")
    heavy = sorted({m.partition(".")[0] for m in modules} & set(HEAVY))
    assert not heavy, heavy


def test_the_constants_the_help_repeats_are_the_originals() -> None:
    """What the commands show in --help without importing their modules of origin."""
    from flowq.cli import doctor as doctor_cli
    from flowq.cli import runs as runs_cli
    from flowq.db.schema import STATUSES
    from flowq.ops.doctor import LONG_TRANSACTION_S
    from flowq.ops.runs import DEFAULT_RETRY_BATCH

    assert runs_cli.STATUSES == STATUSES
    assert runs_cli.DEFAULT_RETRY_BATCH == DEFAULT_RETRY_BATCH
    assert doctor_cli.LONG_TRANSACTION_S == LONG_TRANSACTION_S


def test_import_flowq_imports_none_of_its_modules() -> None:
    code = ("import sys, flowq; "
            "loaded = sorted(m for m in sys.modules if m.startswith('flowq.') "
            f"or m.partition('.')[0] in {HEAVY!r}); "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_version_is_the_installed_distributions() -> None:
    result = CliRunner().invoke(main, ["--version"], prog_name="flowq")
    assert result.exit_code == 0
    assert result.output == f"flowq, version {importlib.metadata.version('flowq')}\n"
    assert flowq.__version__ == importlib.metadata.version("flowq")


def test_every_public_name_resolves_to_its_modules_object() -> None:
    table = {name: module for module, names in exports_table().items() for name in names}
    assert sorted(table) == sorted(flowq.__all__)
    for name, module in table.items():
        assert getattr(flowq, name) is getattr(importlib.import_module(module), name), name
    assert set(flowq.__all__) <= set(dir(flowq))
    with pytest.raises(AttributeError, match="no_such_name"):
        flowq.no_such_name  # noqa: B018
    from flowq import FlowQ, Worker

    assert FlowQ is flowq.FlowQ and Worker is flowq.Worker


def test_type_checking_imports_repeat_the_table() -> None:
    """The `if TYPE_CHECKING:` imports (what mypy and IDEs see) name the same modules and
    names as `_EXPORTS` (what runs)."""
    tree = ast.parse(INIT.read_text())
    [block] = [node for node in tree.body if isinstance(node, ast.If)
               and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"]
    seen: dict[str, tuple[str, ...]] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module, ast.dump(node)
        seen[node.module] = tuple(alias.name for alias in node.names)
    assert {m: sorted(n) for m, n in seen.items()} == {
        m: sorted(n) for m, n in exports_table().items()}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_lazy_help_is_the_commands_own(name: str) -> None:
    command = main.get_command(click.Context(main), name)
    assert command is not None and command.name == name
    _, short_help = COMMANDS[name]
    assert short_help == command.get_short_help_str(limit=10_000), name


def test_help_lists_what_the_loaded_commands_would() -> None:
    """`flowq --help` from the table reads exactly as click renders the real commands."""
    settings = {"help": main.help, "params": main.params,
                "context_settings": main.context_settings}
    lazy = FlowqGroup(lazy_commands=COMMANDS, **settings)  # main's, but none loaded yet
    eager = click.Group(**settings)
    for name in COMMANDS:
        command = main.get_command(click.Context(main), name)
        assert command is not None
        eager.add_command(command, name)
    shown = CliRunner().invoke(lazy, ["--help"], prog_name="flowq").output
    assert not lazy.commands  # listed from the table alone
    assert shown == CliRunner().invoke(eager, ["--help"], prog_name="flowq").output
    assert all(f"\n  {name} " in shown for name in COMMANDS), shown


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_shows_its_help(name: str) -> None:
    result = CliRunner().invoke(main, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"Usage: main {name} ")


def test_bench_without_flowq_bench_says_how_to_get_it() -> None:
    code = ("import sys; sys.modules['flowq_bench'] = None; from flowq.cli import main; "
            "main(['bench', '--quick', '--scenario', 'drain'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"Error: {INSTALL_HINT}"
    assert "make bench" in INSTALL_HINT and "pip install ./bench" in INSTALL_HINT


def _options(command: click.Command, path: str) -> Iterator[tuple[str, click.Option]]:
    """Every option of `command` and of its subcommands, with the command line naming it."""
    if isinstance(command, click.Group):
        for name in command.list_commands(click.Context(command)):
            sub = command.get_command(click.Context(command), name)
            assert sub is not None
            yield from _options(sub, f"{path} {name}")
    for param in command.params:
        if isinstance(param, click.Option):
            yield path, param


def test_every_option_has_help_text() -> None:
    missing = [f"{path} {option.opts[0]}" for path, option in _options(main, "flowq")
               if not option.hidden and not (option.help or "").strip()]
    assert not missing, missing


def test_every_worker_config_field_and_worker_option_is_in_the_worker_guide() -> None:
    """docs/worker.md's table puts each WorkerConfig field beside its `flowq worker` flag."""
    from dataclasses import fields

    from flowq.worker.config import WorkerConfig

    guide = (Path(__file__).parents[2] / "docs" / "worker.md").read_text()
    table = guide[guide.index("## Options and defaults"):]
    table = table[:table.index("\n## ")]
    missing = [f.name for f in fields(WorkerConfig) if f"`{f.name}`" not in table]
    assert not missing, missing
    command = main.get_command(click.Context(main), "worker")
    assert command is not None
    flags = [opt for param in command.params if isinstance(param, click.Option)
             for opt in param.opts if opt.startswith("--")]
    assert [flag for flag in flags if f"`{flag}" not in table] == []
