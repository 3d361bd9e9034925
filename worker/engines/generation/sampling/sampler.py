"""Choosing each row's next token: HF-compatible processors, per-sequence RNG, logprobs of the draw."""

from __future__ import annotations

import math
import secrets

import torch

from core.protocol import MAX_SEED, SamplingParams

# Top-k/top-p rows are processed on their best candidates instead of a full-vocabulary sort (the sort of a
# [16, 50257] batch costs ~100 ms on a small CPU); the set grows only when it does not cover the nucleus.
CANDIDATES = 256

__all__ = [
    "CANDIDATES", "MAX_SEED", "RowParams", "SamplingParams", "StepLogprobs", "constrain",
    "counter_uniforms", "next_tokens", "penalize", "row_seed", "step_logprobs", "truncated_distribution",
]


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    # Logical shift of an int64 holding 64 raw bits (torch's >> is arithmetic).
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    # SplitMix64's finaliser; int64 products wrap modulo 2**64 on every torch backend.
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def counter_uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row, a pure function of (seed, counter): no generator state, any device."""
    bits = _shr(_splitmix(_splitmix(seeds) + counters), 40)  # the top 24 bits: exact in float32
    return bits.to(torch.float32) * 2.0**-24


def row_seed(params: SamplingParams, index: int) -> int | None:
    """The seed of choice `index`: seed + index when seeded, a random one when not, None when greedy."""
    if params.greedy:
        return None
    return secrets.randbits(63) if params.seed is None else params.seed + index


class RowParams:
    """The sampling settings of a batch's rows as tensors; rebuilt only when the batch changes.

    seeds[i] and counters[i] (tokens row i has drawn so far) give sampled rows their noise: the draw for a
    row's k-th token depends on (seed, k) only, so it is the same whatever shares the batch. A seed of None
    for a sampled row means a random one (row_seed).
    """

    def __init__(self, params: list[SamplingParams], device: torch.device, *,
                 seeds: list[int | None] | None = None, counters: list[int] | None = None) -> None:
        penalties = [p.repetition_penalty for p in params]
        self.penalty = (
            torch.tensor(penalties, device=device)[:, None] if any(v != 1.0 for v in penalties) else None
        )
        self.sample_rows = [i for i, p in enumerate(params) if not p.greedy]
        sampled = [params[i] for i in self.sample_rows]
        seeds = seeds or [None] * len(params)
        counters = counters or [0] * len(params)
        chosen = [row_seed(params[i], 0) if seeds[i] is None else seeds[i] for i in self.sample_rows]
        self.seeds = torch.tensor(chosen, dtype=torch.long, device=device)
        self.counters = torch.tensor([counters[i] for i in self.sample_rows], dtype=torch.long, device=device)
        self.sample_index = torch.tensor(self.sample_rows, dtype=torch.long, device=device)
        self.temperature = torch.tensor([p.temperature for p in sampled], device=device)[:, None]
        # Positions within the sampled rows: plain (whole distribution) or truncated (top-k and/or top-p).
        plain = [i for i, p in enumerate(sampled) if p.top_k == 0 and p.top_p == 1.0]
        truncated = [i for i, p in enumerate(sampled) if p.top_k > 0 or p.top_p < 1.0]
        self.plain = torch.tensor(plain, dtype=torch.long, device=device) if plain else None
        self.truncated = torch.tensor(truncated, dtype=torch.long, device=device) if truncated else None
        self.top_k = torch.tensor([sampled[i].top_k for i in truncated], dtype=torch.long, device=device)
        self.top_p = torch.tensor([sampled[i].top_p for i in truncated], device=device)
        self.max_top_k = max((sampled[i].top_k for i in truncated), default=0)
        self.open_nucleus = any(sampled[i].top_k == 0 and sampled[i].top_p < 1.0 for i in truncated)


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF RepetitionPenaltyLogitsProcessor over a [B, V] mask of tokens seen (prompt + generated)."""
    # A row with penalty 1 is unchanged: x * 1 and x / 1 are exact.
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def truncated_distribution(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, *, max_top_k: int | None = None,
    open_nucleus: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's top-k then top-p warpers on temperature-scaled logits [S, V], over candidate tokens.

    Returns (probs [S, C], token ids [S, C]): the kept tokens' probabilities (zeros elsewhere), renormalised
    as the softmax of HF's warped logits would be. top_k 0 = off, top_p 1 = off, per row. Given the
    largest top_k and whether some row has top-p without top-k (open_nucleus), it reads nothing back from
    the device unless such a row's nucleus may reach past the candidates.
    """
    vocab = scaled.shape[-1]
    largest = int(top_k.max()) if max_top_k is None else max_top_k
    limit = min(vocab, max(CANDIDATES, largest + 1))  # +1: a token tied with the k-th stays, as in HF
    full_mass = None
    while True:
        values, ids = scaled.topk(limit, dim=-1)  # sorted, largest first
        # HF TopK keeps logits >= the k-th largest; rows with k=0 keep every candidate.
        kth = values.gather(1, (top_k.clamp(1, limit) - 1)[:, None])
        values = values.masked_fill((values < kth) & (top_k > 0)[:, None], -math.inf)
        if full_mass is None:  # a row without top-k normalises over the whole vocabulary
            full_mass = scaled.logsumexp(dim=-1, keepdim=True)
        log_norm = torch.where((top_k > 0)[:, None], values.logsumexp(dim=-1, keepdim=True), full_mass)
        probs = (values - log_norm).exp()
        # HF TopP drops a token when the ascending cumulative mass up to it is <= 1 - p, i.e. when the mass
        # ranked strictly above it is >= p. The most likely token always stays.
        above = probs.cumsum(dim=-1) - probs
        covered = (top_k > 0) | (top_p >= 1.0) | (probs.sum(dim=-1) >= top_p)
        if limit == vocab or not open_nucleus or bool(covered.all()):
            break
        limit = min(vocab, limit * 8)  # some nucleus reaches past the candidates: look further
    probs = probs.masked_fill(above >= top_p[:, None], 0.0)
    return probs / probs.sum(dim=-1, keepdim=True), ids


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    # The first index whose cumulative mass exceeds u * total; zero-probability entries have zero width.
    cdf = probs.cumsum(dim=-1)
    drawn = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0]
    return drawn.clamp_max(cdf.shape[-1] - 1)


def next_tokens(logits: torch.Tensor, rows: RowParams, seen: torch.Tensor | None) -> torch.Tensor:
    """Each row's next token id [B]: repetition penalty, then argmax or temperature -> top-k -> top-p -> draw.

    All rows in one vectorised pass; each sampled row uses one counter-based uniform per token and its
    counter advances, so a sequence's randomness does not depend on what else shares the batch.
    """
    if rows.penalty is not None and seen is not None:
        logits = penalize(logits, seen, rows.penalty)
    tokens = logits.argmax(dim=-1)
    if not rows.sample_rows:
        return tokens
    scaled = logits.index_select(0, rows.sample_index) / rows.temperature
    uniforms = counter_uniforms(rows.seeds, rows.counters)
    rows.counters += 1
    drawn = torch.empty(len(rows.sample_rows), dtype=torch.long, device=scaled.device)
    if rows.plain is not None:
        drawn[rows.plain] = _inverse_cdf(scaled.index_select(0, rows.plain).softmax(dim=-1), uniforms[rows.plain])
    if rows.truncated is not None:
        probs, ids = truncated_distribution(scaled.index_select(0, rows.truncated), rows.top_k, rows.top_p,
                                            max_top_k=rows.max_top_k, open_nucleus=rows.open_nucleus)
        picked = _inverse_cdf(probs, uniforms[rows.truncated])
        drawn[rows.truncated] = ids.gather(1, picked[:, None])[:, 0]
    tokens[rows.sample_index] = drawn
    return tokens


def constrain(logits: torch.Tensor, rows: list[int], allowed: torch.Tensor) -> torch.Tensor:
    """Logits with each listed row's disallowed tokens at -inf (allowed: bool [len(rows), V]); other rows as they are.

    Constrained and free rows then draw in one next_tokens call. A row left with no allowed token (a
    matcher in error) keeps its logits rather than becoming all -inf, which would sample garbage ids.
    """
    if not rows:
        return logits
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    allowed = allowed.to(logits.device)
    allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
    masked = logits.index_select(0, index).masked_fill(~allowed, -math.inf)
    return logits.index_copy(0, index, masked)


class StepLogprobs:
    """One step's log-probabilities for the rows that asked: the sampled token's and the top `k`, on the host."""

    def __init__(self, rows: list[int], chosen: list[float], top_ids: list[list[int]],
                 top_values: list[list[float]]) -> None:
        self.rows = rows
        self.chosen = chosen
        self.top_ids = top_ids
        self.top_values = top_values


def step_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], top: list[int]) -> StepLogprobs:
    """Log-softmax in fp32 of the model's logits for `rows` (before penalty, temperature or grammar mask,
    as OpenAI and vLLM report them): each sampled token's logprob and its row's `top[i]` most likely tokens.

    Taken from the step's own logits, so there is no second forward pass; one device->host copy for all rows.
    """
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logprobs = logits.index_select(0, index).float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.index_select(0, index)[:, None])[:, 0]
    host_values: list[list[float]] = [[] for _ in rows]
    host_ids: list[list[int]] = [[] for _ in rows]
    if max(top):
        values, ids = logprobs.topk(max(top), dim=-1)
        host_values, host_ids = values.tolist(), ids.tolist()
    return StepLogprobs(rows, chosen.tolist(), [i[:k] for i, k in zip(host_ids, top, strict=True)],
                        [v[:k] for v, k in zip(host_values, top, strict=True)])
