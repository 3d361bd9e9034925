"""Schemas of the OpenAI-compatible /v1/embeddings route."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

# OpenAI's four shapes of `input`: a string, strings, token ids, or lists of token ids (the model's own vocabulary).
EmbeddingInput = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request; `user` is accepted and ignored."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=200, description="`minilm-l6`, a sentence-transformers folder "
                       "under <home>/models, or a succeeded text-classification job's id.")
    input: EmbeddingInput = Field(description="A string, a list of strings, or token ids (a list, or lists).")
    encoding_format: Literal["float", "base64"] = Field("float", description="base64: little-endian float32.")
    dimensions: int | None = Field(None, ge=1, le=65_536, description="Shorter vectors, for models that declare "
                                   "Matryoshka training (truncated, then L2-renormalised).")
    user: str | None = Field(None, max_length=256)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
