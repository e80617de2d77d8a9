"""The flowq wheel holds the product: the runtime, its migrations and templates, no tooling.

The benchmark is the flowq-bench distribution (bench/), so neither `flowq/bench` nor
`flowq_bench` may reach the wheel; the embedded server and the demo ship as `flowq.local`
(`flowq demo` and the pytest plugin use them). tests/integration/test_migrations.py installs the same
wheel, built once per session (conftest's `flowq_wheel`), and migrates with it.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def wheel_files(flowq_wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(flowq_wheel) as wheel:
        return {name: wheel.read(name) for name in wheel.namelist()}


@pytest.mark.slow
def test_the_wheel_holds_no_bench_code(wheel_files: dict[str, bytes]) -> None:
    packages = {name.split("/", 1)[0] for name in wheel_files if "/" in name}
    assert {p for p in packages if not p.endswith(".dist-info")} == {"flowq"}, packages
    assert not [name for name in wheel_files if name.startswith("flowq/bench")]
    # Only the thin `flowq bench` command names the bench package, to run it or say how to
    # get it; no scenario, harness or bench app is in the wheel.
    naming = sorted(name for name, data in wheel_files.items()
                    if name.endswith(".py") and b"flowq_bench" in data)
    assert naming == ["flowq/cli/bench.py"], naming
    assert len(wheel_files["flowq/cli/bench.py"].splitlines()) < 60


@pytest.mark.slow
def test_the_wheel_holds_the_runtime_and_its_data(wheel_files: dict[str, bytes]) -> None:
    for name in ("flowq/__init__.py", "flowq/cli/__init__.py", "flowq/cli/bench.py",
                 "flowq/local/postgres.py", "flowq/local/demo.py", "flowq/py.typed",
                 "flowq/_migrations/versions/0001_jobs.py",
                 "flowq/dashboard/templates/run.html"):
        assert name in wheel_files, name
    assert not [name for name in wheel_files if name.startswith("tests/")]
