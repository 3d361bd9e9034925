"""Speculative decoding with prompt-lookup drafts (n-gram matching, as vLLM's ngram proposer): no draft model.

A sequence's last few tokens are looked up earlier in its own prompt and output; the tokens that followed the most
recent match are the draft. One forward then runs each row's last token and its draft as a chunk at the row's
positions (the runner returns the logits of every position), and the row keeps the longest prefix of the draft that
the model's own choice agrees with, plus the model's next token after it. For greedy rows that is exact: the kept
tokens are the ones plain decoding would produce, token for token. Editing, extraction and code tasks repeat their
input, so a draft is often right, and one forward that reads the weights once yields several tokens.

Sampled rows speculate too, exactly: at every checked position the row draws the token plain decoding would draw
there, with the counter-based uniform of that token's own index in the answer (sampler.counter_uniforms), and keeps
the draft while it equals those draws. The kept tokens are then the ones plain decoding would have drawn, seed for
seed, whatever shares the batch. For a draft that is a single proposed token (a point mass) this keeps a draft
token with the probability the model gives it, as the standard rejection rule of speculative sampling does, and
on a miss the draw that replaces it comes from the model's own distribution: the output distribution is unchanged.

Which rows speculate: rows without a grammar, logprobs or repetition penalty, on a step without prompt chunks, while
the batch is small (`max_rows`): a big batch is compute-bound and verifying drafts would cost more than it saves. A
step speculates only when at least half its rows have a draft (every row of a speculative step goes through the
chunk path); a row whose draft missed at its first token pauses before drafting again. A request opts out with
`SamplingParams.speculative = False`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.engines.serving.requests import SequenceState
from worker.engines.serving.sampling.sampler import RowParams, next_tokens

MAX_NGRAM, MIN_NGRAM = 4, 1  # the longest suffix tried first, as vLLM's prompt lookup does
MAX_BACKOFF = 16  # the longest pause (steps) of a row whose drafts keep missing


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
    """The sequence's draft: at most k tokens, fewer near its max_new_tokens or the model's context; none while it
    pauses after a draft whose first token was wrong (pauses of 1, 2, 4 ... up to MAX_BACKOFF steps: a row whose
    answer does not repeat its input stops paying for drafts)."""
    if sequence.draft_skip:
        sequence.draft_skip -= 1
        return []
    request = sequence.request
    room = min(request.params.max_new_tokens - len(sequence.tokens) - 1, context_length - sequence.position - 2, k)
    if room <= 0:
        return []
    return propose(request.prompt + sequence.tokens, room)


def record(sequence: SequenceState, drafted: list[int], kept: list[int]) -> None:
    """After a check: a draft whose first token was wrong starts (or doubles) the row's pause."""
    if not drafted:
        return
    if kept[0] != drafted[0]:
        sequence.draft_backoff = min(MAX_BACKOFF, 2 * sequence.draft_backoff or 1)
        sequence.draft_skip = sequence.draft_backoff
    else:
        sequence.draft_backoff = 0


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
