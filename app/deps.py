"""Dependency aliases for routes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from app.limits import mark_key_accepted
from core.auth import Principal, authenticate, refuse_query_credentials
from core.db import release
from core.queue import TaskQueue
from core.settings import Settings
from core.storage import ArtifactStore


def get_session(request: Request) -> Iterator[Session]:
    """A session per request; services commit explicitly, anything uncommitted is rolled back.

    Closed when the route function returns (scope="function"), before the response goes out: a client that
    reads slowly never holds a database connection. A route that waits on the network first calls
    core.db.release; a connection is taken again only by the next query.
    """
    session: Session = request.app.state.sessionmaker()
    try:
        yield session
    finally:
        session.close()


def get_app_settings(request: Request) -> Settings:
    """The settings the app was built with."""
    settings: Settings = request.app.state.settings
    return settings


def get_task_queue(request: Request) -> TaskQueue:
    """The broker client the app was built with."""
    queue: TaskQueue = request.app.state.task_queue
    return queue


def get_storage(request: Request) -> ArtifactStore:
    """The artifact store the app was built with (datasets in, model archives out)."""
    storage: ArtifactStore = request.app.state.storage
    return storage


# auto_error=False: a missing key is reported through the error envelope (401), not FastAPI's 403.
bearer = HTTPBearer(auto_error=False, description="An API key from `trainserve keys create`.")


SessionDep = Annotated[Session, Depends(get_session, scope="function")]


def get_principal(request: Request, session: SessionDep,
                  _: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Principal:
    """The caller, from `Authorization: Bearer <key>`; 401 otherwise, and 401 for any key in the query string.

    The key lookup's transaction ends here, so a route starts without a connection checked out."""
    refuse_query_credentials(request.query_params.multi_items())
    principal = authenticate(session, authorization=request.headers.get("authorization"))
    mark_key_accepted(request.scope)
    release(session)
    return principal


def get_idempotency_key(idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None
                        ) -> str | None:
    """The optional Idempotency-Key header, validated."""
    from app.services.idempotency import check_key

    return check_key(idempotency_key)


PrincipalDep = Annotated[Principal, Depends(get_principal)]
IdempotencyKeyDep = Annotated[str | None, Depends(get_idempotency_key)]
SettingsDep = Annotated[Settings, Depends(get_app_settings)]
StorageDep = Annotated[ArtifactStore, Depends(get_storage)]
QueueDep = Annotated[TaskQueue, Depends(get_task_queue)]
