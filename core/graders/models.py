"""What model graders need from the service: a served chat model as judge and a served embeddings model.

The API passes an implementation over its generation gateway; tests and other callers pass their own.
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel

from core.graders.spec import JudgeSampling

DEFAULT_EMBEDDING_MODEL = "minilm-l6"  # cosine similarity's embeddings model when a grader names none
JUDGE_MAX_TOKENS = 64  # a judge's answer is one small JSON object


class JudgeReply(BaseModel):
    """A judge's answer text (structured output: JSON) and what it cost."""

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    truncated: bool = False  # the answer hit its token limit


class ModelCallFailed(Exception):
    """The served model could not answer (not found, overloaded, the worker failed); the message says why."""


class Models(Protocol):
    """Served models as graders call them."""

    async def chat(self, model: str, messages: list[dict[str, str]], *, schema: dict[str, Any],
                   sampling: JudgeSampling | None) -> JudgeReply:
        """One chat completion constrained to JSON matching `schema`; ModelCallFailed when it cannot run."""
        ...

    async def embed(self, model: str | None, texts: list[str]) -> list[list[float]]:
        """One vector per text (model None: the server's default embeddings model); ModelCallFailed otherwise."""
        ...
