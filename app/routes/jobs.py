"""Job routes: create, poll, list, history, events, cancel, artifacts."""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, Query, Request
from fastapi.responses import StreamingResponse

from app.deps import IdempotencyKeyDep, PrincipalDep, QueueDep, SessionDep, SettingsDep, StorageDep
from app.errors import ERROR_RESPONSES
from app.limits import TenantSlots
from app.routes.generation import SSE_HEADERS, STREAM_DOC
from app.schemas.common import Page
from app.schemas.jobs import (
    INT32_MAX,
    CheckpointList,
    EventList,
    EventRead,
    JobComparison,
    JobCreate,
    JobRead,
    MetricHistory,
    MetricPointRead,
)
from app.services import artifacts as artifact_service
from app.services import checkpoints as checkpoint_service
from app.services import job_stream, reruns
from app.services import jobs as service
from core.store import history
from core.store import jobs as store

router = APIRouter(prefix="/jobs", tags=["jobs"], responses=ERROR_RESPONSES)

StatusFilter = Annotated[str | None, Query(pattern="^(queued|running|succeeded|failed|cancelled)$")]


@router.post("", status_code=201, response_model=JobRead)
def create_job(spec: Annotated[JobCreate, Body()], session: SessionDep, settings: SettingsDep, queue: QueueDep,
               principal: PrincipalDep, idempotency_key: IdempotencyKeyDep) -> JobRead:
    """Start a fine-tune; answers at once with the queued job. A retry with the same Idempotency-Key and
    body returns the first job."""
    job = service.create_job(session, settings, queue, principal, spec=spec, idempotency_key=idempotency_key)
    return service.job_detail(session, settings, job)


@router.get("", response_model=Page[JobRead])
def list_jobs(session: SessionDep, principal: PrincipalDep, status: StatusFilter = None,
              limit: Annotated[int, Query(ge=1, le=100)] = 20,
              cursor: Annotated[str | None, Query(max_length=200)] = None) -> Page[JobRead]:
    """Jobs, newest first, optionally filtered by status."""
    rows, next_cursor = service.list_jobs(session, principal, limit=limit, status=status, cursor=cursor)
    return Page[JobRead](data=service.read_jobs(session, rows), has_more=next_cursor is not None,
                         next_cursor=next_cursor)


@router.get("/compare", response_model=JobComparison)
def compare_jobs(session: SessionDep, principal: PrincipalDep,
                 ids: Annotated[str, Query(min_length=3, max_length=500, description="Comma-separated job ids.")]
                 ) -> JobComparison:
    """What differs between jobs: settings and receipt fields (code, libraries, device, precision, data, seed)."""
    return reruns.compare_jobs(session, principal, ids=ids.split(","))


@router.get("/{job_id}", response_model=JobRead)
def get_job(job_id: str, session: SessionDep, settings: SettingsDep, principal: PrincipalDep) -> JobRead:
    """Status, progress, ETA, latest metrics and receipt of a job; while queued, its position and why it waits."""
    return service.job_detail(session, settings, service.get_job(session, principal, job_id=job_id))


@router.post("/{job_id}/rerun", status_code=201, response_model=JobRead)
def rerun_job(job_id: str, session: SessionDep, settings: SettingsDep, queue: QueueDep, principal: PrincipalDep,
              idempotency_key: IdempotencyKeyDep) -> JobRead:
    """Start an identical job: same resolved configuration, datasets and seed. Honors Idempotency-Key."""
    job = reruns.rerun_job(session, settings, queue, principal, job_id=job_id, idempotency_key=idempotency_key)
    return service.job_detail(session, settings, job)


@router.get("/{job_id}/metrics", response_model=MetricHistory)
def get_metrics(job_id: str, session: SessionDep, principal: PrincipalDep,
                since_step: Annotated[int, Query(ge=0, le=INT32_MAX)] = 0,
                name: Annotated[list[str] | None, Query(max_length=20)] = None,
                limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
                max_points: Annotated[int | None, Query(ge=10, le=10_000, description=(
                    "Downsample: at most this many points per metric over the whole history from since_step, "
                    "the lowest and highest value of each bucket of steps (limit does not apply)."))] = None,
                ) -> MetricHistory:
    """Per-step metric history (train_loss, learning_rate, eval_*...) for charts."""
    service.get_job(session, principal, job_id=job_id)
    if max_points is not None:
        reduced, width = history.downsampled_points(session, job_id=job_id, since_step=since_step,
                                                    max_points=max_points, names=name)
        return MetricHistory(job_id=job_id, data=[MetricPointRead.model_validate(p) for p in reduced],
                             next_since_step=None, bucket_steps=width)
    points = store.list_metric_points(session, job_id=job_id, since_step=since_step, names=name, limit=limit)
    next_step = points[-1].step if len(points) == limit else None
    return MetricHistory(job_id=job_id, data=[MetricPointRead.model_validate(p) for p in points],
                         next_since_step=next_step)


