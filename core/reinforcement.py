"""Reinforcement fine-tuning (GRPO) settings of a causal-lm job: the grader that scores samples, and the loss.

The job samples `samples` completions per prompt with the policy being trained, scores each with `grader`
(core.graders, OpenAI's shapes), and takes a GRPO step (worker.engines.training.grpo). Only graders that run in
the training process are accepted: string_check, text_similarity without embeddings, json_schema, and multi over
them. Model-judged graders (score_model, label_model) and cosine similarity need a served model the training
process does not reach, and python graders run no client code, so each is refused at submission, naming the field.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.graders.spec import Grader, LabelModelGrader, MultiGrader, ScoreModelGrader, TextSimilarityGrader

LossType = Literal["grpo", "dr_grpo", "dapo"]
METRIC_NAME = re.compile(r"[^A-Za-z0-9_]+")


class ReinforcementConfig(BaseModel):
    """GRPO: group-relative advantages over `samples` completions per prompt, a clipped ratio, KL to the base."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["reinforcement"] = "reinforcement"
    grader: Grader = Field(description="Scores each sampled completion: its score is the reward.")
    samples: int = Field(4, ge=2, le=64, description="Completions sampled per prompt (GRPO's group size).")
    eval_samples: int = Field(1, ge=1, le=64, description="Completions sampled per validation prompt.")
    max_completion_tokens: int = Field(32, ge=1, le=4096, description="Tokens per sampled completion at most.")
    temperature: float = Field(1.0, gt=0, le=2, description="Sampling temperature of the rollouts.")
    beta: float = Field(0.04, ge=0, le=10, description="Weight of the KL penalty to the reference model (the base "
                                                       "with the adapter off); 0 drops it (full-weight training).")
    epsilon: float = Field(0.2, gt=0, lt=1, description="Lower clip of the policy ratio (1 - epsilon).")
    epsilon_high: float | None = Field(None, gt=0, lt=10, description="Upper clip (1 + epsilon_high); None: "
                                                                      "epsilon. DAPO's clip-higher sets it larger.")
    loss_type: LossType = Field("grpo", description="grpo: per-sequence token mean; dapo: mean over the batch's "
                                                    "tokens; dr_grpo: sum over tokens / (rows x max tokens).")
    scale_rewards: bool = Field(True, description="Divide advantages by the group's reward std (Dr. GRPO: false).")

    @model_validator(mode="after")
    def _local_grader(self) -> ReinforcementConfig:
        for name, grader in graders_of(self.grader):
            problem = remote_grader(grader)
            if problem is not None:
                raise ValueError(f"grader {name!r}: {problem}")
        return self

    def grader_names(self) -> list[str]:
        """The graders whose rewards are reported apart: a multi grader's parts, else the grader itself."""
        return [name for name, _ in graders_of(self.grader)]


def graders_of(grader: object) -> list[tuple[str, object]]:
    """A multi grader's named parts, or the grader alone under its name."""
    if isinstance(grader, MultiGrader):
        return list(grader.graders.items())
    return [(str(getattr(grader, "name", "grader")), grader)]


def remote_grader(grader: object) -> str | None:
    """Why a grader cannot score rollouts in the training process (None: it can)."""
    if isinstance(grader, (ScoreModelGrader, LabelModelGrader)):
        return (f"{grader.type} graders call a served judge model, which the training process does not reach; "
                "use string_check, text_similarity, json_schema or multi over them")
    if isinstance(grader, TextSimilarityGrader) and grader.evaluation_metric == "cosine":
        return "cosine similarity needs a served embeddings model; use fuzzy_match, bleu, gleu or rouge_*"
    return None


def metric_name(prefix: str, grader: str, suffix: str = "") -> str:
    """A per-grader metric's name (letters, digits and _; at most 64 characters, the metric column's width)."""
    end = f"_{suffix}" if suffix else ""
    middle = METRIC_NAME.sub("_", grader).strip("_")[: 63 - len(prefix) - len(end)] or "grader"
    return f"{prefix}_{middle}{end}"
