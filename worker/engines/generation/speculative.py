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

Which rows speculate, and how far: rows without a grammar, logprobs or repetition penalty, while at most
`max_rows` rows decode; prompt chunks prefill in the same forward (under load most steps carry one). The draft
tokens are priced, because a checked position is nearly free beside one row (the step reads the weights once
either way) while beside sixteen rows on a CPU the linear layers are compute-bound and each position costs about
what a decode row does. How likely a draft token is right
depends most on how long a context it was matched on: on editing tasks a token proposed after a one-token match is
right about a third of the time, one after four matched tokens (or after a short match whose first draft tokens
were right) nine times in ten. DraftRates counts, over every row, how often a draft token following m matched
tokens was right (a draft's j-th token follows the match's n tokens and the j - 1 draft tokens before it), decayed
so it follows the traffic, and each row's own record scales those rates (a row whose drafts fail more often than
the rates say gets fewer positions). `lengths` spends positions where they are worth most: a row's j-th draft token
yields a token with the probability that it and the j - 1 before it are right, and is checked only while that
gain per position beats the step's tokens per second so far (a decode step's time and what each checked position
adds are measured as steps run: StepCosts). A step in which no draft token pays decodes plainly, so a workload whose
drafts seldom come true (open questions, new text) runs at plain speed: that is what lets the service keep it on by
default. A request opts out with `SamplingParams.speculative = False`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from worker.engines.generation.requests import Request, SequenceState
from worker.engines.generation.runners.runner import DecodeInput
from worker.engines.generation.sampling.sampler import RowParams, next_tokens

MAX_NGRAM, MIN_NGRAM = 4, 1  # the longest suffix tried first, as vLLM's prompt lookup does
PRIOR = 1.0  # pseudo-counts of one right and one wrong draft token before any is counted (a rate of 1/2)
CONTEXTS = 8  # a draft token's matched context is counted up to this many tokens (longer ones behave alike)
RATES_DECAY = 0.995  # the weight of DraftRates' earlier counts against each newly checked draft token
ROW_DECAY = 0.7  # the weight of a row's earlier checks against its newest (its calibration of the rates)
MOST_LIKELY = 0.99  # no draft token is counted on as surely right
STEP_DECAY = 0.98  # the weight of StepCosts' earlier steps against the newest (about the last fifty steps count)
MIN_SPREAD = 1.0  # the token counts' variance below which the steps seen cannot tell what a token adds


class Proposal(NamedTuple):
    """A row's draft: its tokens, and how many tokens of the history's suffix matched where they were found."""

    tokens: list[int]
    matched: int


