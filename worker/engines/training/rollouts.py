"""Rollouts for reinforcement fine-tuning: completions sampled from the policy being trained, in its own process.

The sampler is the training model itself decoding with its KV cache (transformers' `past_key_values`): the
adapter's current weights are the ones sampled from, with no copy of the base and no weights moved between a
trainer and a server each step (training never imports the serving engine; its LoRA slots would need the adapter
written in every step). Prompts are left-padded into one batch, each row's position ids count its own tokens.

Each row has its own seed: its k-th draw is the k-th uniform of a torch.Generator seeded with it, turned into a
token by the inverse CDF of the temperature-scaled distribution. A row's completion therefore depends on its
prompt, its seed and the weights only, whatever else shares the batch, so a resumed run draws what an
uninterrupted one would (the seeds are a pure function of the run's seed and the step: `rollout_seed`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.engines.training.token_loss import ModelChecks, target_logprobs

SEED_SPACE = 2**63 - 1


def rollout_seed(seed: int, *parts: int) -> int:
    """A row's sampling seed from the run's seed and its coordinates (epoch, slot, sample): a pure function."""
    value = seed
    for part in parts:
        # An LCG step per coordinate (Knuth's MMIX constants): distinct coordinates give distinct, spread seeds.
        value = (value * 6364136223846793005 + 1442695040888963407 + part) % SEED_SPACE
    return value


@dataclass(frozen=True)
class Rollouts:
    """A batch of sampled completions: left-padded prompts, right-padded completions (pad after the end)."""

    prompt_ids: torch.Tensor  # [rows, prompt width]
    prompt_mask: torch.Tensor  # [rows, prompt width], 0 on the left padding
    completion_ids: torch.Tensor  # [rows, completion width]
    completion_mask: torch.Tensor  # [rows, completion width], 1 through the end-of-turn token
    logprobs: torch.Tensor  # [rows, completion width], the sampler's log-probability of each drawn token

    def sequences(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt then completion, and its attention mask: what the loss's forward reads."""
        return (torch.cat([self.prompt_ids, self.completion_ids], dim=1),
                torch.cat([self.prompt_mask, self.completion_mask], dim=1))


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device | str) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """Prompts as one left-padded batch and its mask."""
    width = max(len(prompt) for prompt in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count each row's own tokens (left padding does not shift them)."""
    return (mask.cumsum(dim=1) - 1).clamp(min=0)


@torch.no_grad()
def sample(model: torch.nn.Module, prompts: Sequence[Sequence[int]], seeds: Sequence[int], *, max_new_tokens: int,
           temperature: float, stop_ids: set[int], pad_id: int) -> Rollouts:
    """Sample one completion per prompt (row i with seeds[i]) until a stop token or max_new_tokens."""
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = left_pad(prompts, pad_id, device)
    rows = len(prompts)
    generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
    mask, past = prompt_mask, None
    step_ids, step_pos = prompt_ids, positions(prompt_mask)
    drawn, logprobs, alive_masks = [], [], []
    alive = torch.ones(rows, dtype=torch.bool, device=device)
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    for _ in range(max_new_tokens):
        out = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=past,
                    use_cache=True)
        past = out.past_key_values
        logp = torch.log_softmax(out.logits[:, -1].float() / temperature, dim=-1)
        cdf = logp.exp().cumsum(dim=-1)
        uniforms = torch.stack([torch.rand((), generator=g) for g in generators]).to(device)
        token = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1)).squeeze(1).clamp(max=cdf.shape[1] - 1)
        token = torch.where(alive, token, torch.full_like(token, pad_id))
        drawn.append(token)
        logprobs.append(torch.where(alive, logp.gather(1, token.unsqueeze(1)).squeeze(1), torch.zeros_like(cdf[:, 0])))
        alive_masks.append(alive.long())
        alive = alive & ~torch.isin(token, stops)
        if not alive.any():
            break
        mask = torch.cat([mask, torch.ones((rows, 1), dtype=mask.dtype, device=device)], dim=1)
        step_ids, step_pos = token.unsqueeze(1), step_pos[:, -1:] + 1
    return Rollouts(prompt_ids, prompt_mask, torch.stack(drawn, dim=1), torch.stack(alive_masks, dim=1),
                    torch.stack(logprobs, dim=1))


def token_logprobs(model: torch.nn.Module, rollouts: Rollouts, temperature: float = 1.0,
                   checks: ModelChecks | None = None) -> torch.Tensor:
    """Log-probability [rows, completion width] of each completion token under `model` (one forward over prompt +
    completion), fp32; with checks, through the chunked output layer (training/token_loss.py)."""
    ids, mask = rollouts.sequences()
    completion = rollouts.completion_ids
    width = completion.shape[1]
    # The logit at position t predicts token t + 1: the completion's are the last `width` predictions.
    targets = torch.zeros_like(ids)
    targets[:, -width - 1:-1] = completion
    select = torch.zeros_like(ids, dtype=torch.bool)
    select[:, -width - 1:-1] = True
    logprobs = target_logprobs(model, checks, input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                               targets=targets, select=select, temperature=temperature)
    return logprobs.view(completion.shape)
