"""Every Redis key trainserve writes, in one place (the broker's own keys are Celery's)."""

from __future__ import annotations

PREFIX = "trainserve:"
CAPACITY_PREFIX = f"{PREFIX}capacity:"  # + worker: a training worker's device report, with a TTL (core.capacity)
BROKER_SENTINEL = f"{PREFIX}broker-sentinel"  # present while the broker kept its data (worker.jobs.recovery)


def capacity_key(worker: str) -> str:
    """A training worker's device-capacity report."""
    return CAPACITY_PREFIX + worker


def gang_key(job_id: str, attempt: int) -> str:
    """Redis list the workers joining a job's attempt on several nodes push their answers to (core.gang)."""
    return f"{PREFIX}gang:{job_id}:{attempt}"


def stream_key(request_id: str) -> str:
    """Redis stream a generation worker writes a request's events to."""
    return f"{PREFIX}gen:{request_id}"


def cancel_key(request_id: str) -> str:
    """Redis key the API sets when a client goes away, so the worker frees the request's batch slot."""
    return f"{PREFIX}gen:{request_id}:cancel"


def slots_key(model_id: str) -> str:
    """Sorted set of a model's generation rows in flight (the per-model queue limit; n choices take n rows)."""
    return f"{PREFIX}slots:{model_id}"


def tenant_slots_key(model_id: str, tenant_id: str) -> str:
    """Sorted set of one tenant's generation rows in flight on a model (its share of the per-model limit)."""
    return f"{PREFIX}slots:{model_id}:tenant:{tenant_id}"


def uploads_key(tenant_id: str) -> str:
    """A tenant's uploads in progress, across API processes: a bounded window (app.redis_window)."""
    return f"{PREFIX}uploads:{tenant_id}"


def inference_key(tenant_id: str) -> str:
    """A tenant's /v1/embeddings and /classify requests in flight, across API processes (app.redis_window)."""
    return f"{PREFIX}inference:{tenant_id}"


def rate_key(api_key_id: str) -> str:
    """Sorted set of an API key's generation requests in the last minute (the rate limit)."""
    return f"{PREFIX}rate:{api_key_id}"


def classify_reply_key(request_id: str) -> str:
    """Redis list an inference worker pushes a /classify call's result to."""
    return f"{PREFIX}classify:{request_id}:reply"


def abandoned_key(request_id: str) -> str:
    """Redis key the API sets when it stops waiting, so a worker skips the task instead of running it."""
    return f"{PREFIX}classify:{request_id}:abandoned"


def embed_reply_key(request_id: str) -> str:
    """Redis list an inference worker pushes a /v1/embeddings call's result to."""
    return f"{PREFIX}embed:{request_id}:reply"


def tenant_batches_key(tenant_id: str) -> str:
    """Sorted set of a tenant's running batches (id, last heartbeat): the per-tenant bound on running batches."""
    return f"{PREFIX}batch-runs:{tenant_id}"


def batch_lock_key(batch_id: str) -> str:
    """The lease of the one task running a batch (its token; expires unless its runner renews it)."""
    return f"{PREFIX}batch-run:{batch_id}"
