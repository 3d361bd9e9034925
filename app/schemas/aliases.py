"""Model aliases: a tenant's names for served models, their moves (gated by an eval) and lineage."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

AliasName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}:[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
                                 description="`family:stage`, e.g. `support-bot:production`.")]
Target = Annotated[str, Field(min_length=1, max_length=200, description="A served model: a model under "
                              "<home>/models, a succeeded job's id (an adapter too), or a hub id.")]


class AliasCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: AliasName
    target: Target
    gate_eval_id: str | None = Field(None, max_length=40, description="Every later move must present a completed "
                                     "run of the new target on this eval whose pass rate beats the current target's.")
    description: str | None = Field(None, max_length=500)


class AliasMove(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: Target
    eval_id: str | None = Field(None, max_length=40, description="Gate this move on this eval (the alias's own "
                                "gate_eval_id applies when unset).")
    run_id: str | None = Field(None, max_length=40, description="The new target's run on the gate's eval (default: "
                               "its latest completed run).")
    expected_target: str | None = Field(None, max_length=200, description="Move only if the alias still points "
                                        "here (409 otherwise): a compare-and-set.")


class GateResult(BaseModel):
    eval_id: str
    run_id: str
    score: float
    baseline_run_id: str
    baseline_score: float
    passed: bool


class AliasMoveRead(BaseModel):
    object: Literal["model_alias.move"] = "model_alias.move"
    id: str
    alias: str
    from_target: str | None
    to_target: str
    moved_by: str
    moved_at: int
    gate: GateResult | None = None


class AliasRead(BaseModel):
    object: Literal["model_alias"] = "model_alias"
    id: str
    name: str
    target: str
    gate_eval_id: str | None
    description: str | None
    created_at: int
    updated_at: int
    lineage: dict[str, Any] = Field(description="Where the target comes from: base model, dataset, job, checkpoints.")


class AliasList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AliasRead]


class AliasHistory(BaseModel):
    object: Literal["list"] = "list"
    data: list[AliasMoveRead]
