"""The worker's Celery app: the shared configuration plus this package's tasks."""

from __future__ import annotations

import threading
from typing import Any

from celery.signals import worker_shutting_down

from core.celery_app import make_celery

celery = make_celery()
celery.conf.update(include=["worker.tasks"])

# Set when the worker is asked to stop; a running fine-tune checkpoints and goes back to the queue.
SHUTDOWN = threading.Event()


@worker_shutting_down.connect
def _on_shutdown(**_: Any) -> None:
    SHUTDOWN.set()
