"""The Celery application shared by the API (to send) and the workers (to consume)."""

from __future__ import annotations

from celery import Celery
from kombu import Queue

from core.settings import Settings, get_settings
from core.tasks import (
    QUEUE_GENERATE,
    QUEUE_INFERENCE,
    QUEUE_TRAIN,
    TASK_BATCH,
    TASK_CLASSIFY,
    TASK_EMBED,
    TASK_GENERATE,
    TASK_JOIN,
    TASK_TRAIN,
)


def make_celery(settings: Settings | None = None) -> Celery:
    """Build a Celery app configured for long GPU tasks."""
    settings = settings or get_settings()
    url = settings.resolved_redis_url
    app = Celery("trainserve", broker=url, backend=url)
    app.conf.update(
        task_queues=[Queue(QUEUE_TRAIN), Queue(QUEUE_INFERENCE), Queue(QUEUE_GENERATE)],
        task_routes={TASK_TRAIN: {"queue": QUEUE_TRAIN}, TASK_JOIN: {"queue": QUEUE_TRAIN},
                     TASK_CLASSIFY: {"queue": QUEUE_INFERENCE}, TASK_EMBED: {"queue": QUEUE_INFERENCE},
                     TASK_GENERATE: {"queue": QUEUE_GENERATE}, TASK_BATCH: {"queue": QUEUE_GENERATE}},
        task_default_queue=QUEUE_TRAIN,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        # A training task is acknowledged only when it ends, so a killed worker's job is redelivered;
        # the job row (not the message) decides whether redelivered work still needs doing.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options={"visibility_timeout": settings.visibility_timeout_s},
        result_backend_transport_options={"visibility_timeout": settings.visibility_timeout_s},
        result_expires=3600,
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=3,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        task_send_sent_event=False,
    )
    return app
