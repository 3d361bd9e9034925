"""The worker context: everything a worker process shares, built once per process and passed explicitly."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

import redis
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from core.db import make_engine, make_sessionmaker
from core.queue import TaskQueue
from core.redis_client import redis_from_url
from core.settings import Settings
from core.storage import ArtifactStore, open_storage

T = TypeVar("T")


@dataclass
class WorkerContext:
    """Settings, database sessions, the task queue, Redis, the artifact store and lazily built per-process services.

    Tasks receive it from `worker.app` (which builds one after the fork); tests build their own with
    `WorkerContext(settings, queue=RecordingQueue())` and pass it in, so no module global needs resetting.
    """

    settings: Settings
    queue: TaskQueue
    # Set when the worker is asked to stop: a running fine-tune checkpoints and goes back to the queue.
    shutdown: threading.Event = field(default_factory=threading.Event)
    _services: dict[str, Any] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @cached_property
    def engine(self) -> Engine:
        """One database engine (and pool) per process."""
        return make_engine(self.settings.resolved_database_url)

    @cached_property
    def sessions(self) -> sessionmaker[Session]:
        """The session factory on that engine."""
        return make_sessionmaker(self.engine)

    @cached_property
    def redis(self) -> redis.Redis:
        """One Redis client (with its pool) per process, shared by task threads."""
        return redis_from_url(self.settings.resolved_redis_url, socket_timeout=10)

    @cached_property
    def storage(self) -> ArtifactStore:
        """The artifact store: datasets and checkpoints come from it, checkpoints and models go to it."""
        return open_storage(self.settings)

    def service(self, name: str, build: Callable[[WorkerContext], T]) -> T:
        """The process's instance of a long-lived service (model caches, servers), built on first use."""
        with self._lock:
            if name not in self._services:
                self._services[name] = build(self)
            return self._services[name]  # type: ignore[no-any-return]

    def close(self) -> None:
        """Close the services that hold something (the generation engines: a vLLM server each), then release pooled
        connections (tests, and a worker shutting down)."""
        with self._lock:
            services, self._services = list(self._services.values()), {}
        for service in services:
            close = getattr(service, "close", None)
            if callable(close):
                close()
        if "engine" in self.__dict__:
            self.engine.dispose()
        if "redis" in self.__dict__:
            self.redis.close()


def takes_training_jobs() -> bool:
    """True in a worker process that consumes the training queue (`trainserve worker` sets TRAINSERVE_WORKER_QUEUES)."""
    from core.tasks import QUEUE_TRAIN

    return QUEUE_TRAIN in os.environ.get("TRAINSERVE_WORKER_QUEUES", QUEUE_TRAIN).split(",")
