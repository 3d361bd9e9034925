"""A training worker's device capacity, reported to Redis when it starts and refreshed while it lives."""

from __future__ import annotations

import logging
import os
import socket
import threading

import redis

from core import capacity
from worker.context import WorkerContext, takes_training_jobs

log = logging.getLogger(__name__)


def measure(ctx: WorkerContext) -> capacity.DeviceCapacity:
    """This worker's device and the memory a job on it may use (the setting, else the device's total)."""
    from worker.engines.device import bf16_supported, device_memory, resolve_device

    plan = resolve_device(ctx.settings.worker_device)
    total = ctx.settings.worker_memory_bytes or device_memory(plan)
    if not plan.is_cuda:  # N processes on one CPU share its RAM; N GPUs have their own memory each
        total //= ctx.settings.worker_devices
    return capacity.DeviceCapacity(worker=f"{socket.gethostname()}:{os.getpid()}", device=plan.device,
                                   total_bytes=total, devices=ctx.settings.worker_devices,
                                   bf16=plan.is_cuda and bf16_supported(plan.device))


class CapacityReporter(threading.Thread):
    """Publishes the report now, then every third of its TTL until the worker shuts down (then withdraws it)."""

    def __init__(self, ctx: WorkerContext, report: capacity.DeviceCapacity) -> None:
        super().__init__(name="capacity-reporter", daemon=True)
        self.ctx = ctx
        self.report = report
        self.publish()

    def publish(self) -> None:
        """Write or refresh the report; a Redis outage is logged and retried at the next refresh."""
        try:
            capacity.publish(self.ctx.redis, self.report, ttl_s=self.ctx.settings.capacity_ttl_s)
        except redis.RedisError as exc:
            log.warning("could not report device capacity: %s", exc)

    def run(self) -> None:
        """Refresh until shutdown, then withdraw the report so admission stops counting this device."""
        while not self.ctx.shutdown.wait(self.ctx.settings.capacity_ttl_s / 3):
            self.publish()
        try:
            capacity.withdraw(self.ctx.redis, self.report.worker)
        except redis.RedisError:
            pass  # the TTL removes it


def start_reporting(ctx: WorkerContext) -> CapacityReporter | None:
    """Start reporting in a worker that takes training jobs (others run no jobs, so they report nothing)."""
    if not takes_training_jobs():
        return None
    reporter = CapacityReporter(ctx, measure(ctx))
    reporter.start()
    log.info("reporting %d x %s with %d bytes each for admission", reporter.report.devices, reporter.report.device,
             reporter.report.total_bytes)
    return reporter
