"""The worker's Celery app: the shared configuration plus this package's tasks, and the process's context."""

from __future__ import annotations

import os
import threading
from typing import Any

from celery.signals import (
    setup_logging,
    task_postrun,
    task_prerun,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)

from core.celery_app import make_celery
from worker.context import WorkerContext, takes_training_jobs
from worker.jobs.capacity import start_reporting

celery = make_celery()
celery.conf.update(include=["worker.tasks"])


def _load_job_kinds() -> None:
    """The job kinds of TRAINSERVE_JOB_KIND_MODULES, before the pool forks or any task runs; on a training worker,
    every registered kind's engine entries, resolved and checked (IncompleteKind: the worker does not start)."""
    from core.jobspec import load_kind_modules
    from core.settings import get_settings

    load_kind_modules(get_settings().job_kind_module_names)
    if takes_training_jobs():
        from worker.engines.training.kinds import check_kinds

        check_kinds()


_load_job_kinds()

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


@worker_shutdown.connect
def _close_services(**_: Any) -> None:
    """The process's services let go of what they hold (a vLLM engine's server) as the worker exits."""
    if _context is not None:
        _context.close()


@worker_ready.connect
def _start_background_threads(**_: Any) -> None:
    """Training workers also watch for lost workers and a lost broker, relay the outbox, advance sweeps and send
    webhooks."""
    if not takes_training_jobs():
        return
    from core.relay import relay_thread
    from core.sweeps import sweep_thread
    from core.webhook_sender import sender_thread
    from worker.jobs.recovery import reaper_thread

    ctx = context()
    reaper_thread(ctx.sessions, ctx.settings, ctx.queue).start()
    relay_thread(ctx.sessions, ctx.queue, ctx.settings.outbox_interval_s).start()
    sender_thread(ctx.sessions, ctx.settings).start()
    sweep_thread(ctx.sessions, ctx.queue, ctx.settings).start()


worker_ready.connect(lambda **_: start_reporting(context()), weak=False)  # device capacity, for admission


@worker_ready.connect
def _resume_batches(**_: Any) -> None:
    """Generation workers hand on the /v1/batches of a worker that died (worker.batches.leases)."""
    from core.tasks import QUEUE_GENERATE

    if QUEUE_GENERATE in os.environ.get("TRAINSERVE_WORKER_QUEUES", "").split(","):
        from worker.batches.leases import batch_reaper

        batch_reaper(context()).start()


@worker_ready.connect
def _serve_metrics(**_: Any) -> None:
    """This worker's Prometheus /metrics on its own port (TRAINSERVE_WORKER_METRICS_PORT; 0: none)."""
    port = context().settings.worker_metrics_port
    if port:
        from worker.metrics import serve_metrics

        serve_metrics(port)


@setup_logging.connect
def _setup_logging(loglevel: Any = None, **_: Any) -> None:
    # Connecting here replaces Celery's own logging setup: text or JSON lines as the settings say.
    from core.logs import configure_logging
    from core.settings import get_settings

    configure_logging(get_settings().log_format, loglevel or "INFO")


_bindings: dict[str, Any] = {}  # task id -> the context-variable tokens its prerun set


@task_prerun.connect
def _bind_request_id(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    """Log a task's lines under the request id the API sent in its headers (the job id is bound by the task)."""
    from core.logs import REQUEST_ID_HEADER, request_id_var

    request_id = getattr(task.request, REQUEST_ID_HEADER, None) if task is not None else None
    if request_id and task_id:
        _bindings[task_id] = request_id_var.set(str(request_id))


@task_postrun.connect
def _unbind_request_id(task_id: str | None = None, **_: Any) -> None:
    from core.logs import request_id_var

    token = _bindings.pop(task_id or "", None)
    if token is not None:
        request_id_var.reset(token)
