"""The app's tables, and its Session: SQLModel's, with `.enqueue()` from flowq's SessionMixin."""

from __future__ import annotations

import sqlmodel
from sqlmodel import Field, SQLModel

import flowq


class Session(flowq.SessionMixin, sqlmodel.Session):
    """SQLModel's Session (`exec()`, ...) that also has `enqueue()` and `enqueue_many()`."""


class Invoice(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    number: str = Field(unique=True)
    email: str
    amount_cents: int
    emailed: bool = False  # set by the send_invoice job


class InvoiceCreate(SQLModel):
    number: str
    email: str
    amount_cents: int = Field(gt=0)
