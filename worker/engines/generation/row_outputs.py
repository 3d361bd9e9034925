"""What a decode step adds per row beyond the next token (grammar masks before the draw, logprobs after it)."""

from __future__ import annotations

import math
from collections.abc import Collection

import torch

from core.protocol import TokenLogprob, TopLogprob
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
