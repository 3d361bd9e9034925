"""The FastAPI application factory. Imports neither torch nor transformers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from app.access_log import install_access_log_redaction
from app.errors import install_error_handlers
from app.limits import BodyLimitMiddleware, RefusalBudgetMiddleware, TenantSlots, UploadSlotsMiddleware
from app.observability import HttpMetrics, ObservabilityMiddleware
from app.routes import (
    aliases,
    batches,
    classify,
    datasets,
    embeddings,
    evals,
    files,
    fine_tuning,
    generation,
    graders,
    health,
    jobs,
    metrics,
    responses,
    sweeps,
    webhooks,
)
from app.routes.dashboard import mount_dashboard
from app.security_headers import SecurityHeadersMiddleware
from app.services.generation import GenerationGateway
from app.services.job_kinds import check_kinds
from app.services.job_stream import StreamSlots
from core.celery_app import make_celery
from core.db import make_engine, make_sessionmaker
from core.jobspec import load_kind_modules
from core.protocol import ErrorCode
from core.queue import CeleryTaskQueue, TaskQueue
from core.redis_client import async_redis_from_url
from core.relay import relay_thread
from core.settings import Settings, get_settings
from core.storage import open_storage


async def _close_redis(redis: Redis) -> None:
    """Close the app's Redis client. Under uvicorn every connection belongs to the app's one event loop; an ASGI
    caller that drives requests from loops of its own (an in-process test client) leaves connections this loop
    cannot close, which are dropped instead of failing the shutdown."""
    try:
        await redis.aclose()
    except RuntimeError:  # "attached to a different loop": those sockets close when collected
        pass


def create_app(settings: Settings | None = None, task_queue: TaskQueue | None = None) -> FastAPI:
    """Build the app; the lifespan creates and disposes the database engine and broker client."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        resolved = settings or get_settings()
        engine = make_engine(resolved.resolved_database_url, pool_size=resolved.db_pool_size,
                             max_overflow=resolved.db_max_overflow, pool_timeout_s=resolved.db_pool_timeout_s)
        celery = None if task_queue is not None else make_celery(resolved)
        app.state.settings = resolved
        app.state.storage = open_storage(resolved)
        app.state.engine = engine
        app.state.sessionmaker = make_sessionmaker(engine)
        app.state.task_queue = task_queue or CeleryTaskQueue(celery)  # type: ignore[arg-type]
        redis = async_redis_from_url(resolved.resolved_redis_url, socket_timeout=10)
        app.state.redis = redis
        app.state.generation = GenerationGateway(redis, app.state.task_queue, resolved)
        app.state.event_streams = StreamSlots(resolved.event_streams_per_tenant)
        app.state.downloads = TenantSlots(resolved.max_downloads_per_tenant, code=ErrorCode.TOO_MANY_DOWNLOADS,
                                          what="artifact downloads are in progress")
        # Sends task messages whose fast path found the broker refusing (the job stays queued meanwhile).
        relay = relay_thread(app.state.sessionmaker, app.state.task_queue, resolved.outbox_interval_s)
        relay.start()
        try:
            yield
        finally:
            relay.stop()
            await app.state.generation.drain()
            await _close_redis(redis)
            engine.dispose()
            if celery is not None:
                celery.close()

    load_kind_modules((settings or get_settings()).job_kind_module_names)  # before any request or the document
    check_kinds()  # every kind it now knows has its admission checks (IncompleteKind: no app)
    app = FastAPI(title="trainserve", version="0.1.0", lifespan=lifespan,
                  description="Fine-tune BERT classifiers and serve the results.")
    install_error_handlers(app)
    install_access_log_redaction()
    app.add_middleware(UploadSlotsMiddleware, settings=settings or get_settings())
    app.add_middleware(BodyLimitMiddleware, settings=settings or get_settings())  # outer: a 413 takes no slot
    # Outer still: a caller refused past its budget is answered before its body is paced, parsed or its key looked up.
    app.add_middleware(RefusalBudgetMiddleware, settings=settings or get_settings())
    origins = [o.strip() for o in (settings or get_settings()).cors_origins.split(",") if o.strip()]
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"])
    # Outermost: every answer (a 413 or a CORS refusal too) gets a request id and is counted.
    app.state.metrics_registry = CollectorRegistry(auto_describe=True)
    app.add_middleware(ObservabilityMiddleware, metrics=HttpMetrics(app.state.metrics_registry))
    app.add_middleware(SecurityHeadersMiddleware)  # outside everything: every answer carries them
    for router in (health.router, datasets.router, jobs.router, sweeps.router,
                   classify.router, embeddings.router, generation.router, responses.router,
                   files.router, fine_tuning.router, graders.router, evals.router, aliases.router, batches.router,
                   webhooks.router, metrics.router):
        app.include_router(router)
    mount_dashboard(app)
    return app