def propose(history: Sequence[int], k: int, *, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> Proposal:
    """Up to k tokens that followed the most recent earlier occurrence of the history's longest matching suffix."""
    length = len(history)
    longest = min(max_ngram, length - 1)
    # One pass back over the earlier occurrences of the last token, found by list.index in C on the reversed history
    # (a Python loop over every position for each suffix length cost a row ~0.3 ms a step at 4,000 tokens), each
    # extended backwards while it matches the suffix: the most recent of the longest matches wins, as trying the
    # longest suffix first would find it. An occurrence needs a token after it (the suffix itself is excluded).
    reverse = list(reversed(history))
    matched, end, at = 0, 0, 0
    while matched < longest:
        try:
            at = reverse.index(reverse[0], at + 1)  # history[length - 1 - at] equals the last token
        except ValueError:
            break
        n = 1
        while n < longest and at + n < length and reverse[at + n] == reverse[n]:
            n += 1
        if n > matched:
            matched, end = n, length - at  # the draft starts right after the occurrence
    if matched < min_ngram:
        return Proposal([], 0)
    return Proposal(list(history[end:end + k]), matched)


def eligible(request: Request) -> bool:
    """Whether a request's rows may speculate (no grammar, logprobs, repetition penalty or min_tokens, whose eos mask
    only the plain draw applies; not opted out)."""
    params = request.params
    return params.speculative and not request.matchers and params.logprobs is None \
        and params.repetition_penalty == 1.0 and not params.min_tokens


def draft(sequence: SequenceState, k: int, context_length: int) -> Proposal:
    """The sequence's proposal: at most k tokens, fewer near its max_new_tokens or the model's context."""
    request = sequence.request
    room = min(request.params.max_new_tokens - len(sequence.tokens) - 1, context_length - sequence.position - 2, k)
    if room <= 0:
        return Proposal([], 0)
    return propose(request.prompt + sequence.tokens, room)


class DraftRates:
    """How often a draft token is right, by the length of its matched context (its proposal's match and the draft
    tokens before it, up to CONTEXTS), counted over every row and decayed; a row's own record scales them."""

    def __init__(self) -> None:
        self.right = [0.0] * (CONTEXTS + 1)
        self.checked = [0.0] * (CONTEXTS + 1)

    def rate(self, context: int) -> float:
        """The chance a draft token that follows `context` matched tokens is right, from a prior of 1/2."""
        at = min(context, CONTEXTS)
        return (self.right[at] + PRIOR) / (self.checked[at] + 2 * PRIOR)

    def yields(self, sequence: SequenceState, proposal: Proposal) -> list[float]:
        """The tokens each position of the proposal is expected to yield: the chance that it and every draft token
        before it are right, by the rates, scaled by how the row's drafts have fared against them."""
        scale = (sequence.draft_kept + PRIOR) / (sequence.draft_expected + PRIOR)
        expected, chance = [], 1.0
        for j in range(len(proposal.tokens)):
            chance *= min(MOST_LIKELY, self.rate(proposal.matched + j) * scale)
            expected.append(chance)
        return expected

    def record(self, sequence: SequenceState, proposal: Proposal, drafted: list[int], kept: list[int]) -> None:
        """After a check: each draft token the check reached (the right ones and the first wrong one) counted at its
        context; the row's right and expected tokens (decayed) calibrate its later proposals."""
        if not drafted:
            return
        right = len(kept) - 1  # kept ends with the model's own token
        reached = min(right + 1, len(drafted))
        contexts = [min(proposal.matched + j, CONTEXTS) for j in range(reached)]
        expected = sum(self.rate(at) for at in contexts)
        # Every earlier count decays once per token checked now; the j-th of these by the reached - 1 - j after it.
        self.right = [RATES_DECAY**reached * count for count in self.right]
        self.checked = [RATES_DECAY**reached * count for count in self.checked]
        for j, at in enumerate(contexts):
            weight = RATES_DECAY ** (reached - 1 - j)
            self.right[at] += weight * (j < right)
            self.checked[at] += weight
        sequence.draft_kept = ROW_DECAY * sequence.draft_kept + right
        sequence.draft_expected = ROW_DECAY * sequence.draft_expected + expected


def lengths(yields: Sequence[list[float]], decode_s: float | None, position_s: float | None) -> list[int]:
    """How many tokens of each row's proposal to check this step (0 for all: decode plainly).

    yields[row][j]: the tokens the row's (j+1)-th draft position is expected to yield (DraftRates.yields). A step of
    B rows yields B tokens for decode_s; each checked draft position adds position_s. Draft tokens are taken in
    order of their expected yield while each adds more tokens per second than the step gives so far. Before any step
    is measured the step decodes plainly (that measures one); while what a token adds is not known yet, the likeliest
    draft tokens are checked, as many as the longest proposal holds: that measures it, where every proposal checked
    whole beside sixteen rows would make a step of up to 144 tokens (on a 2-core CPU ~3 times a plain step's time).
    """
    if decode_s is None:
        return [0] * len(yields)
    gains = sorted(((gain, row) for row, expected in enumerate(yields) for gain in expected), reverse=True)
    taken = [0] * len(yields)
    if position_s is None:
        for _, row in gains[:max(map(len, yields), default=0)]:  # a row's gains fall along its draft: a prefix each
            taken[row] += 1
        return taken
    tokens, seconds = float(len(yields)), decode_s
    for gain, row in gains:
        if gain * seconds <= tokens * position_s:  # this position would lower the step's tokens per second
            break
        taken[row] += 1
        tokens, seconds = tokens + gain, seconds + position_s
    if tokens * decode_s <= len(yields) * seconds:  # no better than a plain decode step
        return [0] * len(yields)
    return taken


class StepCosts:
    """Decode-only step times against the tokens each ran (its rows plus the draft positions it checked), fit as a
    line by exponentially weighted least squares: a step's fixed cost and what each token adds.

    A speculative step is a decode step of more tokens, so plain and speculative steps measure the same line: the
    plain steps keep it current when no draft pays (a slope estimated only from speculative steps would stay where
    one noisy step left it, and a step that never speculates never corrects it), and one slow step moves a fit over
    many steps little.
    """

    def __init__(self) -> None:
        self.weight = self.tokens = self.seconds = self.tokens_sq = self.cross = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        """A decode-only step that ran `tokens` tokens (rows and checked draft positions) in `seconds`."""
        keep = STEP_DECAY
        self.weight = keep * self.weight + 1
        self.tokens = keep * self.tokens + tokens
        self.seconds = keep * self.seconds + seconds
        self.tokens_sq = keep * self.tokens_sq + tokens * tokens
        self.cross = keep * self.cross + tokens * seconds

    def line(self) -> tuple[float, float | None] | None:
        """(fixed seconds, seconds per token), the slope None while the steps seen do not tell it (too few token
        counts, or a fit that says a token costs nothing); None before any step."""
        if not self.weight:
            return None
        spread = self.weight * self.tokens_sq - self.tokens * self.tokens
        mean_tokens, mean_seconds = self.tokens / self.weight, self.seconds / self.weight
        if spread <= MIN_SPREAD * self.weight * self.weight:
            return mean_seconds, None
        slope = (self.weight * self.cross - self.tokens * self.seconds) / spread
        if slope <= 0:
            return mean_seconds, None
        return max(mean_seconds - slope * mean_tokens, 0.0), slope

    def price(self, rows: int) -> tuple[float | None, float | None]:
        """(a plain step of `rows` rows, one more checked position) in seconds, as `lengths` takes them."""
        line = self.line()
        if line is None:
            return None, None
        fixed, per_token = line
        return (fixed if per_token is None else fixed + per_token * rows), per_token


def check_input(rows: Sequence[SequenceState], drafts: Sequence[Sequence[int]], device: torch.device) -> DecodeInput:
    """A speculative step's decode tokens: each decode row's last token and its draft at consecutive positions, each
    a decode token of its own that reads its row up to itself (DecodeInput.rows): no padding to the longest draft."""
    chunks = [[s.tokens[-1], *d] for s, d in zip(rows, drafts, strict=True)]
    owners = [row for row, chunk in enumerate(chunks) for _ in chunk]
    positions = [s.position + j for s, chunk in zip(rows, chunks, strict=True) for j in range(len(chunk))]
    return DecodeInput(torch.tensor([t for chunk in chunks for t in chunk], dtype=torch.long, device=device),
                       torch.tensor(positions, device=device), max(positions) + 1, rows=owners)


def choices(logits: torch.Tensor, rows: Sequence[SequenceState], spans: Sequence[int]) -> list[int]:
    """The token plain decoding would choose at every checked position (logits [positions, V], each row's `span`
    positions in order): the argmax of a greedy row; a sampled row's draw with the uniform of that token's index in
    its answer (position j of a row holding t tokens draws token t + j, as plain decoding's counter would)."""
    at = [(sequence, j) for sequence, span in zip(rows, spans, strict=True) for j in range(span)]
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
