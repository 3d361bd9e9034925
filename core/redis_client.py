"""A plain Redis client for the broker URL (Celery's redis+socket:// form included)."""

from __future__ import annotations

from urllib.parse import urlparse

import redis
import redis.asyncio


def redis_from_url(url: str, **kwargs: object) -> redis.Redis:
    """redis://, rediss://, unix:// and Celery's redis+socket:///path all work."""
    if url.startswith("redis+socket://"):
        parsed = urlparse(url)
        return redis.Redis(unix_socket_path=parsed.path, **kwargs)  # type: ignore[arg-type]
    return redis.Redis.from_url(url, **kwargs)  # type: ignore[arg-type]


def async_redis_from_url(url: str, **kwargs: object) -> redis.asyncio.Redis:
    """The asyncio client for the same URL forms."""
    import redis.asyncio as aioredis

    if url.startswith("redis+socket://"):
        return aioredis.Redis(unix_socket_path=urlparse(url).path, **kwargs)  # type: ignore[arg-type]
    return aioredis.Redis.from_url(url, **kwargs)  # type: ignore[arg-type]
