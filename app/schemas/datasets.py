"""Dataset schemas: a summary for lists, the full read (with bounded column stats) for one dataset."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class ColumnStats(BaseModel):
    empty: int = Field(description="Rows whose cell is empty or missing.")
    values: dict[str, int] | None = Field(
        description="Count of each distinct value of a label candidate; null when the column has too many "
                    "or too long distinct values to be a label.")


class DatasetSummary(BaseModel):
    """What lists show of a dataset: no per-column stats."""

    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    filename: str
    format: str
    rows: int
    columns: list[str]
    sha256: str
    size_bytes: int
    created_at: datetime


class DatasetRead(DatasetSummary):
    """One dataset, with the (bounded) stats job submission checks label and text columns against."""

    column_stats: dict[str, ColumnStats] = Field(default_factory=dict)


class DatasetPreview(BaseModel):
    """The first rows of a dataset as parsed for training (cells over 500 characters cut short)."""

    id: str
    columns: list[str]
    rows: list[dict[str, Any]]
    total_rows: int
