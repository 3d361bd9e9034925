"""Adapter settings of a training job (LoRA through PEFT) and of preference tuning (DPO): validated here, once.

The models are plain pydantic (no torch), so the job spec's union can embed them and the API can refuse a bad
adapter before a job is queued; the worker turns an `AdapterConfig` into a `peft.LoraConfig`
(worker.engines.training.adapters), and loads the base in 4-bit NF4 where `quantize_base` asks (QLoRA:
worker.engines.training.quantized).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# A module name as PEFT matches it against the end of each module's dotted path (q_proj, attn.c_attn, query).
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")
ALL_LINEAR: Literal["all-linear"] = "all-linear"
# The one 4-bit format a frozen base loads in: NormalFloat4 (Dettmers et al. 2023, "QLoRA").
NF4: Literal["nf4"] = "nf4"


class AdapterConfig(BaseModel):
    """LoRA: train low-rank updates B @ A (scaled by alpha / r) of the chosen linear layers; the base stays frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["lora"] = "lora"
    r: int = Field(8, ge=1, le=1024, description="Rank of each update (A is r x in, B is out x r).")
    alpha: float = Field(16.0, gt=0, le=65536, description="Scale numerator: the update is B @ A * alpha / r.")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the adapter's input during training.")
    target_modules: Literal["all-linear"] | list[str] = Field(
        ALL_LINEAR, description="'all-linear' (every linear layer but the output head) or module names "
                                "matched against the end of each module's path, e.g. [\"q_proj\", \"v_proj\"].")
    merge: bool = Field(False, description="Also write the base with the adapter folded in (a full model) to the "
                                           "artifact's merged/ folder when the job finishes.")
    quantize_base: Literal["nf4"] | None = Field(
        None, description="QLoRA: hold the frozen base's linear layers in 4-bit NormalFloat (nf4, double "
                          "quantization: about 4.1 bits a weight instead of 32), computing in the run's precision; "
                          "the adapter still trains in fp32, is saved as an ordinary adapter and serves on the "
                          "full-precision base, and merged/ folds it into the full-precision weights. Causal-LM jobs "
                          "on a base_model only; not with sharding fsdp.")

    @field_validator("target_modules")
    @classmethod
    def _module_names(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, str):
            return value
        if not value:
            raise ValueError("give at least one module name, or 'all-linear'")
        if len(value) > 64:
            raise ValueError("at most 64 module names")
        for name in value:
            if len(name) > 200 or not _MODULE_NAME.match(name):
                raise ValueError(f"{name[:60]!r} is not a module name (letters, digits, _ and dots)")
        return sorted(set(value))

    @property
    def scaling(self) -> float:
        """The factor PEFT applies to B @ A x (alpha / r, as in the LoRA paper)."""
        return self.alpha / self.r


class SupervisedConfig(BaseModel):
    """Supervised fine-tuning: next-token loss on a text corpus, or on the assistant turns of chat data."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["sft"] = "sft"


class PreferenceConfig(BaseModel):
    """DPO: raise the policy's log-ratio of preferred over non-preferred replies against the frozen base's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["dpo"] = "dpo"
    beta: float = Field(0.1, gt=0, le=100, description="Inverse temperature of the implicit reward (DPO's beta).")
