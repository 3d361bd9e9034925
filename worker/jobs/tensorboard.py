"""TensorBoard event files beside a job's artifacts (<job dir>/tensorboard), written by a reporter sink."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from core.paths import job_dir
from core.settings import Settings
from worker.engines.training.loop import TrainCallbacks

log = logging.getLogger(__name__)

TENSORBOARD_DIRNAME = "tensorboard"


def tensorboard_dir(settings: Settings, job_id: str) -> Path:
    """Where a job's event files go: <home>/jobs/<id>/tensorboard (point `tensorboard --logdir` at it)."""
    return job_dir(settings, job_id) / TENSORBOARD_DIRNAME


class TensorBoardSink(TrainCallbacks):
    """Writes every logged and evaluated metric as a scalar (`train/<name>`, `eval/<name>`) at its step."""

    def __init__(self, folder: Path, hyperparameters: dict[str, Any] | None = None) -> None:
        self.folder = folder
        self.hyperparameters = hyperparameters or {}
        self.writer: Any = None

    def on_start(self, info: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        resumed = int(info.get("resumed_from_step") or 0)
        # A resumed attempt writes a new event file; purge_step makes TensorBoard drop the points the lost
        # attempt wrote after the checkpoint it resumes from, so the curve is neither duplicated nor shifted.
        self.writer = SummaryWriter(str(self.folder), purge_step=resumed + 1 if resumed else None, flush_secs=10)
        if not resumed and self.hyperparameters:
            text = "\n".join(f"    {k}: {v}" for k, v in sorted(self.hyperparameters.items()))
            self.writer.add_text("hyperparameters", text, 0)

    def on_log(self, step: int, epoch: float, metrics: dict[str, float]) -> None:
        if self.writer is None:
            return
        for name, value in metrics.items():
            self.writer.add_scalar(f"train/{name}", value, step)
        self.writer.add_scalar("train/epoch", epoch, step)

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        if self.writer is None:
            return
        for name, value in metrics.items():
            self.writer.add_scalar(f"eval/{name.removeprefix('eval_')}", value, step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
