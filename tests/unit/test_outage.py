"""A database outage is told once per worker (issue 20, failover): one WARNING when it begins,
one INFO when it ends, DEBUG for every other part that meets it; failures that are not
transient are told as they come; a read-only server is counted, so the LISTEN leaves it too."""

from __future__ import annotations

import logging

import psycopg
import pytest
import sqlalchemy as sa

from flowq.db import is_transient
from flowq.db.transient import is_read_only
from flowq.worker import connection
from flowq.worker.connection import Outage


class ReadOnly(psycopg.errors.ReadOnlySqlTransaction):
    pass


def lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "flowq"]


def test_an_outage_is_one_warning_then_one_info(caplog: pytest.LogCaptureFixture) -> None:
    outage = Outage()
    outage.ok()  # no outage: nothing to say
    lost = psycopg.OperationalError("server closed the connection unexpectedly\nmore")
    with caplog.at_level(logging.DEBUG, logger="flowq"):
        outage.failed("claim", lost, retry_in_s=0.1)
        outage.failed("heartbeat", lost)
        outage.failed("listen", sa.exc.OperationalError("SELECT 1", {}, lost))
        outage.ok()
        outage.ok()
    said = lines(caplog)
    assert [level for level, _ in said] == [logging.WARNING, logging.DEBUG, logging.DEBUG,
                                            logging.INFO], said
    assert said[0][1].startswith("database connection lost; reconnecting part=claim")
    assert "more" not in said[0][1]  # the first line of the error only
    assert said[1][1].startswith("heartbeat failed; retrying")
    assert said[3][1].startswith("database connection back after_s=")
    assert "failed_operations=3" in said[3][1]


def test_a_part_meeting_its_broken_connection_late_is_not_a_new_outage(
        caplog: pytest.LogCaptureFixture) -> None:
    outage = Outage()
    lost = psycopg.OperationalError("connection failed")
    with caplog.at_level(logging.DEBUG, logger="flowq"):
        outage.failed("claim", lost)
        outage.ok()
        outage.failed("registry", lost)  # its pooled connection was to the old server
        outage.ok()
    assert [level for level, _ in lines(caplog)] == [logging.WARNING, logging.INFO,
                                                     logging.DEBUG]


def test_a_later_outage_is_told_again(caplog: pytest.LogCaptureFixture,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    outage = Outage()
    lost = psycopg.OperationalError("connection failed")
    clock = [1000.0]
    monkeypatch.setattr(connection.time, "monotonic", lambda: clock[0])
    with caplog.at_level(logging.INFO, logger="flowq"):
        outage.failed("claim", lost)
        outage.ok()
        clock[0] += connection.AFTERSHOCK + 1
        outage.failed("claim", lost)
        outage.ok()
    assert [level for level, _ in lines(caplog)] == [logging.WARNING, logging.INFO] * 2


def test_a_refused_statement_is_no_outage(caplog: pytest.LogCaptureFixture) -> None:
    outage = Outage()
    refused = psycopg.errors.UniqueViolation("duplicate key")
    assert not is_transient(refused)
    with caplog.at_level(logging.DEBUG, logger="flowq"):
        outage.failed("claim", refused)
        outage.ok()
    assert lines(caplog) == [(logging.WARNING, 'claim failed; retrying error="duplicate key"')]
    assert outage.since is None


def test_a_read_only_server_is_counted_so_that_listeners_leave_it() -> None:
    outage = Outage()
    read_only = ReadOnly("cannot execute UPDATE in a read-only transaction")
    assert is_transient(read_only) and is_read_only(read_only)
    assert is_read_only(sa.exc.InternalError("UPDATE", {}, read_only))
    assert not is_read_only(psycopg.OperationalError("connection failed"))
    outage.failed("claim", read_only)
    outage.failed("completion write", read_only)
    assert outage.read_only == 2
