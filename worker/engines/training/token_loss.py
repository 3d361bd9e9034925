"""Log-probabilities of chosen tokens without ever holding [tokens x vocab] logits: the loss of every LM recipe.

A causal LM's plain loss takes the model's logits over the whole vocabulary for every position, upcasts them to
fp32, and keeps them (and their softmax) for backward: at 49k-256k vocabulary entries that is most of a
fine-tune's activation memory (SmolLM2's 49,152 x 8 rows of 2,048 tokens: 3.2 GB per fp32 copy). Here the model
returns its last hidden states (no logits: `logits_to_keep=1`), only the positions that carry a target go through
the output layer, and they go through it `chunk` rows at a time, in forward and again in backward (the chunk's
logits are recomputed rather than kept): the peak is one chunk's logits, about CHUNK_VALUES floats. It is the
technique of Liger-Kernel's fused linear cross-entropy and TRL's chunked loss, in plain torch, so it runs on
every device.

Which models it applies to is checked, not assumed: `probe` runs the model once on a few tokens and compares the
output layer applied to its last hidden state with the logits the model returns (Gemma's soft-capping and
Granite's logit scaling are applied as the model applies them); a model whose output differs any other way keeps
the plain path. The same probe checks that a row of several examples (positions restarting at 0) gives each
example the logits it gets alone: the condition for padding-free packing (training/packing.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from core.estimate import CHUNK_VALUES, MemoryEstimate  # logits one chunk holds: the estimate counts the same
from worker.engines.training.chat_render import IGNORE


@dataclass(frozen=True)
class OutputHead:
    """The output layer as the model applies it: logits = cap * tanh((h @ W.T + b) / scale / cap)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    scale: float = 1.0  # Granite divides its logits by `logits_scaling`
    softcap: float | None = None  # Gemma 2/3's final_logit_softcapping

    @property
    def chunk(self) -> int:
        """Rows of hidden states per chunk: CHUNK_VALUES logits."""
        return max(1, CHUNK_VALUES // self.weight.shape[0])


@dataclass(frozen=True)
class ModelChecks:
    """What `probe` found about a causal LM: its output layer for the chunked loss, and whether rows may pack."""

    head: OutputHead | None  # None: the model's logits differ from its output layer's; the plain loss is used
    packs: bool  # examples packed in one row (positions restarting) get the logits they get alone

    @property
    def loss(self) -> str:
        """The manifest's name of the loss path."""
        return "chunked" if self.head is not None else "full-logits"


def memory_record(checks: ModelChecks, checkpointing: bool, estimate: MemoryEstimate | None,
                  quantized_base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest's record of a run's memory techniques and the peak it was admitted at; `quantized_base` is a
    4-bit base's format and backend (QLoRA: training.quantized.describe), None for a full-precision one."""
    return {"loss": checks.loss, "gradient_checkpointing": checkpointing,
            "estimated_peak_bytes": None if estimate is None else estimate.total_bytes,
            "quantized_base": quantized_base}


def output_head(model: torch.nn.Module) -> OutputHead | None:
    """The model's output layer, if it is a plain Linear (a LoRA'd or custom head is not)."""
    getter = getattr(model, "get_output_embeddings", None)
    layer = getter() if getter is not None else None
    if type(layer) is not torch.nn.Linear:
        return None
    config = getattr(model, "config", None)
    scale = float(getattr(config, "logits_scaling", None) or 1.0)
    softcap = getattr(config, "final_logit_softcapping", None)
    return OutputHead(layer.weight, layer.bias, scale=scale, softcap=float(softcap) if softcap else None)


def probe(model: torch.nn.Module, vocab_size: int, *, device: str | torch.device) -> ModelChecks:
    """Run the model on two short examples, alone and packed, and compare (see the module's docstring)."""
    head = output_head(model)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(min(5, vocab_size - 1), vocab_size, (1, 12), generator=generator).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
            logits = out.logits.float()
            if head is not None and not torch.allclose(_logits(head, out.hidden_states[-1][0]), logits[0],
                                                       rtol=1e-3, atol=1e-3):
                head = None
            first, second = ids[:, :5], ids[:, 5:]
            positions = torch.cat([torch.arange(5), torch.arange(7)]).unsqueeze(0).to(device)
            packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits.float()
            alone = torch.cat([model(input_ids=part, use_cache=False).logits.float() for part in (first, second)], 1)
            packs = bool(torch.allclose(packed, alone, rtol=1e-3, atol=1e-3))
    finally:
        model.train(was_training)
    return ModelChecks(head=head, packs=packs)


def shifted_targets(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets and their selection for target_logprobs from unshifted labels (IGNORE outside the loss): position t
    predicts labels[t + 1]."""
    targets = torch.full_like(labels, IGNORE)
    targets[:, :-1] = labels[:, 1:]
    select = targets != IGNORE
    return targets.clamp(min=0), select


def target_logprobs(model: torch.nn.Module, checks: ModelChecks | None, *, input_ids: torch.Tensor,
                    targets: torch.Tensor, select: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    position_ids: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
    """fp32 log-probabilities of `targets[select]` predicted at the positions `select` of input_ids.

    targets and select are [rows, positions] (the target at position t is the token after t); the result has one
    value per selected position, in row-major order. `model` may be a DDP wrapper of the checked model; without
    checks (or with no checked head) the model's own logits are used.
    """
    inputs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
    if position_ids is not None:
        inputs["position_ids"] = position_ids
    chosen = targets[select]
    # The head is read from the model at each call: FSDP replaces parameters when it shards them (and a sharded
    # weight, a DTensor, exists whole only inside the model's own forward, which then computes the logits).
    head = None if checks is None or checks.head is None else output_head(getattr(model, "module", model))
    if head is None or isinstance(head.weight, DTensor):
        logits = model(**inputs).logits[select].float() / temperature
        return torch.log_softmax(logits, dim=-1).gather(1, chosen.unsqueeze(1)).squeeze(1)
    # logits_to_keep=1: the model computes one position's logits, not the vocabulary for every position.
    out = model(**inputs, output_hidden_states=True, logits_to_keep=1)
    hidden = out.hidden_states[-1][select]
    return ChunkedLogprobs.apply(hidden, head.weight, head.bias, chosen, head, temperature)


def _logits(head: OutputHead, hidden: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 logits of hidden rows, as the model computes them, divided by the sampling temperature."""
    raw = F.linear(hidden, head.weight.to(hidden.dtype), None if head.bias is None else head.bias.to(hidden.dtype))
    logits = raw.float() / head.scale
    if head.softcap is not None:
        logits = torch.tanh(logits / head.softcap) * head.softcap
    return logits / temperature


class ChunkedLogprobs(torch.autograd.Function):
    """log softmax(head(hidden))[target] per row, chunk by chunk; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, head: OutputHead, temperature: float) -> torch.Tensor:
        # Under autocast the output layer runs in the autocast dtype, as it does in the model's own forward.
        dtype = _compute_dtype(hidden)
        rows = hidden.to(dtype)
        out = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
        with torch.autocast(rows.device.type, enabled=False):
            for start in range(0, rows.shape[0], head.chunk):
                end = start + head.chunk
                logits = _logits(head, rows[start:end], temperature)
                picked = logits.gather(1, targets[start:end].unsqueeze(1)).squeeze(1)
                out[start:end] = picked - torch.logsumexp(logits, dim=-1)
        ctx.save_for_backward(rows, targets)
        ctx.head, ctx.temperature, ctx.hidden_dtype = head, temperature, hidden.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        rows, targets = ctx.saved_tensors
        head: OutputHead = ctx.head
        weight = head.weight
        need_weight = ctx.needs_input_grad[1]
        need_bias = head.bias is not None and ctx.needs_input_grad[2]
        grad_hidden = torch.empty_like(rows)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=rows.device) if need_bias else None
        matmul_weight = weight.to(rows.dtype)
        with torch.autocast(rows.device.type, enabled=False):
            for start in range(0, rows.shape[0], head.chunk):
                end = start + head.chunk
                chunk = rows[start:end]
                raw = F.linear(chunk, matmul_weight,
                               None if head.bias is None else head.bias.to(rows.dtype)).float() / head.scale
                capped = raw if head.softcap is None else torch.tanh(raw / head.softcap) * head.softcap
                logits = capped / ctx.temperature
                # d logp[t] / d logits = onehot(t) - softmax(logits), times the upstream gradient of each row.
                grad_logits = torch.softmax(logits, dim=-1).mul_(-grad_out[start:end].unsqueeze(1))
                grad_logits.scatter_add_(1, targets[start:end].unsqueeze(1), grad_out[start:end].unsqueeze(1))
                grad_logits.div_(ctx.temperature)
                if head.softcap is not None:  # d cap*tanh(x/cap) / dx = 1 - tanh(x/cap)^2
                    grad_logits.mul_(1 - (capped / head.softcap) ** 2)
                grad_raw = grad_logits.div_(head.scale)
                grad_hidden[start:end] = (grad_raw.to(rows.dtype) @ matmul_weight)
                if grad_weight is not None:
                    grad_weight.addmm_(grad_raw.t(), chunk.float())
                if grad_bias is not None:
                    grad_bias += grad_raw.sum(0)
        return (grad_hidden.to(ctx.hidden_dtype),
                None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(weight.dtype), None, None, None)


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype
