"""The module paths earlier docs taught still import for one release, with a warning.

`from flowq.runs import get_run`, `import flowq.queues`, `flowq.context.Context`... each old
path (flowq/deprecated.py) warns once with a `DeprecationWarning` that names the new path and
points at the user's own line, and hands on the same objects the new path gives. Each case
runs in a fresh interpreter: a module warns when first imported, and this process may have
imported it already.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# old module -> (new module(s) the warning names, names the old path gave and where they
# live now)
OLD_PATHS: dict[str, tuple[str, dict[str, str]]] = {
    "flowq.runs": ("flowq.ops.runs", {
        "get_run": "flowq.ops.runs", "cancel_run": "flowq.ops.runs",
        "retry_run": "flowq.ops.runs", "wait_run": "flowq.ops.runs",
        "fork": "flowq.ops.runs", "RunInfo": "flowq.ops.runs", "list_runs": "flowq.ops.runs"}),
    "flowq.queues": ("flowq.define.queues or flowq.ops.queues", {
        "list_queues": "flowq.ops.queues", "pause": "flowq.ops.queues",
        "resume": "flowq.ops.queues", "QueueInfo": "flowq.ops.queues",
        "Rate": "flowq.define.queues", "QueueConfig": "flowq.define.queues"}),
    "flowq.status": ("flowq.ops.status", {"status": "flowq.ops.status",
                                          "Status": "flowq.ops.status"}),
    "flowq.schedules": ("flowq.define.schedules or flowq.ops.schedules", {
        "list_schedules": "flowq.ops.schedules", "ScheduleInfo": "flowq.ops.schedules",
        "Schedule": "flowq.define.schedules", "MIN_EVERY": "flowq.define.schedules"}),
    "flowq.doctor": ("flowq.ops.doctor", {"doctor": "flowq.ops.doctor",
                                          "Check": "flowq.ops.doctor"}),
    "flowq.aio": ("flowq.enqueueing.aio", {
        "AsyncSession": "flowq.enqueueing.aio", "enqueue": "flowq.enqueueing.aio",
        "enqueue_many": "flowq.enqueueing.aio", "signal": "flowq.enqueueing.aio"}),
    "flowq.workflows": ("flowq.define.workflows or flowq.enqueueing.signals", {
        "each": "flowq.define.workflows", "MAX_MAP_ITEMS": "flowq.define.workflows",
        "Signalled": "flowq.enqueueing.signals"}),
    "flowq.context": ("flowq.durable.context or flowq.durable.session", {
        "Context": "flowq.durable.context", "StepSession": "flowq.durable.session"}),
    "flowq.children": ("flowq.durable.children", {
        "MIN_RECHECK": "flowq.durable.children", "MAX_WAIT": "flowq.durable.children",
        "MAX_DEPTH": "flowq.durable.children"}),
    "flowq.embedded": ("flowq.local.postgres", {
        "LocalPostgres": "flowq.local.postgres", "FAST_SETTINGS": "flowq.local.postgres"}),
    "flowq.migrations": ("flowq.db.migrations", {"migrate": "flowq.db.migrations",
                                                 "downgrade": "flowq.db.migrations"}),
}

PROBE = """
import importlib, json, sys, warnings
cases, how, found = json.loads(sys.argv[1]), sys.argv[2], {}
for old, names in cases.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "from":
            module = __import__(old, fromlist=list(names))  # from flowq.runs import get_run
        elif how == "import":
            exec(f"import {old}")  # import flowq.runs
            module = sys.modules[old]
        else:
            import flowq
            module = getattr(flowq, old.rpartition(".")[2])  # flowq.runs.get_run
    same = {name: getattr(module, name) is getattr(importlib.import_module(new), name)
            for name, new in names.items()}
    found[old] = {"same": same, "warnings": [
        {"category": w.category.__name__, "message": str(w.message), "filename": w.filename}
        for w in caught]}
print(json.dumps(found))
"""
PROBED: dict[str, dict[str, dict[str, object]]] = {}


def probe(old: str, how: str) -> dict[str, object]:
    """What `old` gave when used `how`, read with every other old path in one interpreter
    (each old module warns on its own first use, whatever the others did)."""
    if how not in PROBED:
        cases = {path: names for path, (_, names) in OLD_PATHS.items()}
        done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cases), how],
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr
        PROBED[how] = json.loads(done.stdout.splitlines()[-1])
    return PROBED[how][old]


# The old names `flowq` still gives as attributes, silently: the module that replaced each
# (`flowq.runs.fork(...)` is the documented spelling).
ATTRIBUTES: dict[str, str] = {
    "aio": "flowq.enqueueing.aio", "children": "flowq.durable.children",
    "doctor": "flowq.ops.doctor", "durable": "flowq.durable", "queues": "flowq.ops.queues",
    "runs": "flowq.ops.runs", "schedules": "flowq.ops.schedules", "status": "flowq.ops.status",
    "workflows": "flowq.define.workflows"}


@pytest.mark.parametrize("name", sorted(ATTRIBUTES))
def test_an_old_attribute_is_the_new_module_without_a_warning(name: str) -> None:
    code = ("import importlib, warnings; warnings.simplefilter('error'); import flowq\n"
            f"assert getattr(flowq, {name!r}) is importlib.import_module({ATTRIBUTES[name]!r})\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("how", ["from", "import"])
@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_an_old_path_warns_once_and_gives_the_same_objects(old: str, how: str) -> None:
    new, names = OLD_PATHS[old]
    result = probe(old, how)
    assert result["same"] == dict.fromkeys(names, True)
    assert result["warnings"] == [{
        "category": "DeprecationWarning",
        "message": f"{old} is deprecated and goes in flowq 0.2: import {new} instead.",
        # The user's line (here `-c`), not flowq's or importlib's.
        "filename": "<string>"}]


def test_a_moved_module_is_the_new_module() -> None:
    """One module under two names: a monkeypatch through the old name reaches the code."""
    code = ("import warnings; warnings.simplefilter('ignore'); import flowq\n"
            "import flowq.runs, flowq.children\n"
            "assert flowq.runs is flowq.ops.runs\n"
            "assert flowq.children is flowq.durable.children\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_every_old_path_has_a_case() -> None:
    shims = {f"flowq.{path.stem}" for path in (Path(__file__).parents[2] / "flowq").glob("*.py")
             if "flowq.deprecated" in path.read_text() and path.stem != "deprecated"}
    assert shims == set(OLD_PATHS)


def test_the_durable_package_still_gives_its_old_names() -> None:
    """`flowq.durable` was a module before it became the durable wing's package."""
    import flowq.durable

    assert flowq.durable.MAX_SNOOZES == 1000
    assert flowq.durable.RESERVED_PREFIX == "flowq."
    assert {"Ledger", "Suspend", "ClaimLost", "MAX_NAME_CHARS"} <= set(flowq.durable.__all__)
