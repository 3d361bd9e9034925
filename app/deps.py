"""Dependency aliases for routes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from core.queue import TaskQueue
from core.settings import Settings


def get_session(request: Request) -> Iterator[Session]:
    """A session per request; services commit explicitly, anything uncommitted is rolled back."""
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


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_app_settings)]
QueueDep = Annotated[TaskQueue, Depends(get_task_queue)]
