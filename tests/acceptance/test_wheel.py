"""The flowq wheel holds the product: the runtime, its migrations and templates, its LICENSE,
no tooling; installed in a fresh venv, it runs a newcomer's project as docs/testing.md shows.

The benchmark is the flowq-bench distribution (bench/), so neither `flowq/bench` nor
`flowq_bench` may reach the wheel; the embedded server and the demo ship as `flowq.local`
(`flowq demo` and the pytest plugin use them). tests/integration/test_migrations.py installs the same
wheel, built once per session (conftest's `flowq_wheel`), and migrates with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from test_docs import project_files

REPO = Path(__file__).resolve().parents[2]


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


@pytest.mark.slow
def test_the_wheel_holds_the_license(wheel_files: dict[str, bytes]) -> None:
    licenses = [name for name in wheel_files if name.endswith(".dist-info/licenses/LICENSE")]
    assert licenses, sorted(wheel_files)
    assert wheel_files[licenses[0]] == (REPO / "LICENSE").read_bytes()
    assert b"MIT License" in wheel_files[licenses[0]]


def test_the_sdist_includes_the_license() -> None:
    """Checked in the build settings rather than by building an sdist (a build per session
    is the budget: the wheel's)."""
    tomllib = pytest.importorskip("tomllib")
    settings = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "LICENSE" in settings["tool"]["hatch"]["build"]["targets"]["sdist"]["include"]
    assert settings["project"]["license"] == "MIT"


def _venv_with(wheel: Path, venv: Path) -> Path:
    """A fresh venv holding flowq from `wheel` only; its dependencies (pytest too) are
    borrowed from this environment through a path entry, as in test_migrations.py: a path
    entry runs none of that environment's .pth files, so the repository's editable flowq
    stays out. Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / ("Scripts" if os.name == "nt" else "bin") / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--disable-pip-version-check", str(wheel)], check=True)
    site = subprocess.run([str(python), "-c",
                           "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "_borrowed_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return python


@pytest.mark.slow
def test_a_newcomers_project_runs_as_the_docs_show(flowq_wheel: Path, server_url: str,
                                                   tmp_path: Path) -> None:
    """The conftest.py and test files docs/testing.md gives, as a user pastes them into a
    project of their own, run under pytest with flowq installed from the wheel: the plugin
    comes by its entry point alone (no `pytest_plugins`, no `-p`), its database on the test
    server."""
    python = _venv_with(flowq_wheel, tmp_path / "venv")
    project = tmp_path / "project"
    project.mkdir()
    files = project_files()
    for name, code in files.items():
        (project / name).write_text(code)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["FLOWQ_TEST_DATABASE_URL"] = server_url
    where = subprocess.run(
        [str(python), "-c", "import flowq.testing.pytest_plugin as p; print(p.__file__)"],
        check=True, capture_output=True, text=True, cwd=project, env=env).stdout.strip()
    assert where.startswith(str(tmp_path / "venv")), where
    done = subprocess.run(
        [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-q",
         "--basetemp", str(tmp_path / "bt")],
        capture_output=True, text=True, cwd=project, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    tests = sum(code.count("\ndef test_") for code in files.values())
    assert f"{tests} passed" in done.stdout, done.stdout
    # `-p no:flowq` turns the plugin off, as docs/testing.md says: its fixtures are gone.
    off = subprocess.run(
        [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:flowq", "-q",
         "--basetemp", str(tmp_path / "bt-off"), "--fixtures"],
        capture_output=True, text=True, cwd=project, env=env, timeout=300, check=False)
    assert "flowq_session" not in off.stdout, off.stdout
