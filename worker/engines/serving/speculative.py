"""Speculative decoding with prompt-lookup drafts (n-gram matching, as vLLM's ngram proposer): no draft model.

A sequence's last few tokens are looked up earlier in its own prompt and output; the tokens that followed the most
recent match are the draft. One decode step then runs each row's last token and its draft as tokens of their own at
consecutive positions of the row (DecodeInput.rows: each reads the row up to itself, so the draft is checked
causally, and no row is padded to the longest draft), and the row keeps the longest prefix of the draft that the
model's own choice agrees with, plus the model's next token after it. For greedy rows that is exact: the kept
tokens are the ones plain decoding would produce, token for token. Editing, extraction and code tasks repeat their
input, so a draft is often right, and one forward that reads the weights once yields several tokens.

Sampled rows speculate too, exactly: at every checked position the row draws the token plain decoding would draw
there, with the counter-based uniform of that token's own index in the answer (sampler.counter_uniforms), and keeps
the draft while it equals those draws. The kept tokens are then the ones plain decoding would have drawn, seed for
seed, whatever shares the batch, up to float rounding: a step of more tokens may sum the same logits in a
different order, so a draw within rounding of the edge between two tokens' shares may go either way. For a draft
that is a single proposed token (a point mass) this keeps a draft token with the probability the model gives it,
as the standard rejection rule of speculative sampling does, and on a miss the draw that replaces it comes from the
model's own distribution: the output distribution is unchanged.

Which rows speculate, and how far: rows without a grammar, logprobs or repetition penalty, on a step without prompt
chunks, while at most `max_rows` rows decode. The draft tokens are priced, because a checked position is nearly
free beside one row (the step reads the weights once either way) while beside sixteen rows on a CPU one more
position per row costs about half a decode step. Each row keeps a running estimate of how often its draft tokens
are right (`record`); `lengths` spends positions where they are worth most: a row's j-th draft token yields a
token with the probability that it and the j - 1 before it are right, and is checked only while that gain per
position beats the step's tokens per second so far (a decode step's time and what each checked position adds are
measured as steps run: StepCosts). A step in which no draft token pays decodes plainly. A request opts out with
`SamplingParams.speculative = False`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.engines.serving.prefill import EMA  # the chunk budget's weight of the newest step
from worker.engines.serving.requests import SequenceState
from worker.engines.serving.sampling.sampler import RowParams, next_tokens

MAX_NGRAM, MIN_NGRAM = 4, 1  # the longest suffix tried first, as vLLM's prompt lookup does
PRIOR = 1.0  # pseudo-counts of one right and one wrong draft token before a row has any (a rate of 1/2)
DECAY = 0.7  # the weight of a row's earlier checks against its newest


def propose(history: Sequence[int], k: int, *, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the history's longest matching suffix."""
    length = len(history)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = list(history[length - n:])
        # The most recent occurrence that has at least one token after it (the suffix itself is excluded).
        for start in range(length - n - 1, -1, -1):
            if history[start] == suffix[0] and list(history[start:start + n]) == suffix:
                return list(history[start + n:start + n + k])
    return []


def eligible(sequence: SequenceState) -> bool:
    """Whether a running sequence may speculate this step."""
    params = sequence.request.params
    return (params.speculative and sequence.matcher is None and params.logprobs is None
            and params.repetition_penalty == 1.0)


def draft(sequence: SequenceState, k: int, context_length: int) -> list[int]:
    """The sequence's proposal: at most k tokens, fewer near its max_new_tokens or the model's context."""
    request = sequence.request
    room = min(request.params.max_new_tokens - len(sequence.tokens) - 1, context_length - sequence.position - 2, k)
    if room <= 0:
        return []
    return propose(request.prompt + sequence.tokens, room)


def acceptance(sequence: SequenceState) -> float:
    """The chance the row's next draft token is right: its kept / checked draft tokens, decayed, from a prior of 1/2."""
    return (sequence.draft_kept + PRIOR) / (sequence.draft_checked + 2 * PRIOR)


