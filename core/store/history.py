"""Chart reads of a job's metric history: min/max downsampling and the id-ordered tail a live stream follows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core.rows import MetricPoint

SCAN_BATCH = 5000  # rows fetched per round trip while downsampling: memory stays bounded by the output


@dataclass(frozen=True)
class Point:
    """One metric value; `id` orders points in the order they were stored."""

    id: int
    step: int
    epoch: float
    name: str
    value: float
    created_at: datetime


# Plain columns, not ORM objects: a long history is scanned row by row and entities cost several times more.
COLUMNS = (MetricPoint.id, MetricPoint.step, MetricPoint.epoch, MetricPoint.name, MetricPoint.value,
           MetricPoint.created_at)


def bucket_width(session: Session, *, job_id: str, since_step: int, max_points: int) -> int:
    """Steps per bucket so that every metric has at most `max_points` points (two per bucket: min and max)."""
    last = session.scalar(select(func.max(MetricPoint.step)).where(MetricPoint.job_id == job_id,
                                                                   MetricPoint.step >= since_step))
    if last is None:
        return 1
    buckets = max(1, max_points // 2)
    span = last - since_step + 1
    # Up to max_points steps fit as they are: downsample only past that.
    return 1 if span <= max_points else math.ceil(span / buckets)


def downsampled_points(session: Session, *, job_id: str, since_step: int, max_points: int,
                       names: Sequence[str] | None = None) -> tuple[list[Point], int]:
    """Each metric's history from `since_step`, reduced to the lowest and the highest point of each bucket of
    steps (so spikes and minima survive), ordered by step then name; returns the points and the bucket width."""
    width = bucket_width(session, job_id=job_id, since_step=since_step, max_points=max_points)
    query = (select(*COLUMNS).where(MetricPoint.job_id == job_id, MetricPoint.step >= since_step)
             .order_by(MetricPoint.name, MetricPoint.step))
    if names:
        query = query.where(MetricPoint.name.in_(list(names)))
    if width == 1:
        # At most max_points steps from since_step: every point fits.
        points = [Point(*r) for r in session.execute(query)]
        return sorted(points, key=lambda p: (p.step, p.name)), 1
    kept: list[Point] = []
    current: tuple[str, int] | None = None
    low: Point | None = None
    high: Point | None = None
    for row in session.execute(query.execution_options(yield_per=SCAN_BATCH)):
        key = (row.name, (row.step - since_step) // width)
        if key != current:
            kept.extend(_pair(low, high))
            current, low, high = key, None, None
        if low is None or row.value < low.value:
            low = Point(*row)
        if high is None or row.value > high.value:
            high = Point(*row)
    kept.extend(_pair(low, high))
    return sorted(kept, key=lambda p: (p.step, p.name)), width


def _pair(low: Point | None, high: Point | None) -> list[Point]:
    """A bucket's min and max in step order (one point when they are the same)."""
    if low is None or high is None:
        return []
    if low.id == high.id:
        return [low]
    return sorted((low, high), key=lambda p: p.step)


def points_after(session: Session, *, job_id: str, after_id: int, since_step: int = 0, limit: int = 1000
                 ) -> list[Point]:
    """Points stored after point id `after_id`, in storage order (a live chart's tail)."""
    query = (select(*COLUMNS).where(MetricPoint.job_id == job_id, MetricPoint.id > after_id,
                                    MetricPoint.step >= since_step)
             .order_by(MetricPoint.id).limit(limit))
    return [Point(*r) for r in session.execute(query)]



# Which way is better for each metric a dashboard ranks jobs by.
HIGHER_IS_BETTER = ("eval_accuracy", "eval_f1")
LOWER_IS_BETTER = ("eval_loss", "perplexity")


def best_metrics(session: Session, *, job_ids: Sequence[str]) -> dict[str, dict[str, float]]:
    """The best value each job reached of its evaluation metrics, in one grouped query for a page of jobs."""
    if not job_ids:
        return {}
    query = (select(MetricPoint.job_id, MetricPoint.name, func.min(MetricPoint.value), func.max(MetricPoint.value))
             .where(MetricPoint.job_id.in_(list(job_ids)),
                    MetricPoint.name.in_([*HIGHER_IS_BETTER, *LOWER_IS_BETTER]))
             .group_by(MetricPoint.job_id, MetricPoint.name))
    best: dict[str, dict[str, float]] = {}
    for job_id, name, low, high in session.execute(query):
        best.setdefault(job_id, {})[name] = high if name in HIGHER_IS_BETTER else low
    return best
