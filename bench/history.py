"""Chart history of a long job: the whole raw history (paged, as a chart without downsampling must read it)
vs one `max_points` request (min and max per bucket). Prints bytes, points and milliseconds of each side.

Usage: PYTHONPATH=. python bench/history.py [--steps 50000] [--max-points 2000]
Needs PostgreSQL (TRAINSERVE_TEST_DATABASE_URL, default the test server); creates and drops its own database.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
import uuid

from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from app.main import create_app
from core import states
from core.auth import create_key
from core.db import make_engine, make_sessionmaker, session_scope
from core.migrate import upgrade
from core.rows import utcnow
from core.settings import Settings
from core.store import jobs as store

ADMIN = os.environ.get("TRAINSERVE_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
NAMES = ("train_loss", "learning_rate", "samples_per_second", "grad_norm")


def seed(url: str, steps: int) -> tuple[str, str]:
    """A dataset, a running job with `steps` steps of four metrics, and a key."""
    from core.rows import Dataset, Job, JobStatus, new_id

    engine = make_engine(url)
    with session_scope(make_sessionmaker(engine)) as session:
        _, key = create_key(session, name="bench", tenant_id="bench")
        dataset = Dataset(id=new_id("ds"), tenant_id="bench", name="d", filename="d.tsv", format="tsv", rows=1,
                          columns=["text"], column_stats={}, sha256="0" * 64, size_bytes=1, path="x")
        job = Job(id=new_id("job"), tenant_id="bench", status=JobStatus.QUEUED, task="text-classification",
                  train_dataset_id=dataset.id, text_column="text", hyperparameters={}, metrics={},
                  created_at=utcnow())
        session.add_all([dataset, job])
        session.flush()
        states.claim_job(session, job_id=job.id, device="cpu", now=utcnow(), stale_before=utcnow())
        for start in range(1, steps + 1, 2000):  # 2,000 steps x 4 metrics x 6 columns: under 65,535 parameters
            store.add_metric_points(session, job_id=job.id, attempt=1, points=[
                (s, s / 1000, name, math.exp(-s / steps) + (s % 17) / 100) for s in range(start, min(start + 2000,
                                                                                                 steps + 1))
                for name in NAMES])
            session.commit()
        job_id = job.id
    engine.dispose()
    return job_id, key


def timed(fn, repeats: int = 3) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000, result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50_000)
    parser.add_argument("--max-points", type=int, default=2000)
    args = parser.parse_args()
    admin = create_engine(ADMIN, isolation_level="AUTOCOMMIT")
    name = f"trainserve_bench_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(ADMIN).set(database=name).render_as_string(hide_password=False)
    try:
        upgrade(url)
        job_id, key = seed(url, args.steps)
        settings = Settings(database_url=url, redis_url=os.environ.get("TRAINSERVE_TEST_REDIS_URL",
                                                                       "redis://127.0.0.1:6379/0"))
        with TestClient(create_app(settings=settings)) as client:
            client.headers["Authorization"] = f"Bearer {key}"

            def raw() -> tuple[int, int]:
                size, count, since = 0, 0, 0
                while True:
                    response = client.get(f"/jobs/{job_id}/metrics", params={"since_step": since})
                    body = response.json()
                    size, count = size + len(response.content), count + len(body["data"])
                    if body["next_since_step"] is None:
                        return size, count
                    since = body["next_since_step"] + 1

            def reduced() -> tuple[int, int]:
                response = client.get(f"/jobs/{job_id}/metrics", params={"max_points": args.max_points})
                return len(response.content), len(response.json()["data"])

            raw_ms, (raw_bytes, raw_points) = timed(raw)  # type: ignore[misc]
            small_ms, (small_bytes, small_points) = timed(reduced)  # type: ignore[misc]
        print(f"{args.steps} steps x {len(NAMES)} metrics, load average {os.getloadavg()[0]:.1f}")
        print(f"raw history (paged by 10,000): {raw_points} points, {raw_bytes / 1e6:.1f} MB, {raw_ms:.0f} ms")
        print(f"max_points={args.max_points}: {small_points} points, {small_bytes / 1e6:.2f} MB, {small_ms:.0f} ms")
        print(f"ratio: {raw_bytes / small_bytes:.0f}x fewer bytes, {raw_ms / small_ms:.1f}x faster")
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


if __name__ == "__main__":
    main()
