"""A job kind added through the registry alone: its spec in core.jobspec, its engine in worker.engines.kinds.

The toy kind fits words per text from characters per text with one linear unit; nothing outside this file
knows it, yet it is validated, stored, claimed, trained by the one loop, checkpointed, evaluated and saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import pytest
import torch
from pydantic import Field
from safetensors.torch import save_file

from core.auth import Principal
from core.db import session_scope
from core.hyperparams import TrainingHyperparameters, default
from core.jobspec import JobKind, JobSpec, parse_spec, register, unregister
from tests.factories import sentiment_rows, tsv_bytes, upload

TOY = "text-length"
TENANT = Principal(key_id="key", tenant_id="tenant-a", is_admin=False)  # the tenant of the client's key


class ToyHyperparameters(TrainingHyperparameters):
    """The toy kind's hyperparameters and their defaults, in one place."""

    epochs: float = Field(20.0, gt=0, le=100)
    batch_size: int = Field(8, ge=1, le=64)
    learning_rate: float = Field(0.05, gt=0, le=1)
    weight_decay: float = Field(0.0, ge=0, le=1)
    seed: int = Field(7, ge=0)
    metric_for_best: str = "eval_mae"


class ToyJob(JobSpec):
    task: Literal["text-length"]
    hyperparameters: ToyHyperparameters = Field(default_factory=ToyHyperparameters)


@pytest.fixture(scope="module")
def toy_kind():
    from worker.engines import artifacts
    from worker.engines.kinds import ENGINE_KINDS, EngineKind
    from worker.engines.kinds import register as register_engine
    from worker.engines.loop import RunConfig, Setup

    @dataclass(frozen=True, kw_only=True)
    class ToyConfig(RunConfig):
        text_column: str
        epochs: float = default(ToyHyperparameters, "epochs")

    class ToyTask:
        unit = "samples"
        adam_betas = (0.9, 0.999)

        def __init__(self, config: ToyConfig) -> None:
            self.config = config

        def _rows(self, path) -> tuple[torch.Tensor, torch.Tensor]:
            from core.tabular import read_table

            texts = [str(row[self.config.text_column]) for row in read_table(path).rows]
            return (torch.tensor([[len(t) / 50.0] for t in texts]), torch.tensor([[len(t.split()) / 10.0]
                                                                                 for t in texts]))

        def build(self, plan) -> Setup:
            self.x, self.y = self._rows(self.config.train_file)
            self.model = torch.nn.Linear(1, 1).to(plan.device)
            return Setup(model=self.model, num_examples=len(self.x), units_per_example=1,
                         identity={"rows": len(self.x)}, info={"num_train": len(self.x)}, hyperparameters={})

        def epoch_steps(self, epoch: int) -> list[list[list[int]]]:
            order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.config.seed + epoch))
            size = self.config.batch_size
            return [[order[i:i + size].tolist()] for i in range(0, len(order), size)]

        def loss(self, model: torch.nn.Module, micro_batch: list[int]) -> torch.Tensor:
            return torch.nn.functional.mse_loss(model(self.x[micro_batch]), self.y[micro_batch])

        def evaluate(self) -> dict[str, float]:
            error = self.model(self.x) - self.y
            return {"eval_loss": float((error ** 2).mean()), "eval_mae": float(error.abs().mean())}

        def save(self, metrics: dict[str, float], hyperparameters: dict[str, Any], plan) -> dict[str, Any]:
            self.config.output_dir.mkdir(parents=True, exist_ok=True)
            save_file(self.model.state_dict(), str(self.config.output_dir / "model.safetensors"))
            manifest = artifacts.build_manifest(base_model=None, base_model_name="linear", task=TOY,
                                                hyperparameters=hyperparameters, metrics=metrics, plan=plan,
                                                dataset_hashes=dict(self.config.dataset_hashes))
            artifacts.write_manifest(self.config.output_dir, manifest)
            return manifest

    register(JobKind(ToyJob, {"eval_loss": False, "eval_mae": False}, holds_out_eval=True))
    register_engine(TOY, EngineKind(ToyConfig, ToyTask))
    yield
    unregister(TOY)
    ENGINE_KINDS.pop(TOY)


def test_a_kind_added_through_the_registry_runs_end_to_end_on_a_worker(toy_kind, client, queue, settings):
    from app.services.jobs import create_job
    from worker.context import WorkerContext
    from worker.training.lifecycle import run_training_job

    dataset = upload(client, tsv_bytes(sentiment_rows(2))).json()["id"]
    body = {"task": TOY, "train_dataset": dataset, "text_column": "sentence",
            "hyperparameters": {"max_steps": 30, "eval_steps": 10}}
    spec = parse_spec(body)
    assert isinstance(spec, ToyJob) and spec.hyperparameters.learning_rate == 0.05  # defaults from the model
    ctx = WorkerContext(settings, queue)
    try:
        with session_scope(ctx.sessions) as session:
            job_id = create_job(session, settings, queue, TENANT, spec=spec).id
        assert run_training_job(ctx, job_id) == "succeeded"
    finally:
        ctx.close()
    job = client.get(f"/jobs/{job_id}").json()
    assert job["status"] == "succeeded" and job["task"] == TOY, job["error"]
    assert job["hyperparameters"]["learning_rate"] == 0.05 and job["hyperparameters"]["max_steps"] == 30
    assert job["progress"]["step"] == 30 and job["best"]["metric"] == "eval_mae"
    maes = [p["value"] for p in client.get(f"/jobs/{job_id}/metrics").json()["data"] if p["name"] == "eval_mae"]
    assert len(maes) == 3 and maes[-1] < maes[0]  # evaluated at steps 10, 20, 30, and it learned
    events = [e["kind"] for e in client.get(f"/jobs/{job_id}/events").json()["data"]]
    assert events[:2] == ["created", "claimed"] and events[-1] == "succeeded"
    model = next(a for a in job["artifacts"] if a["kind"] == "model")
    assert {"manifest.json", "model.safetensors"} <= set(model["files"])
    assert queue.sent  # its task message went through the outbox like any job's


def test_a_registered_kind_checks_metric_for_best_against_its_own_metrics(toy_kind, client, settings, queue):
    from app.services.jobs import create_job
    from core.errors import ValidationFailed

    dataset = upload(client, tsv_bytes(sentiment_rows())).json()["id"]
    spec = parse_spec({"task": TOY, "train_dataset": dataset, "text_column": "sentence",
                       "hyperparameters": {"metric_for_best": "eval_accuracy"}})
    from core.db import make_engine, make_sessionmaker

    engine = make_engine(settings.resolved_database_url)
    try:
        with session_scope(make_sessionmaker(engine)) as session:
            with pytest.raises(ValidationFailed) as refused:
                create_job(session, settings, queue, TENANT, spec=spec)
    finally:
        engine.dispose()
    assert refused.value.field == "hyperparameters.metric_for_best" and "eval_mae" in refused.value.message
