"""OpenAI's /v1/fine_tuning/jobs: create, list, retrieve, cancel, events, checkpoints (the jobs of /jobs)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Query

from app.deps import IdempotencyKeyDep, PrincipalDep, QueueDep, SessionDep, SettingsDep, StorageDep
from app.errors import ERROR_RESPONSES
from app.schemas.fine_tuning import (
    FineTuningJob,
    FineTuningJobCheckpointList,
    FineTuningJobCreate,
    FineTuningJobEventList,
    FineTuningJobList,
)
from app.services import checkpoints, jobs
from app.services import fine_tuning as service

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["openai"], responses=ERROR_RESPONSES)
After = Annotated[str | None, Query(max_length=100, description="The last id of the previous page.")]


@router.post("", response_model=FineTuningJob)
def create_fine_tuning_job(body: Annotated[FineTuningJobCreate, Body()], session: SessionDep, settings: SettingsDep,
                           storage: StorageDep, queue: QueueDep, principal: PrincipalDep,
                           idempotency_key: IdempotencyKeyDep) -> FineTuningJob:
    """Start a fine-tune (the same job as POST /jobs would make); answers at once with the queued job."""
    job = service.create_job(session, settings, storage, queue, principal, body=body,
                             idempotency_key=idempotency_key)
    return service.read_job(session, job)


@router.get("", response_model=FineTuningJobList)
def list_fine_tuning_jobs(session: SessionDep, principal: PrincipalDep, after: After = None,
                          limit: Annotated[int, Query(ge=1, le=100)] = 20) -> FineTuningJobList:
    """The caller's jobs, newest first."""
    return service.list_jobs(session, principal, after=after, limit=limit)


@router.get("/{job_id}", response_model=FineTuningJob)
def retrieve_fine_tuning_job(job_id: str, session: SessionDep, principal: PrincipalDep) -> FineTuningJob:
    """Status, resolved hyperparameters, fine_tuned_model once it succeeded, error once it failed."""
    return service.read_job(session, service.get_job(session, principal, job_id=job_id))


@router.post("/{job_id}/cancel", response_model=FineTuningJob)
def cancel_fine_tuning_job(job_id: str, session: SessionDep, queue: QueueDep, principal: PrincipalDep
                           ) -> FineTuningJob:
    """Cancel: a queued job ends at once, a running one after its current optimizer step."""
    return service.read_job(session, jobs.cancel_job(session, queue, principal, job_id=job_id))


@router.get("/{job_id}/events", response_model=FineTuningJobEventList)
def list_fine_tuning_events(job_id: str, session: SessionDep, principal: PrincipalDep, after: After = None,
                            limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> FineTuningJobEventList:
    """The job's events, newest first."""
    return service.list_events(session, principal, job_id=job_id, after=after, limit=limit)


@router.get("/{job_id}/checkpoints", response_model=FineTuningJobCheckpointList)
def list_fine_tuning_checkpoints(job_id: str, session: SessionDep, principal: PrincipalDep, after: After = None,
                                 limit: Annotated[int, Query(ge=1, le=1000)] = 10) -> FineTuningJobCheckpointList:
    """The job's evaluations, newest first; the best one's fine_tuned_model_checkpoint is the job's model."""
    return checkpoints.fine_tuning_checkpoints(session, principal, job_id=job_id, after=after, limit=limit)
