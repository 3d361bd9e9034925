"""Padding-free packing: a micro-batch's examples as one row, positions restarting at 0 per example.

transformers builds the attention mask of such a row from its position ids (masking_utils'
find_packed_sequence_indices): every token attends only to earlier tokens of its own example, so each example gets
the logits it gets alone (training/token_loss.py's probe checks this on the model before packing is used) and the
loss, a mean over the labelled tokens of the micro-batch, is the padded batch's. What it saves is the padding: B
rows padded to the longest cost B x longest tokens through every linear layer, the packed row only the real ones.
What it may cost is attention: SDPA (and the eager path) compute the packed row's scores densely, T^2 pairs for T
packed tokens against B x longest^2 padded, so a micro-batch is packed only when the sum of both is lower
(`saves_work`): short examples of mixed lengths pack, long ones whose attention dominates stay padded.
Flash-attention's variable-length kernel would skip the cross-example pairs; with it, packing always pays.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from core.estimate import Architecture
from worker.engines.training.chat_render import IGNORE, Rendered


def pack(examples: Sequence[Rendered]) -> dict[str, torch.Tensor]:
    """input_ids, position_ids and labels [1, total tokens] of the examples in a row; no attention mask.

    An example's first token gets no label: the position before it belongs to the previous example, so the
    shifted loss would otherwise score a prediction across the boundary.
    """
    ids: list[int] = []
    positions: list[int] = []
    labels: list[int] = []
    for example in examples:
        ids.extend(example.input_ids)
        positions.extend(range(len(example.input_ids)))
        labels.append(IGNORE)
        labels.extend(example.labels[1:])
    return {"input_ids": torch.tensor([ids]), "position_ids": torch.tensor([positions]),
            "labels": torch.tensor([labels])}


def saves_work(lengths: Sequence[int], arch: Architecture | None) -> bool:
    """True when one packed row of these lengths costs fewer multiply-adds than the right-padded batch: the
    linear layers' per token, attention's per pair of tokens (dense: T^2 packed, B x longest^2 padded)."""
    if len(lengths) < 2 or arch is None:
        return False
    total, longest = sum(lengths), max(lengths)
    if total == len(lengths) * longest:
        return False  # nothing padded
    q = arch.q_hidden or arch.hidden
    mlp = arch.hidden * arch.intermediate * (3 if arch.gated_mlp else 2) * arch.active_experts
    per_token = arch.hidden * (2 * q + 2 * arch.kv_hidden) + mlp
    per_pair = 2 * q  # q.k and p.v
    padded = len(lengths) * (longest * per_token + longest**2 * per_pair)
    return total * per_token + total**2 * per_pair < padded
