"""The web app (sync FastAPI endpoints with SQLModel, as in SQLModel's tutorial):
`POST /invoices` writes an invoice and enqueues `send_invoice` in one transaction;
`GET /invoices/{id}` shows it.

    DATABASE_URL=postgresql://... uvicorn examples.sqlmodel_app.main:app

`create_app(database_url=None)` reads DATABASE_URL at startup when no URL is given.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from sqlalchemy.exc import IntegrityError
from sqlmodel import SQLModel, create_engine

from flowq.db import normalize_url

from . import jobs
from .models import Invoice, InvoiceCreate, Session


def create_app(database_url: str | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(api: FastAPI) -> AsyncIterator[None]:
        url = normalize_url(database_url or os.environ["DATABASE_URL"])  # psycopg 3
        api.state.engine = create_engine(url)
        SQLModel.metadata.create_all(api.state.engine)  # a real app runs its migrations
        try:
            yield
        finally:
            api.state.engine.dispose()

    api = FastAPI(title="flowq SQLModel example", lifespan=lifespan)
    api.include_router(router)
    return api


def get_session(request: Request) -> Iterator[Session]:
    """One session per request; tests override this dependency to join their transaction."""
    with Session(request.app.state.engine) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]
router = APIRouter()


@router.post("/invoices", status_code=201)
def create_invoice(body: InvoiceCreate, session: SessionDep) -> Invoice:
    invoice = Invoice.model_validate(body)
    session.add(invoice)
    # Sent now, before the invoice's INSERT (at commit): a taken number fails there, and the
    # rollback takes the job with it.
    session.enqueue(jobs.send_invoice, number=invoice.number)
    try:
        session.commit()  # the invoice and its job together; workers are woken now
    except IntegrityError:
        session.rollback()
        raise HTTPException(409, f"invoice {body.number} exists") from None
    session.refresh(invoice)
    return invoice


@router.get("/invoices/{invoice_id}")
def read_invoice(invoice_id: int, session: SessionDep) -> Invoice:
    invoice = session.get(Invoice, invoice_id)
    if invoice is None:
        raise HTTPException(404, "no such invoice")
    return invoice


app = create_app()  # `uvicorn examples.sqlmodel_app.main:app`
