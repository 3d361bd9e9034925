"""Schemas of the prediction endpoint."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class ClassifyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=40, description="Id of a succeeded text-classification job.")
    texts: list[str] = Field(min_length=1, description="Texts to classify.")


class Prediction(BaseModel):
    label: Any
    score: float


class ClassifyResponse(BaseModel):
    model: str
    predictions: list[Prediction]
