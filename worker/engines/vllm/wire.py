"""trainserve's requests in vLLM's completions API, and vLLM's streamed chunks back as trainserve's choices.

One choice is one vLLM request (`n` 1): choice i of a seeded request is seeded `seed + i`, as the built-in engine
seeds its rows (sampling/sampler.row_seed), so a seed means the same thing whichever engine decodes. Prompts go as
token ids (the worker renders chats and encodes prompts itself, so both engines see the same ids); vLLM answers
with the token ids it sampled (`return_token_ids`) and logprobs keyed by id (`return_tokens_as_token_ids`), read
back through the same byte table the built-in engine reports logprobs with. A scored prompt (prompt_logprobs) is
asked of choice 0 as vLLM's streamed `echo` with `logprobs`: its first chunk's logprobs open with the prompt's tokens
(the first with none), then the choice's own; with return_token_ids the echoed text is empty.

Sampling parameters are all sent, defaults included: vLLM otherwise takes a model's generation_config.json
sampling defaults (its `--generation-config auto`), where the built-in engine's defaults are the request's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from core.protocol import Constraint, PromptLogprobs, SamplingParams, Token, TokenLogprob, TopLogprob


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
    if params.prompt_logprobs is not None and index == 0:  # one choice scores the prompt for all of them
        body["echo"] = True
        body["logprobs"] = max(params.logprobs or 0, params.prompt_logprobs)
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
    echoed: int = 0  # prompt tokens whose logprobs open the first chunk's (choice_body's echo); 0: none
    prompt_logprobs: PromptLogprobs | None = None

    def take(self, chunk: dict[str, Any], top: int | None,
             prompt_top: int | None = None) -> tuple[str, list[TokenLogprob] | None]:
        """Fold one streamed chunk in; returns its text delta and the logprobs of the tokens it brought (`top` the
        choice's, `prompt_top` the echoed prompt's alternatives at most)."""
        usage = chunk.get("usage")
        if usage:
            self.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        delta, delta_logprobs = "", None
        for choice in chunk.get("choices") or []:
            ids = [int(t) for t in choice.get("token_ids") or []]
            self.token_ids += ids
            delta += choice.get("text") or ""
            logprobs = choice.get("logprobs") or {}
            if self.echoed and self.prompt_logprobs is None:
                logprobs = self._prompt(logprobs, prompt_top or 0)
            if top is not None:
                delta_logprobs = (delta_logprobs or []) + self._logprobs(logprobs, top)
            if choice.get("finish_reason") is not None:
                self.finish = finish_reason(choice["finish_reason"], choice.get("stop_reason"))
        self.text += delta
        if delta_logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta_logprobs
        return delta, delta_logprobs

    def _prompt(self, logprobs: dict[str, Any], top: int) -> dict[str, Any]:
        """Keep the echoed prompt's entries (the first `echoed` of each list) as prompt_logprobs; the rest back."""
        n = self.echoed
        tokens = logprobs.get("tokens") or []
        if len(tokens) < n:
            raise ValueError(f"vLLM echoed {len(tokens)} prompt tokens' logprobs, not {n}")
        raw = self._bytes(_id(tokens[0]))
        prompt = {key: (value or [])[1:n] for key, value in logprobs.items()}
        first = Token(token=raw.decode("utf-8", errors="replace"), bytes=list(raw))
        self.prompt_logprobs = PromptLogprobs(first=first, scored=self._logprobs(prompt, top, skip_eos=False))
        return {key: (value or [])[n:] for key, value in logprobs.items()}

    def _logprobs(self, logprobs: dict[str, Any], top: int, skip_eos: bool = True) -> list[TokenLogprob]:
        out = []
        for token, value, alternatives in zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or [],
                                              logprobs.get("top_logprobs") or [], strict=False):
            token_id = _id(token)
            if skip_eos and token_id in self.eos_ids:  # as the built-in engine: no logprob for the end-of-sequence
                continue
            ranked = sorted(((_id(t), v) for t, v in (alternatives or {}).items()), key=lambda item: -item[1])
            out.append(TokenLogprob(**self._top(token_id, value).model_dump(),
                                    top_logprobs=[self._top(i, v) for i, v in ranked[:top]]))
        return out

    def _bytes(self, token_id: int) -> bytes:
        return self.logprob_table[token_id] if 0 <= token_id < len(self.logprob_table) else b""

    def _top(self, token_id: int, value: float | None) -> TopLogprob:
        raw = self._bytes(token_id)
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
