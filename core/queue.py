"""Enqueueing tasks by name, behind a small interface so tests can use a recording fake.

Nothing waits on a Celery result: a caller that needs an answer reads it from Redis (see core.protocol).
"""

from __future__ import annotations

from typing import Any, Protocol

from celery import Celery

from core.errors import BrokerUnavailable


class TaskQueue(Protocol):
    """What services need from the broker."""

    def send(self, name: str, args: list[Any], *, queue: str, headers: dict[str, str] | None = None) -> str:
        """Enqueue task `name` (with message `headers`); return its task id or raise BrokerUnavailable."""
        ...

    def revoke(self, task_id: str) -> None:
        """Best effort: drop a queued task message."""
        ...


class CeleryTaskQueue:
    """TaskQueue on a Celery app (Redis broker and result backend)."""

    def __init__(self, celery: Celery) -> None:
        self.celery = celery

    def send(self, name: str, args: list[Any], *, queue: str, headers: dict[str, str] | None = None) -> str:
        try:
            result = self.celery.send_task(name, args=args, queue=queue, retry=False, headers=headers)
        except Exception as exc:  # noqa: BLE001 - kombu raises many types for an unreachable broker
            raise BrokerUnavailable(f"task broker unavailable: {type(exc).__name__}") from exc
        return str(result.id)

    def revoke(self, task_id: str) -> None:
        try:
            self.celery.control.revoke(task_id)
        except Exception:  # noqa: BLE001 - revoking is an optimisation; the job row is the truth
            pass
