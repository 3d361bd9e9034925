"""Any causal LM transformers defines, served through transformers' own model over the engine's paged KV cache.

The model is `AutoModelForCausalLM` itself (its embeddings' scaling, norms, rotary variants, MoE routing, soft-capped
logits: every architecture's own code), loaded with an attention implementation registered here,
"trainserve_paged". A step's tokens go through it as one flat sequence ([1, decode rows + padded prompt chunks], each
token at its own position), so continuous batching, chunked prefill, prefix sharing and speculative checks work as
they do for the built-in runners: only attention differs per token, and that is ours. transformers computes each
layer's queries, keys and values (after its norms and rotation) and calls the registered function, which writes the
keys and values to the layer's cache blocks and attends each token to its own row, as the llama-family runner does:
the decode kernel or SDPA where the model's attention is plain softmax attention (sliding windows included), an eager
path where it is not (Gemma 2's soft-capped scores, gpt-oss's sink logits), computed as transformers' eager
attention computes them. Greedy output equals `generate` token for token in fp32.

Slower than the built-in runners (module dispatch, no joined projections or packed weights); the model support
table in the serving guide gives its measured speed.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from worker.engines.device import DevicePlan
from worker.engines.generation.caches.paged_cache import DecodeLayout, PagedCache, PrefillLayout, sees, trim_heap
from worker.engines.generation.lora.runner_lora import RunnerLora
from worker.engines.generation.runners.gpt2_weights import eos_ids, resolve_folder
from worker.engines.generation.runners.runner import DecodeInput, PrefillInput

ATTENTION = "trainserve_paged"  # the attention implementation name the loaded model is given


@dataclass
class _Step:
    """What one forward's attention calls read: the step's layouts and where its decode tokens end."""

    runner: GeneralRunner
    batch: int
    rows: DecodeLayout | None
    layout: PrefillLayout | None
    prefill_masks: dict[int | None, torch.Tensor]


_STEP: contextvars.ContextVar[_Step] = contextvars.ContextVar("trainserve_paged_step")


def _paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, softcap: float | None = None,
                     s_aux: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: query [1, heads, N, head_dim], key and value [1, kv heads, N,
    head_dim] for the step's flat tokens -> ([1, N, heads, head_dim], no weights)."""
    step = _STEP.get()
    return step.runner.attend(module, step, query[0].transpose(0, 1), key[0].transpose(0, 1),
                              value[0].transpose(0, 1), scaling, sliding_window, softcap, s_aux)[None], None


AttentionInterface.register(ATTENTION, _paged_attention)
# No mask: each token's row and position decide what it sees (the layouts build those masks).
AttentionMaskInterface.register(ATTENTION, lambda *args, **kwargs: None)


