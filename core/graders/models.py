"""What model graders need from the service: a served chat model as judge and a served embeddings model.

The API passes an implementation over its generation gateway; tests and other callers pass their own.
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel

from core.generation_limits import JUDGE, Refusal, cap_refusal
from core.graders.spec import (
    Grader,
    JudgeSampling,
    LabelModelGrader,
    MultiGrader,
    ScoreModelGrader,
    TextSimilarityGrader,
)

DEFAULT_EMBEDDING_MODEL = "minilm-l6"  # cosine similarity's embeddings model when a grader names none


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


def _judge_asks(sampling: JudgeSampling | None, cap: int, where: str) -> tuple[int, Refusal | None]:
    tokens, field = JUDGE.chosen({JUDGE.name: sampling.max_completions_tokens if sampling else None})
    return tokens, cap_refusal(tokens, where + field, cap)


def judge_tokens(sampling: JudgeSampling | None, cap: int) -> int:
    """The tokens a judge may answer in (JUDGE's default unless its sampling_params give them); ModelCallFailed
    naming the field when the server generates fewer (`cap`, Settings.max_new_tokens)."""
    tokens, refusal = _judge_asks(sampling, cap, "")
    if refusal is not None:
        raise ModelCallFailed(refusal.message)
    return tokens


def judge_refusal(grader: Grader, cap: int, where: str) -> Refusal | None:
    """A model grader (a multi grader's too) whose judge would answer in more tokens than the server generates,
    naming its field under `where` (the grader's own field in the request), or None: refused before it runs."""
    if isinstance(grader, MultiGrader):
        refusals = (judge_refusal(inner, cap, f"{where}.graders.{name}") for name, inner in grader.graders.items())
        return next((refusal for refusal in refusals if refusal is not None), None)
    if not isinstance(grader, ScoreModelGrader | LabelModelGrader):
        return None
    return _judge_asks(grader.sampling_params if isinstance(grader, ScoreModelGrader) else None, cap, f"{where}.")[1]


def _calls(grader: Grader, where: str) -> list[str]:
    """The field of each served-model call grading one item makes, in the order it makes them."""
    if isinstance(grader, MultiGrader):
        return [call for name, inner in grader.graders.items() for call in _calls(inner, f"{where}.graders.{name}")]
    if isinstance(grader, ScoreModelGrader | LabelModelGrader):
        return [where]
    if isinstance(grader, TextSimilarityGrader) and grader.evaluation_metric == "cosine":
        return [where]
    return []


def calls_refusal(graders: list[tuple[str, Grader]], bound: int) -> Refusal | None:
    """Graders (each under its field in the request) that together would call served models more than `bound`
    times per item (Settings.max_grader_model_calls), naming the grader whose call goes past it, or None."""
    calls = [call for where, grader in graders for call in _calls(grader, where)]
    if len(calls) <= bound:
        return None
    return Refusal(calls[bound], f"{calls[bound]}: grading one item would call served models {len(calls)} times; "
                                 f"this server allows at most {bound} per item (score_model, label_model and "
                                 "cosine text_similarity graders, a multi grader's parts and an eval's testing "
                                 "criteria added up)")