def lengths(proposals: Sequence[list[int]], rates: Sequence[float], decode_s: float | None,
            position_s: float | None) -> list[int]:
    """How many tokens of each row's proposal to check this step (0 for all: decode plainly).

    A step of B rows yields B tokens for decode_s; each checked draft position adds position_s. Draft tokens are
    taken in order of their expected
    yield (rate^j for a row's j-th) while each adds more tokens per second than the step gives so far. A row count
    whose plain step is not measured yet decodes plainly (that measures it); with no draft position measured yet,
    every proposal is checked whole (that measures one).
    """
    if decode_s is None:
        return [0] * len(proposals)
    if position_s is None:
        return [len(proposal) for proposal in proposals]
    tokens, seconds = float(len(proposals)), decode_s
    gains = sorted(((rate ** j, row) for row, (proposal, rate) in enumerate(zip(proposals, rates, strict=True))
                    for j in range(1, len(proposal) + 1)), reverse=True)
    taken = [0] * len(proposals)
    for gain, row in gains:
        if gain * seconds <= tokens * position_s:  # this position would lower the step's tokens per second
            break
        taken[row] += 1
        tokens, seconds = tokens + gain, seconds + position_s
    if tokens * decode_s <= len(proposals) * seconds:  # no better than a plain decode step
        return [0] * len(proposals)
    return taken


class StepCosts:
    """Measured decode-only step times: a plain step per row count, and what one checked draft position adds."""

    def __init__(self) -> None:
        self.plain: dict[int, float] = {}
        self.position_s: float | None = None

    def observe(self, rows: int, positions: int, seconds: float) -> None:
        """A decode-only step of `rows` rows that checked `positions` draft tokens (0: a plain step)."""
        if not positions:
            self.plain[rows] = _mean(self.plain.get(rows), seconds)
            return
        plain = self.plain.get(rows)
        if plain is not None:  # a step faster than the estimate (noise) still costs something: a floor
            sample = max(seconds - plain, 0.01 * plain) / positions
            self.position_s = _mean(self.position_s, sample)


def _mean(current: float | None, sample: float) -> float:
    return sample if current is None else (1 - EMA) * current + EMA * sample


def record(sequence: SequenceState, drafted: list[int], kept: list[int]) -> None:
    """After a check: the row's draft tokens that were right (kept but the model's own last) and those checked
    (the right ones and the first wrong one), decayed so the estimate follows the answer as it changes."""
    if not drafted:
        return
    right = len(kept) - 1
    sequence.draft_kept = DECAY * sequence.draft_kept + right
    sequence.draft_checked = DECAY * sequence.draft_checked + right + (right < len(drafted))


def choices(logits: torch.Tensor, rows: Sequence[SequenceState], chunks: Sequence[list[int]]) -> list[int]:
    """The token plain decoding would choose at every checked position (logits [positions, V], the rows' chunks in
    order): the argmax of a greedy row; a sampled row's draw with the uniform of that token's index in its answer
    (position j of a row holding t tokens draws token t + j, as plain decoding's counter would)."""
    at = [(sequence, j) for sequence, chunk in zip(rows, chunks, strict=True) for j in range(len(chunk))]
    params = RowParams([sequence.request.params for sequence, _ in at], logits.device,
                       seeds=[sequence.seed for sequence, _ in at],
                       counters=[len(sequence.tokens) + j for sequence, j in at])
    return next_tokens(logits, params, None).tolist()


def accepted(drafted: list[int], choices: list[int]) -> list[int]:
    """The tokens a row keeps: choices[j] is the model's token after the row's last token and drafted[:j]; drafts
    are kept while they equal the model's choice, then the model's own token ends the run."""
    kept = []
    for j, choice in enumerate(choices):
        kept.append(choice)
        if j >= len(drafted) or drafted[j] != choice:
            break
    return kept
