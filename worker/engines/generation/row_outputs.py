"""What a step adds per row beyond the next token (grammar masks before the draw, logprobs after it) and what it
records of a scored prompt (every prompt token's logprob)."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import torch

from core.protocol import PromptLogprobs, Token, TokenLogprob, TopLogprob
from worker.engines.generation.prefill import Chunk
from worker.engines.generation.requests import SequenceState
from worker.engines.generation.sampling.grammar import allowed_tokens
from worker.engines.generation.sampling.sampler import constrain, step_logprobs


def constrained_logits(logits: torch.Tensor, rows: list[SequenceState], eos_ids: Collection[int]) -> torch.Tensor:
    """The step's logits [len(rows), V] with each constrained row's grammar mask applied and, in rows holding fewer
    than their min_tokens, the end-of-sequence ids at -inf (vLLM's min_tokens); other rows untouched."""
    short = [i for i, s in enumerate(rows) if len(s.tokens) < s.request.params.min_tokens]
    if short and eos_ids:
        at = torch.tensor(short, dtype=torch.long, device=logits.device)[:, None]
        eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=logits.device)[None, :]
        logits = logits.index_put((at, eos), torch.tensor(-math.inf, dtype=logits.dtype, device=logits.device))
    matchers = [(i, s.matcher) for i, s in enumerate(rows) if s.matcher is not None]
    if not matchers:
        return logits
    constrained = [i for i, _ in matchers]
    allowed = allowed_tokens([matcher for _, matcher in matchers], logits.shape[-1])
    return constrain(logits, constrained, allowed)


def _top(table: list[bytes], token: int, logprob: float) -> TopLogprob:
    raw = table[token]
    return TopLogprob(token=raw.decode("utf-8", errors="replace"), bytes=list(raw), logprob=logprob)


def record_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list[SequenceState], table: list[bytes],
                    eos_ids: Collection[int]) -> None:
    """Append the step's logprobs to the rows that asked for them (tokens [len(rows)] just drawn)."""
    wanted = [i for i, s in enumerate(rows) if s.logprobs is not None]
    if not wanted:
        return
    step = step_logprobs(logits, tokens, wanted, [rows[i].request.params.logprobs or 0 for i in wanted])
    chosen = tokens.index_select(0, torch.tensor(wanted, device=tokens.device)).tolist()
    for at, row in enumerate(wanted):
        sequence = rows[row]
        if chosen[at] in eos_ids or sequence.logprobs is None:
            continue  # the eos token ends the text and, as in OpenAI's answers, has no entry
        top = [_top(table, i, v) for i, v in zip(step.top_ids[at], step.top_values[at], strict=True)]
        entry = TokenLogprob(**_top(table, chosen[at], step.chosen[at]).model_dump(), top_logprobs=top)
        sequence.logprobs.append(entry)
        sequence.unsent.append(entry)


# Prompt positions whose log-softmax is taken at once: bounds the fp32 copy of [positions, vocabulary].
SCORE_SLICE = 256


def record_prompt_logprobs(logits: torch.Tensor, chunks: Sequence[Chunk], table: list[bytes]) -> None:
    """Append to each scored chunk's request the logprobs of the prompt tokens its positions predict: position i
    scores prompt token i + 1, in fp32 from the model's own logits, with the `prompt_logprobs` most likely there.
    `logits`: every position of the scored chunks, in order (the runner's rows after the chunks' last positions)."""
    at = 0
    for chunk in chunks:
        request, top = chunk.request, chunk.request.params.prompt_logprobs
        if top is None:
            continue
        prompt = request.prompt
        if chunk.start == 0:
            raw = table[prompt[0]]
            request.prompt_logprobs = PromptLogprobs(first=Token(token=raw.decode("utf-8", errors="replace"),
                                                                 bytes=list(raw)), scored=[])
        assert request.prompt_logprobs is not None
        targets = prompt[chunk.start + 1:chunk.end + 1]  # the prompt's last position predicts no prompt token
        for first in range(0, len(targets), SCORE_SLICE):
            part = targets[first:first + SCORE_SLICE]
            step = step_logprobs(logits[at + first:at + first + len(part)],
                                 torch.tensor(part, dtype=torch.long, device=logits.device), list(range(len(part))),
                                 [top] * len(part))
            for token, value, ids, values in zip(part, step.chosen, step.top_ids, step.top_values, strict=True):
                request.prompt_logprobs.scored.append(TokenLogprob(
                    **_top(table, token, value).model_dump(),
                    top_logprobs=[_top(table, i, v) for i, v in zip(ids, values, strict=True)]))
        at += chunk.end - chunk.start
