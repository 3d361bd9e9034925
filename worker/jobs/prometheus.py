"""A reporter sink that feeds the worker's Prometheus families from the engine's training callbacks."""

from __future__ import annotations

import time
from typing import Any

from worker.engines.training.loop import TrainCallbacks
from worker.metrics import (
    DEVICE_MEMORY,
    JOBS_RUNNING,
    TRAIN_LOSS,
    TRAIN_SAMPLES_PER_SECOND,
    TRAIN_STEP_SECONDS,
    TRAIN_STEPS,
    TRAIN_TOKENS_PER_SECOND,
)


class TrainingMetrics(TrainCallbacks):
    """A reporter sink: throughput, step time, loss and device memory of the job this worker runs."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.last_step: tuple[int, float] | None = None
        self.running = False
        self.memory_read_at = 0.0

    def on_start(self, info: dict[str, Any]) -> None:
        self.device = str(info.get("device") or self.device)
        self.last_step = None
        if not self.running:
            self.running = True
            JOBS_RUNNING.inc()

    def on_log(self, step: int, epoch: float, metrics: dict[str, float]) -> None:
        from worker.engines.device import memory_in_use

        now = time.monotonic()
        if self.last_step is not None and step > self.last_step[0]:
            TRAIN_STEP_SECONDS.labels(self.device).observe((now - self.last_step[1]) / (step - self.last_step[0]))
        self.last_step = (step, now)
        TRAIN_STEPS.labels(self.device).inc()
        if "samples_per_second" in metrics:
            TRAIN_SAMPLES_PER_SECOND.labels(self.device).set(metrics["samples_per_second"])
        if "tokens_per_second" in metrics:
            TRAIN_TOKENS_PER_SECOND.labels(self.device).set(metrics["tokens_per_second"])
        if "train_loss" in metrics:
            TRAIN_LOSS.labels(self.device).set(metrics["train_loss"])
        if now - self.memory_read_at >= 1.0:  # a /proc read or a CUDA query: once a second is plenty
            self.memory_read_at = now
            DEVICE_MEMORY.labels(self.device).set(memory_in_use(self.device))

    def close(self) -> None:
        """The job ended on this worker."""
        if self.running:
            self.running = False
            JOBS_RUNNING.dec()