def _sdpa_with(softcap: float | None, sinks: torch.Tensor | None) -> Callable[..., torch.Tensor]:
    """attention(q, k, v, attn_mask=..., is_causal=..., scale=..., enable_gqa=...) computed as transformers' eager
    attention does for a model whose scores are soft-capped (Gemma 2) or that adds per-head sink logits (gpt-oss)."""

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: torch.Tensor | None = None,
                  is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            groups = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if is_causal:
            attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, torch.finfo(scores.dtype).min)
        if sinks is None:
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        else:
            sink = sinks.reshape(-1, 1, 1).to(scores.dtype).expand(*scores.shape[:-1], 1)
            combined = torch.cat([scores, sink], dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
        return torch.matmul(probs, v)

    return attention


class GeneralRunner:
    """transformers' own causal LM over the paged KV cache (see the module docstring); the engine's Runner."""

    def __init__(self, model: torch.nn.Module, config: PretrainedConfig, eos_token_ids: frozenset[int],
                 plan: DevicePlan, *, max_rows: int) -> None:
        self.model = model
        self.config = config
        text = config.get_text_config()
        self.eos_token_ids = eos_token_ids
        self.device = torch.device(plan.device)
        self.dtype = next(model.parameters()).dtype
        self.attention_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        self.heads = text.num_attention_heads
        self.cache_heads = getattr(text, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // self.heads
        self.gqa = self.heads != self.cache_heads
        self.max_rows = max_rows
        self.max_length = int(getattr(text, "max_position_embeddings", None) or 2048)
        self.cache = PagedCache(n_layer=text.num_hidden_layers, cache_heads=self.cache_heads,
                                head_dim=self.head_dim, device=self.device, dtype=self.dtype)
        self.lora: RunnerLora | None = None  # adapters over these bases are served merged (served_models.py)
        # Soft-capped scores (Gemma 2) or sink logits (gpt-oss): attention the decode kernel does not compute.
        self.eager = bool(getattr(text, "attn_logit_softcapping", None)) or text.model_type == "gpt_oss"
        self.windows = _windows(text)  # the sliding windows the layers use (None: full attention)
        trim_heap()

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's parameters and buffers (tied weights counted once)."""
        seen: dict[int, int] = {}
        for tensor in [*self.model.parameters(), *self.model.buffers()]:
            seen[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
        return sum(seen.values())

    def forward(self, decode: DecodeInput | None, prefill: PrefillInput | None) -> torch.Tensor:
        """A decode step for rows 0..B-1 and the prefill of prompt chunks in one pass: logits [B + P, V]."""
        ids: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []
        batch, rows, layout = 0, None, None
        masks: dict[int | None, torch.Tensor] = {}
        if decode is not None:
            batch = decode.tokens.shape[0]
            rows = DecodeLayout(self.cache, decode.positions, decode.span, decode.table, decode.rows)
            if self.eager:
                rows.kernel = None  # the kernel computes plain softmax attention only
            ids.append(decode.tokens)
            positions.append(decode.positions)
        if prefill is not None:
            layout = PrefillLayout(self.cache, prefill.prompts, prefill.rows, prefill.starts, self.device,
                                   prefill.scored)
            ids.append(layout.ids.view(-1))
            positions.append(layout.positions.view(-1))
            if not layout.chunked:
                at = torch.arange(layout.width, device=self.device)
                masks = {window: sees(at, layout.width, window) for window in self.windows}
        flat_ids = (ids[0] if len(ids) == 1 else torch.cat(ids))[None]
        flat_positions = (positions[0] if len(positions) == 1 else torch.cat(positions))[None]
        # Only the decode rows and each prompt's last position (a scored prompt's every one) need logits (the
        # model applies its own final soft-capping or scaling to those).
        keep = layout.picked(batch, self.device) if layout is not None else torch.arange(batch, device=self.device)
        token = _STEP.set(_Step(self, batch, rows, layout, masks))
        try:
            out = self.model(input_ids=flat_ids, position_ids=flat_positions, use_cache=False,
                             logits_to_keep=keep)
        finally:
            _STEP.reset(token)
        return out.logits[0].float()

    def attend(self, module: torch.nn.Module, step: _Step, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float | None, window: int | None, softcap: float | None,
               sinks: torch.Tensor | None) -> torch.Tensor:
        """One layer's attention for the step's flat tokens: query [N, heads, head_dim], key and value [N, kv heads,
        head_dim] -> [N, heads, head_dim], the keys and values written to the layer's blocks first."""
        index = int(cast(Any, module).layer_idx)
        batch, rows, layout = step.batch, step.rows, step.layout
        scale = self.head_dim ** -0.5 if scaling is None else scaling
        window = window or None
        attention = self._attention_for(softcap, sinks, scale)
        out = []
        if rows is not None:
            self.cache.write(index, rows.slots, key[:batch], value[:batch])
            out.append(rows.attend(attention, query[:batch], index, window, scale))
        if layout is not None:
            layout.store(index, key[batch:], value[batch:])
            q = query[batch:].view(layout.count, layout.width, self.heads, self.head_dim).transpose(1, 2)
            if layout.chunked:
                attended = layout.attend(attention, q, index, window)
            else:
                k, v = (t[batch:].view(layout.count, layout.width, self.cache_heads, self.head_dim).transpose(1, 2)
                        for t in (key, value))
                mask = {"attn_mask": step.prefill_masks[window]} if window else {"is_causal": True}
                attended = attention(q, k, v, **mask)
            out.append(attended.transpose(1, 2).reshape(layout.count * layout.width, self.heads, self.head_dim))
        return out[0] if len(out) == 1 else torch.cat(out)

    def _attention_for(self, softcap: float | None, sinks: torch.Tensor | None,
                       scale: float) -> Callable[..., torch.Tensor]:
        """attention(q, k, v, **mask) in the attention dtype, with the layer's scale (and soft cap or sinks)."""
        eager = _sdpa_with(softcap, sinks) if softcap is not None or sinks is not None else None
        dtype, gqa = self.attention_dtype, self.gqa

        def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **mask: Any) -> torch.Tensor:
            compute = eager or F.scaled_dot_product_attention
            return compute(q.to(dtype), k.to(dtype), v.to(dtype), scale=scale, enable_gqa=gqa, **mask).to(q.dtype)

        return attention


def _windows(text: PretrainedConfig) -> set[int | None]:
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if not window:
        return {None}
    if types is None:
        return {None, window}
    return {window if kind == "sliding_attention" else None for kind in types}


def load_general(model: str | Path, plan: DevicePlan, *, max_rows: int) -> GeneralRunner:
    """A causal LM checkpoint (safetensors, no remote code) as a GeneralRunner on the plan's device and dtype."""
    folder = resolve_folder(model)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    dtype = plan.autocast_dtype or torch.float32
    # Loaded on this thread alone: transformers 5 copies weights on a pool of threads by default, and every thread
    # that runs a tensor op keeps an OpenMP team; with more teams than cores each decode step pays wake-ups (the
    # engine loads on its scheduler thread for the same reason). Measured: 99 -> 138 tokens/s on SmolLM2, 2 cores.
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    loaded = cast(Any, AutoModelForCausalLM).from_pretrained(folder, dtype=dtype, attn_implementation=ATTENTION,
                                                  use_safetensors=True, trust_remote_code=False)
    loaded.to(plan.device).eval()
    loaded.requires_grad_(False)
    return GeneralRunner(loaded, loaded.config, eos_ids(folder, config), plan, max_rows=max_rows)
