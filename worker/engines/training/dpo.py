"""Direct Preference Optimization (Rafailov et al., 2023) on an adapter, with the base model as the reference.

For a prompt x with a preferred reply y_w and a non-preferred y_l the loss is
    -log sigmoid(beta * ((log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))))
where pi is the model being tuned and ref the frozen starting point. With LoRA the reference is the same
weights with the adapter switched off (`disable_adapter()`), so no second copy of the model is held: one
forward without the adapter (no autograd) and one with it, each over the preferred and non-preferred rows
stacked into one batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from worker.engines.training.chat_render import IGNORE
from worker.engines.training.token_loss import ModelChecks, shifted_targets, target_logprobs


def sequence_logprobs(model: torch.nn.Module, checks: ModelChecks | None, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per row, the summed log-probability of its labelled tokens (labels not shifted; IGNORE elsewhere)."""
    # fp32 log-probabilities (token_loss): bf16 ones over the vocabulary lose the small differences DPO works on.
    targets, select = shifted_targets(labels)
    logprobs = target_logprobs(model, checks, input_ids=input_ids, attention_mask=attention_mask, targets=targets,
                               select=select)
    rows = select.nonzero()[:, 0]
    return torch.zeros(labels.shape[0], dtype=logprobs.dtype, device=logprobs.device).index_add(0, rows, logprobs)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean DPO loss over pairs and its implicit rewards (beta times each reply's log-ratio)."""
    chosen_rewards = beta * (policy_chosen - reference_chosen)
    rejected_rewards = beta * (policy_rejected - reference_rejected)
    loss = -F.logsigmoid(chosen_rewards - rejected_rewards).mean()
    return loss, {"reward_chosen": chosen_rewards.detach().mean(), "reward_rejected": rejected_rewards.detach().mean(),
                  "reward_accuracy": (chosen_rewards > rejected_rewards).float().mean().detach(),
                  "reward_margin": (chosen_rewards - rejected_rewards).detach().mean()}


def preference_loss(forward: torch.nn.Module, adapted: Any, checks: ModelChecks | None, chosen: dict[str, torch.Tensor],
                    rejected: dict[str, torch.Tensor], beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO loss of a batch of pairs (collated rows); the reference is `adapted` with its adapter switched off.

    `forward` is the adapted model itself or its DistributedDataParallel wrapper (which has no disable_adapter).
    """
    pairs = chosen["input_ids"].shape[0]
    batch = _stack(chosen, rejected)
    with torch.no_grad(), adapted.disable_adapter():
        reference = sequence_logprobs(forward, checks, batch["input_ids"], batch["attention_mask"], batch["labels"])
    policy = sequence_logprobs(forward, checks, batch["input_ids"], batch["attention_mask"], batch["labels"])
    return dpo_loss(policy[:pairs], policy[pairs:], reference[:pairs], reference[pairs:], beta)


def _stack(chosen: dict[str, torch.Tensor], rejected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Preferred rows then non-preferred rows, right-padded to one width (pad id 0: masked out anyway)."""
    width = max(chosen["input_ids"].shape[1], rejected["input_ids"].shape[1])
    fills = {"input_ids": 0, "attention_mask": 0, "labels": IGNORE}
    return {key: torch.cat([F.pad(part[key], (0, width - part[key].shape[1]), value=fill)
                            for part in (chosen, rejected)]) for key, fill in fills.items()}
