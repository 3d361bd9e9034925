"""trainserve's requests in vLLM's completions API, and vLLM's streamed chunks back as trainserve's choices.

One choice is one vLLM request (`n` 1): choice i of a seeded request is seeded `seed + i`, as the built-in engine
seeds its rows (sampling/sampler.row_seed), so a seed means the same thing whichever engine decodes. Prompts go as
token ids (the worker renders chats and encodes prompts itself, so both engines see the same ids); vLLM answers
with the token ids it sampled (`return_token_ids`) and logprobs keyed by id (`return_tokens_as_token_ids`), read
back through the same byte table the built-in engine reports logprobs with.

Sampling parameters are all sent, defaults included: vLLM otherwise takes a model's generation_config.json
sampling defaults (its `--generation-config auto`), where the built-in engine's defaults are the request's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from core.protocol import Constraint, SamplingParams, TokenLogprob, TopLogprob


def structured_outputs(constraint: Constraint) -> dict[str, Any]:
    """vLLM's structured_outputs for a constraint (its guidance backend is llguidance, as the built-in's; JSON
    whitespace is the server's setting, server.py)."""
    if constraint.kind == "json_object":
        return {"json_object": True}
    if constraint.kind == "json_schema":
        return {"json": json.loads(constraint.spec)}
    if constraint.kind == "regex":
        return {"regex": constraint.spec}
    if constraint.kind == "choice":
        return {"choice": json.loads(constraint.spec)}
    return {"grammar": constraint.spec}


def choice_body(model: str, prompt: list[int], params: SamplingParams, index: int,
                cache_salt: str | None = None) -> dict[str, Any]:
    """The /v1/completions body of choice `index` of a request (streamed, one choice); cache_salt keeps its prompt's
    cached blocks apart from those of requests with another salt (another tenant)."""
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": params.max_new_tokens, "n": 1, "stream": True,
        "stream_options": {"include_usage": True}, "temperature": params.temperature, "top_p": params.top_p,
        "top_k": params.top_k or -1, "repetition_penalty": params.repetition_penalty, "return_token_ids": True,
        "return_tokens_as_token_ids": True, "skip_special_tokens": True, "ignore_eos": params.ignore_eos,
        "min_tokens": params.min_tokens,
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if params.stop:
        body["stop"] = list(params.stop)
    if params.seed is not None:
        body["seed"] = params.seed + index
    if params.logprobs is not None:
        body["logprobs"] = params.logprobs
    if params.constraint is not None:
        body["structured_outputs"] = structured_outputs(params.constraint)
    return body


def finish_reason(reason: str | None, stop_reason: str | int | None) -> str:
    """vLLM's finish and stop reasons as the built-in engine's: eos (an end-of-sequence token: vLLM's "stop" with
    no stop string, or a stop token id), stop (a stop string), length, cancelled (aborted)."""
    if reason == "length":
        return "length"
    if reason == "stop":
        return "stop" if isinstance(stop_reason, str) else "eos"
    return "cancelled"


@dataclass
class ChoiceStream:
    """One choice as its chunks arrive: its text, token ids and logprobs so far, and how it ended."""

    index: int
    logprob_table: list[bytes]  # each token id's bytes (sampling/detokenize.logprob_table)
    eos_ids: frozenset[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish: str | None = None
    cached_tokens: int = 0

    def take(self, chunk: dict[str, Any], top: int | None) -> tuple[str, list[TokenLogprob] | None]:
        """Fold one streamed chunk in; returns its text delta and the logprobs of the tokens it brought."""
        usage = chunk.get("usage")
        if usage:
            self.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        delta, delta_logprobs = "", None
        for choice in chunk.get("choices") or []:
            ids = [int(t) for t in choice.get("token_ids") or []]
            self.token_ids += ids
            delta += choice.get("text") or ""
            if top is not None:
                delta_logprobs = (delta_logprobs or []) + self._logprobs(choice.get("logprobs") or {}, top)
            if choice.get("finish_reason") is not None:
                self.finish = finish_reason(choice["finish_reason"], choice.get("stop_reason"))
        self.text += delta
        if delta_logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta_logprobs
        return delta, delta_logprobs

    def _logprobs(self, logprobs: dict[str, Any], top: int) -> list[TokenLogprob]:
        out = []
        for token, value, alternatives in zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or [],
                                              logprobs.get("top_logprobs") or [], strict=False):
            token_id = _id(token)
            if token_id in self.eos_ids:  # as the built-in engine: no logprob for the end-of-sequence token
                continue
            ranked = sorted(((_id(t), v) for t, v in (alternatives or {}).items()), key=lambda item: -item[1])
            out.append(TokenLogprob(**self._top(token_id, value).model_dump(),
                                    top_logprobs=[self._top(i, v) for i, v in ranked[:top]]))
        return out

    def _top(self, token_id: int, value: float | None) -> TopLogprob:
        raw = self.logprob_table[token_id] if 0 <= token_id < len(self.logprob_table) else b""
        return TopLogprob(token=raw.decode("utf-8", errors="replace"), bytes=list(raw),
                          logprob=float(value) if value is not None else float("-inf"))


def _id(token: str) -> int:
    """A token as vLLM names it with return_tokens_as_token_ids ("token_id:42")."""
    return int(str(token).rpartition(":")[2])


def error_message(response_text: str) -> str:
    """The message of one of vLLM's error answers (OpenAI's envelope), or the text itself."""
    try:
        body = json.loads(response_text)
    except ValueError:
        return response_text[:500]
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)
