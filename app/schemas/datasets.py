"""Dataset schemas."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict


class DatasetRead(BaseModel):
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
