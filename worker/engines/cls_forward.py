"""A BERT classifier's training loss that runs the last encoder layer for the [CLS] position only.

The head reads nothing but the last layer's first position, so that layer's query, attention output and
feed-forward matmuls for every other position are wasted work (about a seventh of a 6-layer model's).
Keys and values still cover every position, so the loss and its gradients are those of the full forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.modeling_attn_mask_utils import _prepare_4d_attention_mask_for_sdpa


def supports_cls_only(model: torch.nn.Module) -> bool:
    """True for a plain BertForSequenceClassification (SDPA attention, absolute positions, single-label)."""
    config = getattr(model, "config", None)
    return (type(model).__name__ == "BertForSequenceClassification" and config is not None
            and config._attn_implementation == "sdpa"
            and getattr(config, "position_embedding_type", "absolute") == "absolute"
            and not config.is_decoder and not config.add_cross_attention
            and not config.chunk_size_feed_forward and config.num_labels > 1
            and config.problem_type in (None, "single_label_classification"))


def cls_only_loss(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the model's logits, computing the last layer at [CLS] only."""
    bert = model.bert
    hidden = bert.embeddings(input_ids=input_ids)
    # The same additive mask BertModel builds for SDPA (None when nothing is padded).
    mask = _prepare_4d_attention_mask_for_sdpa(attention_mask, hidden.dtype, tgt_len=input_ids.shape[1])
    *body, last = bert.encoder.layer
    for layer in body:
        hidden = layer(hidden, attention_mask=mask)[0]
    first = _last_layer_at_first_position(last, hidden, None if mask is None else mask[:, :, :1])
    logits = model.classifier(model.dropout(bert.pooler(first)))
    return F.cross_entropy(logits.view(-1, model.config.num_labels), labels.view(-1))


def _last_layer_at_first_position(layer: torch.nn.Module, hidden: torch.Tensor,
                                  mask: torch.Tensor | None) -> torch.Tensor:
    """BertLayer's output at position 0 only: query from position 0, keys and values from all positions."""
    attention = layer.attention.self
    batch = hidden.shape[0]

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.view(batch, -1, attention.num_attention_heads, attention.attention_head_size).transpose(1, 2)

    first = hidden[:, :1]
    context = F.scaled_dot_product_attention(
        heads(attention.query(first)), heads(attention.key(hidden)), heads(attention.value(hidden)),
        attn_mask=mask, dropout_p=attention.dropout_prob if attention.training else 0.0)
    context = context.transpose(1, 2).reshape(batch, 1, attention.all_head_size)
    attended = layer.attention.output(context, first)
    return layer.output(layer.intermediate(attended), attended)
