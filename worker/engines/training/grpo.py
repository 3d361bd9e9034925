"""Group Relative Policy Optimization (Shao et al., 2024, DeepSeekMath) as TRL's GRPOTrainer computes it.

For each prompt G completions are sampled and scored; a completion's advantage is its reward minus its group's
mean (divided by the group's std unless `scale_rewards` is off, Dr. GRPO's choice). Per completion token:

    ratio = exp(logp - logp_old)        loss = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)
                                              + beta * (exp(ref - logp) - (ref - logp) - 1)

(the KL term is Schulman's k3 estimator against the reference: the base with the adapter off). With one
gradient step per batch of rollouts (TRL's default num_iterations=1) logp_old is logp detached: the ratio is 1
with the policy gradient's derivative. The token losses are reduced by `loss_type`: grpo, the mean of each
completion's token mean; dapo, the mean over all tokens of the batch (DAPO's token-level loss, TRL's bnpo);
dr_grpo, the sum over tokens divided by rows x max_completion_tokens (Dr. GRPO's constant normaliser).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STD_EPS = 1e-4  # TRL's: a group whose rewards are all equal gets zero advantages, not a division by zero


def group_advantages(rewards: torch.Tensor, group: int, *, scale: bool) -> torch.Tensor:
    """Rewards [prompts * group] (each prompt's group contiguous) -> advantages relative to their group."""
    grouped = rewards.view(-1, group)
    mean = grouped.mean(dim=1, keepdim=True)
    advantages = grouped - mean
    if scale:
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + STD_EPS)
    return advantages.reshape(-1)


@dataclass(frozen=True)
class LossParts:
    """A GRPO loss and what is reported about it (detached)."""

    loss: torch.Tensor
    kl: float  # mean k3 KL to the reference over completion tokens (0 without a reference)
    clip_fraction: float  # share of completion tokens whose ratio was clipped


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, *, beta: float, epsilon: float, epsilon_high: float,
              loss_type: str, max_completion_tokens: int) -> LossParts:
    """The loss over a batch of completions: token log-probs [rows, tokens], advantages [rows], mask [rows, tokens]."""
    mask = mask.to(logps.dtype)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    adv = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = torch.zeros((), device=logps.device)
    if ref_logps is not None and beta != 0.0:
        per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        per_token = per_token + beta * per_token_kl
        kl = (per_token_kl * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "dapo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (per_token.shape[0] * max_completion_tokens)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    is_clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))
    clip_fraction = (is_clipped.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1.0)
    return LossParts(loss, float(kl.detach()), float(clip_fraction.detach()))
