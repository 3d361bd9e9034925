"""The worker's Celery app: the shared configuration plus this package's tasks, and the process's context."""

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

# Celery sends worker_shutting_down from inside its signal handler, which may interrupt context() while it
# holds the lock: the handler sets this event, created up front, and never takes the lock.
_shutdown = threading.Event()
_context: WorkerContext | None = None
_context_lock = threading.Lock()


def context() -> WorkerContext:
    """This worker process's context, built on first use (after the fork, so pools are not shared)."""
    global _context
    with _context_lock:
        if _context is None:
            from core.queue import CeleryTaskQueue
            from core.settings import get_settings

            _context = WorkerContext(get_settings(), CeleryTaskQueue(celery), shutdown=_shutdown)
        return _context


@worker_shutting_down.connect
def _on_shutdown(**_: Any) -> None:
    # A running fine-tune sees this between steps: it checkpoints and goes back to the queue.
    _shutdown.set()


@worker_ready.connect
def _start_background_threads(**_: Any) -> None:
    """Training workers also watch for lost workers and a lost broker, relay the outbox, advance sweeps and send
    webhooks."""
    if "training" not in os.environ.get("TRAINSERVE_WORKER_QUEUES", "training").split(","):
        return
    from core.relay import relay_thread
    from core.sweeps import sweep_thread
    from core.webhook_sender import sender_thread
    from worker.recovery import reaper_thread

    ctx = context()
    reaper_thread(ctx.sessions, ctx.settings, ctx.queue).start()
    relay_thread(ctx.sessions, ctx.queue, ctx.settings.outbox_interval_s).start()
    sender_thread(ctx.sessions, ctx.settings).start()
    sweep_thread(ctx.sessions, ctx.queue, ctx.settings.sweep_interval_s).start()


worker_ready.connect(lambda **_: start_reporting(context()), weak=False)  # device capacity, for admission
