"""Predictions from a fine-tuned model, computed on an inference worker that keeps it warm."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from core.auth import Principal
from core.errors import NotFound, ValidationFailed
from core.models import JobStatus, TaskKind
from core.queue import TaskQueue
from core.settings import Settings
from core.store import jobs as store
from core.tasks import QUEUE_INFERENCE, TASK_CLASSIFY


def classify(session: Session, settings: Settings, queue: TaskQueue, principal: Principal, *, model: str,
             texts: list[str]) -> list[dict[str, Any]]:
    """Check the model is a finished classifier, then ask a worker for predictions."""
    if len(texts) > settings.max_classify_texts:
        raise ValidationFailed("texts", f"at most {settings.max_classify_texts} texts per request")
    for index, text in enumerate(texts):
        if not text.strip():
            raise ValidationFailed(f"texts.{index}", "text is empty")
    try:
        job = store.get_job(session, job_id=model, tenant=principal.scope)
    except NotFound as exc:
        raise NotFound(f"model {model!r} not found", field="model") from exc
    if job.task != TaskKind.TEXT_CLASSIFICATION:
        raise ValidationFailed("model", f"job {model!r} is a {job.task} job, not a classifier")
    if job.status != JobStatus.SUCCEEDED:
        raise ValidationFailed("model", f"job {model!r} is {job.status}; only succeeded jobs serve predictions")
    session.close()  # do not hold a connection while the worker computes
    result: list[dict[str, Any]] = queue.call(TASK_CLASSIFY, [model, texts], queue=QUEUE_INFERENCE,
                                              timeout=settings.classify_timeout_s)
    return result
