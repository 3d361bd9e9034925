"""The worker's Celery app: the shared configuration plus this package's tasks."""

from __future__ import annotations

import os
import threading
from typing import Any

from celery.signals import worker_ready, worker_shutting_down

from core.celery_app import make_celery
from worker.capacity import start_reporting
from worker.context import WorkerContext

celery = make_celery()
celery.conf.update(include=["worker.tasks"])

# Set when the worker is asked to stop; a running fine-tune checkpoints and goes back to the queue.
SHUTDOWN = threading.Event()

_context: WorkerContext | None = None
_context_lock = threading.Lock()


def context() -> WorkerContext:
    """This worker process's context, built on first use (after the fork, so pools are not shared)."""
    global _context
    with _context_lock:
        if _context is None:
            from core.queue import CeleryTaskQueue
            from core.settings import get_settings

            _context = WorkerContext(get_settings(), CeleryTaskQueue(celery), shutdown=SHUTDOWN)
        return _context


@worker_shutting_down.connect
def _on_shutdown(**_: Any) -> None:
    SHUTDOWN.set()


@worker_ready.connect
def _start_reaper(**_: Any) -> None:
    """Training workers also watch for lost workers and a broker that lost its data."""
    if "training" not in os.environ.get("TRAINSERVE_WORKER_QUEUES", "training").split(","):
        return
    from core.settings import get_settings
    from worker.recovery import Reaper
    from worker.runner import send_train, sessions

    Reaper(sessions(), get_settings(), send_train).start()


worker_ready.connect(lambda **_: start_reporting(context()), weak=False)  # device capacity, for admission