@router.get("/{job_id}/events", response_model=EventList, responses=STREAM_DOC)
def get_events(job_id: str, request: Request, session: SessionDep, principal: PrincipalDep,
               after: Annotated[int, Query(ge=0, le=INT32_MAX)] = 0,
               limit: Annotated[int, Query(ge=1, le=1000)] = 100,
               stream: Annotated[bool, Query(description="Server-sent events: state, job_event, metrics, end; "
                                                         "resume with Last-Event-ID.")] = False,
               since_step: Annotated[int, Query(ge=0, le=INT32_MAX, description=(
                   "stream only: send metric points from this step (default: all)"))] = 0,
               last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", max_length=40)] = None,
               ) -> Any:
    """The job's event log, oldest first; pass the last id as ?after= to poll for new ones, or ?stream=true."""
    service.get_job(session, principal, job_id=job_id)
    if stream:
        cursor = job_stream.Cursor.parse(last_event_id) if last_event_id else job_stream.Cursor(after, 0)
        slots: job_stream.StreamSlots = request.app.state.event_streams
        slots.check(principal.tenant_id)
        session.close()  # the stream reads with short sessions of its own; it holds no connection while idle
        feed = job_stream.job_feed(request.app.state.sessionmaker, request.app.state.settings, slots,
                                   tenant=principal.tenant_id, job_id=job_id, cursor=cursor, since_step=since_step,
                                   disconnected=request.is_disconnected)
        return StreamingResponse(feed, media_type="text/event-stream", headers=SSE_HEADERS)
    events = store.list_events(session, job_id=job_id, after_id=after, limit=limit)
    return EventList(job_id=job_id, data=[EventRead.model_validate(e) for e in events])


@router.get("/{job_id}/checkpoints", response_model=CheckpointList)
def list_checkpoints(job_id: str, session: SessionDep, principal: PrincipalDep,
                     since_step: Annotated[int, Query(ge=0, le=INT32_MAX)] = 0,
                     limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> CheckpointList:
    """Every evaluation with its metrics, which one is best (the served model) and what can be downloaded."""
    return checkpoint_service.list_checkpoints(session, principal, job_id=job_id, since_step=since_step, limit=limit)


@router.post("/{job_id}/cancel", response_model=JobRead)
def cancel_job(job_id: str, session: SessionDep, queue: QueueDep, principal: PrincipalDep) -> JobRead:
    """Cancel: queued jobs end at once; running ones stop after the current optimizer step."""
    return service.job_read(service.cancel_job(session, queue, principal, job_id=job_id))


@router.get("/{job_id}/artifacts/{artifact_id}/download", response_class=StreamingResponse,
            responses={200: {"content": {"application/x-tar": {}}}})
def download_artifact(job_id: str, artifact_id: str, request: Request, session: SessionDep, storage: StorageDep,
                      principal: PrincipalDep) -> StreamingResponse:
    """A model or checkpoint folder as a tar archive, streamed from the artifact store (429 beyond the tenant's
    concurrent downloads)."""
    slots: TenantSlots = request.app.state.downloads
    slots.check(principal.tenant_id)
    download = artifact_service.find_download(session, principal, job_id=job_id, artifact_id=artifact_id)
    session.close()  # the archive streams for as long as the client reads: never with a database connection
    download = artifact_service.list_files(storage, download, artifact_id=artifact_id)
    slots.acquire(principal.tenant_id)
    return artifact_service.SlotResponse(
        artifact_service.tar_stream(storage, download), release=partial(slots.release, principal.tenant_id),
        media_type="application/x-tar",
        headers={"content-length": str(download.size),
                 "content-disposition": f'attachment; filename="{download.filename}"'})
