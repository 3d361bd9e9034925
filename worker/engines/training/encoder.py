"""Training-time shortcuts for BERT-style classifiers that change how, not what, the model computes.

- Attention implementation. On a CPU a training step uses the plain matmul-softmax-matmul ("eager")
  attention: under bf16 autocast PyTorch's SDPA backward is about 10x slower (measured: 12.4 ms vs 1.2 ms for
  32x12 heads of 16 tokens, forward and backward); in fp32 the two take the same time (MiniLM, 16 and 128
  tokens), and eager's attention dropout goes through the engine's cheaper CPU dropout
  (worker.engines.training.dropout) where SDPA draws its own. GPUs keep the library's default (SDPA, fused kernels).
- The last layer at [CLS] only. BertForSequenceClassification reads only position 0 of the last layer
  (pooler, then classifier), so the last layer's queries, attention output, feed-forward and layer norms
  are needed at that position alone; keys and values still cover every token. That is about 5/6 of one
  layer's matmuls (about 1/7 of a 6-layer model's) that a training step no longer does, forward and
  backward. The loss and gradients are the same function of the weights; only the random stream differs
  (dropout masks are drawn for one position instead of all), so a seeded run draws other masks than before.
  The layer's parameters and the saved model are untouched: this replaces one module's forward in memory.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
import torch.nn.functional as F

from worker.engines.device import DevicePlan


def attention_implementation(plan: DevicePlan) -> str | None:
    """"eager" for training on a CPU (see the module doc); None (the library's default, SDPA) elsewhere."""
    return "eager" if plan.device_type == "cpu" else None


def last_layer_at_cls(model: torch.nn.Module) -> bool:
    """Make a BertForSequenceClassification compute its last layer at position 0 only; False where it does not apply.

    Applies only to the plain BERT encoder this was checked against (absolute positions, no decoder or
    cross-attention, no pruned heads); any other model keeps its own forward.
    """
    if type(model).__name__ != "BertForSequenceClassification":
        return False
    bert: Any = model  # HF's modules: attributes by the architecture's names
    config = bert.config
    if (getattr(config, "position_embedding_type", "absolute") != "absolute" or config.is_decoder
            or config.add_cross_attention or getattr(config, "chunk_size_feed_forward", 0)):
        return False
    layer = bert.bert.encoder.layer[-1]
    if getattr(layer.attention, "pruned_heads", None):
        return False
    layer.forward = types.MethodType(_cls_layer_forward, layer)
    return True


def _cls_layer_forward(layer: Any, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       *args: Any, **kwargs: Any) -> torch.Tensor:
    """BertLayer.forward with queries at position 0 only: returns hidden states of shape [batch, 1, width]."""
    attention = layer.attention.self
    batch, length, _ = hidden_states.shape
    heads, size = attention.num_attention_heads, attention.attention_head_size
    cls = hidden_states[:, :1]

    def split(x: torch.Tensor, positions: int) -> torch.Tensor:
        return x.view(batch, positions, heads, size).transpose(1, 2)

    query = split(attention.query(cls), 1)
    key = split(attention.key(hidden_states), length)
    value = split(attention.value(hidden_states), length)
    scores = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(size)
    if attention_mask is not None:
        mask = attention_mask[..., :1, :]  # [batch, 1, 1, length]: eager's and SDPA's 4-D masks alike
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    probabilities = attention.dropout(F.softmax(scores, dim=-1))
    context = torch.matmul(probabilities, value).transpose(1, 2).reshape(batch, 1, heads * size)
    attended = layer.attention.output(context, cls)
    return layer.feed_forward_chunk(attended)
