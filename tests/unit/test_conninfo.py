"""`flowq.db.to_conninfo`: every URL form a user may write becomes the libpq conninfo that
flowq's own psycopg connections are given (issue 20, item 6: a multi-host URL once reached
them as `host='h2:5433'`)."""

from __future__ import annotations

import pytest
from psycopg.conninfo import conninfo_to_dict

from flowq.db import normalize_url, to_conninfo
from flowq.errors import FlowqError


def conninfo(url: str) -> dict[str, object]:
    return dict(conninfo_to_dict(to_conninfo(normalize_url(url))))


@pytest.mark.parametrize(("url", "expected"), [
    ("postgresql://bob:pw@h:5433/db",
     {"host": "h", "port": "5433", "user": "bob", "password": "pw", "dbname": "db"}),
    ("postgres://bob@h/db", {"host": "h", "user": "bob", "dbname": "db"}),
    ("postgresql+asyncpg://bob:p%40w%3A%25@h/db?sslmode=require",
     {"host": "h", "user": "bob", "password": "p@w:%", "dbname": "db", "sslmode": "require"}),
    # SQLAlchemy's multi-host form, hosts with and without ports.
    ("postgresql+psycopg://bob@/db?host=h1:5432&host=h2:5433&target_session_attrs=read-write",
     {"host": "h1,h2", "port": "5432,5433", "user": "bob", "dbname": "db",
      "target_session_attrs": "read-write"}),
    ("postgresql://bob@/db?host=h1&host=h2:5433", {"host": "h1,h2", "port": ",5433",
                                                    "user": "bob", "dbname": "db"}),
    ("postgresql://bob@/db?host=h1:7&host=h2:7", {"host": "h1,h2", "port": "7", "user": "bob",
                                                  "dbname": "db"}),
    ("postgresql://bob@/db?host=h1&host=h2&port=6000", {"host": "h1,h2", "port": "6000",
                                                        "user": "bob", "dbname": "db"}),
    # libpq's multi-host form, which SQLAlchemy's parser cannot read, is accepted too.
    ("postgresql://bob@h1:5432,h2:5433/db?target_session_attrs=read-write",
     {"host": "h1,h2", "port": "5432,5433", "user": "bob", "dbname": "db",
      "target_session_attrs": "read-write"}),
    ("postgresql://bob:pw@h1,h2:5433", {"host": "h1,h2", "port": ",5433", "user": "bob",
                                        "password": "pw"}),
    # IPv6, bracketed in a URL, bare in a conninfo.
    ("postgresql://bob@[::1]:5432/db", {"host": "::1", "port": "5432", "user": "bob",
                                        "dbname": "db"}),
    ("postgresql://bob@/db?host=[::1]:5432&host=[fe80::2]", {"host": "::1,fe80::2",
                                                           "port": "5432,", "user": "bob",
                                                           "dbname": "db"}),
    ("postgresql://bob@[::1]:5432,h2:5433/db", {"host": "::1,h2", "port": "5432,5433",
                                               "user": "bob", "dbname": "db"}),
    # Unix-socket directories.
    ("postgresql://bob@/db?host=/var/run/postgresql", {"host": "/var/run/postgresql",
                                                       "user": "bob", "dbname": "db"}),
    ("postgresql://bob@/db?host=%2Ftmp%2Fs&host=h2:5433", {"host": "/tmp/s,h2",
                                                           "port": ",5433", "user": "bob",
                                                           "dbname": "db"}),
    ("postgresql://bob@%2Ftmp%2Fs,h2:5433/db", {"host": "/tmp/s,h2", "port": ",5433",
                                                "user": "bob", "dbname": "db"}),
])
def test_every_url_form_becomes_a_libpq_conninfo(url: str, expected: dict[str, str]) -> None:
    assert conninfo(url) == expected


@pytest.mark.parametrize(("url", "fragment"), [
    ("postgresql://bob@h/db?host=h2", "in one place"),
    ("postgresql://bob@/db?host=h1:x", "not a number"),
    ("postgresql://bob@/db?host=h1,h2", "several hosts"),
    ("postgresql://bob@/db?host=[::1", "IPv6"),
    ("postgresql://bob@/db?host=h1&port=1&port=2", "port"),
    ("postgresql://bob@h1:5432,h2:x/db", "not a number"),
])
def test_a_host_list_libpq_cannot_take_is_refused_in_one_sentence(url: str,
                                                                   fragment: str) -> None:
    with pytest.raises(FlowqError, match=fragment) as err:
        normalize_url(url)
    assert "\n" not in str(err.value)


def test_an_unknown_option_is_a_flowq_error_without_the_password() -> None:
    with pytest.raises(FlowqError, match="foo") as err:
        to_conninfo(normalize_url("postgresql://bob:S3cr3t@h/db?foo=1"))
    assert "S3cr3t" not in str(err.value)
