"""Device capacity that training workers report to Redis (with a TTL) and the API reads for admission."""

from __future__ import annotations

import logging

import redis
from pydantic import BaseModel, ValidationError

from core.redis_client import redis_from_url
from core.redis_keys import CAPACITY_PREFIX, capacity_key

log = logging.getLogger(__name__)

class DeviceCapacity(BaseModel):
    """One live training worker's device: what a job on it may use at most."""

    worker: str  # host and process id: one key per worker process
    device: str  # "cuda:0" or "cpu"
    total_bytes: int  # per device
    devices: int = 1  # devices the worker owns: the most a job on it may train on
    bf16: bool = True  # a GPU that runs bf16 natively (precision "auto" is fp16 on one that does not)

    @property
    def is_cuda(self) -> bool:
        """True for a GPU (jobs there train in 16-bit autocast by default: core.precision)."""
        return self.device.startswith("cuda")


def publish(client: redis.Redis, capacity: DeviceCapacity, *, ttl_s: float) -> None:
    """Write (or refresh) a worker's report; it disappears ttl_s after the worker stops refreshing it."""
    client.set(capacity_key(capacity.worker), capacity.model_dump_json(), px=max(1, int(ttl_s * 1000)))


def withdraw(client: redis.Redis, worker: str) -> None:
    """Remove a worker's report at once (a clean shutdown)."""
    client.delete(capacity_key(worker))


def reported(client: redis.Redis) -> list[DeviceCapacity]:
    """Every live worker's report."""
    keys = list(client.scan_iter(match=CAPACITY_PREFIX + "*", count=500))
    values: list[bytes | None] = client.mget(keys) if keys else []  # type: ignore[assignment]
    found = []
    for raw in values:
        if raw is None:  # expired between SCAN and MGET
            continue
        try:
            found.append(DeviceCapacity.model_validate_json(raw))
        except ValidationError:
            log.warning("ignoring a malformed capacity report: %r", raw[:200])
    return found


def live_workers(redis_url: str) -> list[DeviceCapacity] | None:
    """Every live training worker's report; None when Redis cannot be read."""
    client = redis_from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
    try:
        return reported(client)
    except redis.RedisError as exc:
        # Admission then falls back to the configured cap; the enqueue right after reports the broker.
        log.warning("capacity reports unreadable (%s); using the configured cap", exc)
        return None
    finally:
        client.close()


def largest_device(redis_url: str, *, devices: int = 1) -> DeviceCapacity | None:
    """The live worker device with the most memory among workers owning `devices` or more; None if none."""
    workers = [w for w in live_workers(redis_url) or [] if w.devices >= devices]
    return max(workers, key=lambda d: d.total_bytes, default=None)
