"""The web app: `POST /signup` writes a `User` and enqueues the sign-up pipeline in one
transaction; `GET /users/{id}` shows the user, with its account once the pipeline made it.

    DATABASE_URL=postgresql://... uvicorn examples.fastapi_app.main:app

Settings come from the environment (`Settings.from_env`: DATABASE_URL, and
FLOWQ_EMBEDDED_WORKER=1 to run a worker inside the web process) or are given to
`create_app(Settings(...))`, as the tests do.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated

import sqlalchemy as sa
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

import flowq
from flowq.db import normalize_url
from flowq.enqueueing.aio import AsyncSession  # an AsyncSession with `await session.enqueue(...)`

from . import jobs
from .models import Account, Base, User


@dataclass(frozen=True)
class Settings:
    database_url: str
    # Run a worker inside the web process (a thread the lifespan starts and stops), with this
    # config. None: run `flowq worker examples.fastapi_app.jobs:app` beside the server.
    worker: flowq.WorkerConfig | None = None

    @classmethod
    def from_env(cls) -> Settings:
        url = os.environ.get("DATABASE_URL")
        if not url:
            raise RuntimeError("set DATABASE_URL=postgresql://...")
        embedded = os.environ.get("FLOWQ_EMBEDDED_WORKER", "") not in ("", "0")
        return cls(url, flowq.WorkerConfig() if embedded else None)


@contextlib.asynccontextmanager
async def embedded_worker(settings: Settings) -> AsyncIterator[flowq.Worker | None]:
    """A `flowq.Worker` running in a thread for as long as the block, if settings ask for one."""
    if settings.worker is None:
        yield None
        return
    # Worker() connects to the database: do that off the event loop. check_database() fails
    # the startup in one sentence if the database is unreachable or `flowq migrate` never ran.
    worker = await asyncio.to_thread(flowq.Worker, jobs.app, settings.database_url,
                                     settings.worker)
    await asyncio.to_thread(worker.check_database)
    # run() in a thread installs no signal handlers (uvicorn keeps its own): stop() ends it.
    thread = threading.Thread(target=worker.run, name="flowq-worker", daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()  # no new claims; running handlers get `shutdown_grace` to finish
        await asyncio.to_thread(thread.join)


def create_app(settings: Settings | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(api: FastAPI) -> AsyncIterator[None]:
        s = settings or Settings.from_env()
        # psycopg 3's async driver (postgresql+psycopg://); flowq's worker takes any form.
        engine = create_async_engine(normalize_url(s.database_url))
        try:
            async with engine.begin() as conn:  # a real app runs its migrations instead
                await conn.run_sync(Base.metadata.create_all)
            api.state.sessions = async_sessionmaker(engine, class_=AsyncSession,
                                                    expire_on_commit=False)
            async with embedded_worker(s):
                yield
        finally:
            await engine.dispose()

    api = FastAPI(title="flowq FastAPI example", lifespan=lifespan)
    api.include_router(router)
    return api


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    """One session per request; tests override this dependency to join their transaction."""
    async with request.app.state.sessions() as session:
        yield session


SessionDep = Annotated[AsyncSession, Depends(get_session)]
router = APIRouter()


class SignupIn(BaseModel):
    email: str
    name: str


class UserOut(BaseModel):
    id: int
    email: str
    name: str
    signup_run_id: int
    account_id: int | None = None


@router.post("/signup", status_code=201)
async def sign_up(body: SignupIn, session: SessionDep) -> UserOut:
    # One transaction. The job's INSERT is sent now, the user's at commit: if that fails (the
    # email is taken), the rollback takes the job with it, and no pipeline ever runs.
    run = await session.enqueue(jobs.signup, email=body.email)
    user = User(email=body.email, name=body.name, signup_run_id=run.id)
    session.add(user)
    try:
        await session.commit()  # workers are woken now, not before
    except IntegrityError:
        await session.rollback()
        raise HTTPException(409, "this email is already registered") from None
    return UserOut(id=user.id, email=user.email, name=user.name, signup_run_id=run.id)


@router.get("/users/{user_id}")
async def get_user(user_id: int, session: SessionDep) -> UserOut:
    user = await session.get(User, user_id)
    if user is None:
        raise HTTPException(404, "no such user")
    account_id = await session.scalar(sa.select(Account.id).where(Account.user_id == user_id))
    return UserOut(id=user.id, email=user.email, name=user.name,
                   signup_run_id=user.signup_run_id, account_id=account_id)


app = create_app()  # `uvicorn examples.fastapi_app.main:app`; settings are read at startup
