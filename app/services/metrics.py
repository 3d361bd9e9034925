"""The API's /metrics: its own request families plus gauges read from SQL and the broker at scrape time.

Job states and queue depth come from the database (the truth about jobs), so every API replica reports the
same values; workers' families (throughput, step time, tokens) are scraped from each worker's own port.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from redis.asyncio import Redis
from redis.exceptions import RedisError
from sqlalchemy.orm import Session

from core.rows import JobStatus, utcnow
from core.store import jobs as store
from core.tasks import QUEUE_GENERATE, QUEUE_INFERENCE, QUEUE_TRAIN


class _Snapshot:
    """Metric families computed once for one scrape, in the shape generate_latest() reads."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def job_families(session: Session) -> list[Metric]:
    """Jobs by status (every status, zeros included) and the age of the oldest queued job."""
    counts = store.status_counts(session)
    jobs = GaugeMetricFamily("trainserve_jobs", "Jobs by status (all tenants)", labels=["status"])
    for status in JobStatus:
        jobs.add_metric([str(status)], counts.get(str(status), 0))
    depth = GaugeMetricFamily("trainserve_queue_depth", "Jobs waiting for a training worker",
                              value=counts.get(JobStatus.QUEUED, 0))
    oldest = store.oldest_queued_at(session)
    wait = GaugeMetricFamily("trainserve_queue_oldest_wait_seconds", "Age of the oldest queued job (0: none)",
                             value=max((utcnow() - oldest).total_seconds(), 0.0) if oldest else 0.0)
    return [jobs, depth, wait]


async def broker_families(redis: Redis) -> list[Metric]:
    """Messages waiting in each broker queue (Celery's Redis transport keeps a queue as a list)."""
    family = GaugeMetricFamily("trainserve_broker_queue_length", "Task messages waiting in a broker queue",
                               labels=["queue"])
    for queue in (QUEUE_TRAIN, QUEUE_INFERENCE, QUEUE_GENERATE):
        try:
            family.add_metric([queue], await redis.llen(queue))  # type: ignore[misc]
        except RedisError:
            continue  # the broker being away shows as missing samples, not a failed scrape
    return [family]


def render(registry: CollectorRegistry, families: list[Metric]) -> bytes:
    """The text exposition of the app's registry followed by this scrape's families."""
    return generate_latest(registry) + generate_latest(_Snapshot(families))  # type: ignore[arg-type]
