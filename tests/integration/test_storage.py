"""What a job costs the server in storage (revision 0020): the claim writes its new row
version on the page of the old one (`jobs` is filled to half), and `job_history` carries only
the indexes its readers need."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker
from support import rows, scalar

import flowq
from flowq.db.schema import JOBS_STORAGE_PARAMETERS
from flowq.db.store import Store

# Enough rows of one transaction to fill several pages at fillfactor 100 (~38 a page).
ROWS = 120
PAGE = "(ctid::text::point)[0]"


def test_a_claim_writes_the_new_row_version_on_the_page_of_the_old_one(
        engine: sa.Engine, Session: sessionmaker[flowq.Session], app: flowq.FlowQ) -> None:
    @app.task(queue="pages")
    def page(ctx: flowq.Context, n: int) -> None:
        """A no-op."""

    with Session.begin() as s:
        s.enqueue_many(page, [{"n": i} for i in range(ROWS)])
    first = int(scalar(engine, "SELECT min(id) FROM flowq.jobs"))
    before = scalar(engine, f"SELECT {PAGE} FROM flowq.jobs WHERE id = :i", i=first)
    with engine.begin() as conn:
        [claimed] = Store.of(conn).claim("pages", 1, "worker-1")
    assert claimed.id == first
    # A new version on another page is a full tuple in the WAL and a second lock record.
    after = scalar(engine, f"SELECT {PAGE} FROM flowq.jobs WHERE id = :i", i=first)
    assert after == before


def test_jobs_carries_the_queue_table_storage_parameters(engine: sa.Engine) -> None:
    options = scalar(engine, "SELECT reloptions FROM pg_class "
                             "WHERE oid = CAST('flowq.jobs' AS regclass)")
    assert dict(o.split("=", 1) for o in options) == JOBS_STORAGE_PARAMETERS
    assert JOBS_STORAGE_PARAMETERS["fillfactor"] == "50"


def test_the_history_keeps_only_the_indexes_its_readers_need(engine: sa.Engine) -> None:
    found = {r.name: r.am for r in rows(engine, """
        SELECT c.relname AS name, a.amname AS am
          FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
          JOIN pg_am a ON a.oid = c.relam
         WHERE i.indrelid = CAST('flowq.job_history' AS regclass)""")}
    assert found == {"job_history_pkey": "btree", "job_history_run_id_idx": "btree",
                     "job_history_finished_idx": "btree",
                     "job_history_dead_run_idx": "btree"}
