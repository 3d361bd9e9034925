"""The engine side of the toy job kind (tests.toy_kind): its frozen config, the loop's Recipe and the EngineKind
that joins them, which the kind's declaration names (`tests.toy_engine:ENGINE`); a worker resolves it from there."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from core.hyperparams import default
from core.tabular import read_table
from tests.toy_kind import TOY, ToyHyperparameters
from worker.engines.models import manifest as manifests
from worker.engines.training.kinds import RUN_HYPERPARAMETERS, EngineKind, same_names
from worker.engines.training.loop import RunConfig, Setup


@dataclass(frozen=True, kw_only=True)
class ToyConfig(RunConfig):
    text_column: str
    epochs: float = default(ToyHyperparameters, "epochs")


class ToyTask:
    unit = "samples"
    adam_betas = (0.9, 0.999)

    def __init__(self, config: ToyConfig) -> None:
        self.config = config

    def _rows(self, path: Path) -> tuple[torch.Tensor, torch.Tensor]:
        texts = [str(row[self.config.text_column]) for row in read_table(path).rows]
        return (torch.tensor([[len(t) / 50.0] for t in texts]),
                torch.tensor([[len(t.split()) / 10.0] for t in texts]))

    def build(self, plan: Any) -> Setup:
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

    def save(self, metrics: dict[str, float], hyperparameters: dict[str, Any], plan: Any) -> dict[str, Any]:
        self.config.output_dir.mkdir(parents=True, exist_ok=True)
        save_file(self.model.state_dict(), str(self.config.output_dir / "model.safetensors"))
        manifest = manifests.build_manifest(base_model=None, base_model_name="linear", task=TOY,
                                            hyperparameters=hyperparameters, metrics=metrics, plan=plan,
                                            dataset_hashes=dict(self.config.dataset_hashes))
        manifests.write_manifest(self.config.output_dir, manifest)
        return manifest


ENGINE = EngineKind(ToyConfig, ToyTask, {
    **RUN_HYPERPARAMETERS, **same_names("epochs", "batch_size", "learning_rate", "weight_decay", "seed")})
