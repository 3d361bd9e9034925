"""The in-process generation worker of the API tests: the worker's real `serve` function run in threads through
the recording queue (the Celery hop replaced), and a tiny GPT-2 it serves."""

from __future__ import annotations

import pytest

from core.tasks import TASK_GENERATE
from tests.tiny_lm import build_tiny_gpt2


@pytest.fixture()
def worker_ctx(settings, queue):
    """The generation worker's context; its tasks run in threads through the recording queue."""
    from worker.context import WorkerContext
    from worker.servers import generation as serving

    ctx = WorkerContext(settings, queue)
    queue.handlers[TASK_GENERATE] = lambda payload: serving.serve(ctx, payload)
    yield ctx
    ctx.service("generation", serving.GenerationService.build).registry.close()
    ctx.close()


@pytest.fixture()
def served(settings, worker_ctx):
    """A tiny GPT-2 installed as <home>/models/tiny (64 positions), served in-process (in fp32, as the test settings
    ask)."""
    return build_tiny_gpt2(settings.home / "models" / "tiny", n_positions=64)
