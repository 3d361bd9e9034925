"""Llama-family forward passes (llama, mistral, qwen2, qwen3) over the paged KV cache, in the GPT-2 runner's shape.

The scheduler sees the same interface as Gpt2Runner (its cache, forward). Per block:
RMSNorm, one joined q/k/v matmul (+ biases for qwen2), per-head q/k RMSNorm (qwen3), rotary embeddings on
q and k (the cache holds rotated keys), grouped-query attention (the cache keeps only the kv heads; the paged
kernel and SDPA's enable_gqa read each once per group), an optional sliding window, then SwiGLU. Every step
follows HF's modeling code's order of operations and dtypes, so greedy decoding matches `generate` token for token
in fp32.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from core.architectures import LLAMA_FAMILY, unsupported_reason
from worker.engines.device import DevicePlan, linear
from worker.engines.generation.caches.paged_cache import DecodeLayout, PagedCache, PrefillLayout, sees, trim_heap
from worker.engines.generation.lora.runner_lora import RunnerLora
from worker.engines.generation.runners.decoder_weights import DecoderWeights, load_decoder
from worker.engines.generation.runners.gpt2 import Gpt2Runner
from worker.engines.generation.runners.gpt2_weights import ACTIVATIONS, load_gpt2, resolve_folder
from worker.engines.generation.runners.runner import DecodeInput, PrefillInput, Runner

Rotary = tuple[torch.Tensor, torch.Tensor]  # cos, sin [N, 1, head_dim] in the compute dtype


class DecoderRunner:
    """A llama-family decoder over the paged KV cache, one block table per running sequence (see Gpt2Runner)."""

    def __init__(self, weights: DecoderWeights, plan: DevicePlan, *, max_rows: int) -> None:
        self.weights = weights
        self.config = weights.config
        self.eos_token_ids = weights.eos_token_ids
        self.device = torch.device(plan.device)
        self.dtype = weights.dtype
        # As in Gpt2Runner: on a CPU attention reads the bf16 cache as fp32 (PyTorch's bf16 CPU SDPA is slower).
        self.attention_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        self.n_layer = len(weights.layers)
        self.heads, self.cache_heads, self.head_dim = weights.heads, weights.kv_heads, weights.head_dim
        self.q_size, self.kv_size = self.heads * self.head_dim, self.cache_heads * self.head_dim
        self.max_rows = max_rows
        self.max_length = weights.context_length
        self.cache = PagedCache(n_layer=self.n_layer, cache_heads=self.cache_heads, head_dim=self.head_dim,
                                device=self.device, dtype=self.dtype)
        self.act = ACTIVATIONS[weights.act]
        self.inv_freq = weights.inv_freq.to(self.device)
        self.gqa = self.heads != self.cache_heads
        self.lora: RunnerLora | None = None  # per-row LoRA adapters (attach_lora), for the serving engine
        trim_heap()  # joining and packing left temporaries on the heap

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights the runner holds (a tied, unpacked LM head is the embedding: counted once)."""
        w = self.weights
        tensors = [w.embed, w.norm] + ([] if w.head is w.embed else [w.head])
        for layer in w.layers:
            tensors += [t for t in (layer.qkv, layer.qkv_bias, layer.o, layer.o_bias, layer.gate_up, layer.down,
                                    layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # HF's LlamaRMSNorm: the statistics in fp32, the weight applied after the cast back.
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.weights.eps)
        return weight * hidden.to(x.dtype)

    def _rotary(self, positions: torch.Tensor) -> Rotary:
        # HF: freqs = inv_freq x position in fp32, emb = [freqs, freqs], cos/sin times the attention factor.
        freqs = positions.float()[:, None] * self.inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.weights.rope_scale
        return (emb.cos() * scale).to(self.dtype)[:, None], (emb.sin() * scale).to(self.dtype)[:, None]

    @staticmethod
    def _rotate(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        cos, sin = rotary
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
        dtype = self.attention_dtype
        attended = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), enable_gqa=self.gqa,
                                                  **kwargs)
        return attended.to(self.dtype)

    def _block(self, index: int, hidden: torch.Tensor, rotary: Rotary, attend) -> torch.Tensor:
        """One block over flat tokens [N, hidden]; attend(index, q, k, v) -> [N, heads * head_dim] does the cache."""
        layer, n = self.weights.layers[index], hidden.shape[0]
        normed = self._norm(hidden, layer.input_norm)
        qkv = self._adapted(index, "qkv", normed, linear(normed, layer.qkv, layer.qkv_bias))
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=1)
        query = query.view(n, self.heads, self.head_dim)
        key = key.view(n, self.cache_heads, self.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            query, key = self._norm(query, layer.q_norm), self._norm(key, layer.k_norm)
        query, key = self._rotate(query, rotary), self._rotate(key, rotary)
        attended = attend(index, query, key, value.view(n, self.cache_heads, self.head_dim))
        hidden = hidden + self._adapted(index, "o", attended, linear(attended, layer.o, layer.o_bias))
        normed = self._norm(hidden, layer.post_norm)
        gate, up = self._adapted(index, "gate_up", normed, linear(normed, layer.gate_up, None)).chunk(2, dim=-1)
        inner = self.act(gate) * up
        return hidden + self._adapted(index, "down", inner, linear(inner, layer.down, None))

    def attach_lora(self, lora: RunnerLora) -> None:
        """Serve LoRA adapters: each forward adds every token's adapter update (lora.set_rows names the slots)."""
        self.lora = lora

    def _adapted(self, index: int, name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out if self.lora is None else self.lora.add(index, name, x, out)

    def forward(self, decode: DecodeInput | None, prefill: PrefillInput | None) -> torch.Tensor:
        """A decode step for rows 0..B-1 and the prefill of prompt chunks in one pass: logits [B + P, V].

        prefill: the chunks, the cache rows of each, where each begins in its prompt (see PrefillLayout).
        """
        cache = self.cache
        positions: list[torch.Tensor] = []
        ids: list[torch.Tensor] = []
        batch, layout = 0, None
        if decode is not None:
            batch = decode.tokens.shape[0]
            # Row b sees its positions 0..positions[b] (a window: only the last `window` of them).
            rows = DecodeLayout(cache, decode.positions, decode.span, decode.table, decode.rows)
            ids.append(decode.tokens)
            positions.append(decode.positions)
        if prefill is not None:
            layout = PrefillLayout(cache, prefill.prompts, prefill.rows, prefill.starts, self.device,
                                   prefill.scored)
            ids.append(layout.ids.view(-1))
            positions.append(layout.positions.view(-1))
            if not layout.chunked:
                at = torch.arange(layout.width, device=self.device)
                prefill_masks = {window: sees(at, layout.width, window) for window in self._windows()}
        flat_ids = ids[0] if len(ids) == 1 else torch.cat(ids)
        if self.lora is not None:  # one plan per forward, shared by every layer
            self.lora.begin(batch, layout.count if layout else 0, layout.width if layout else 0)
        hidden = F.embedding(flat_ids, self.weights.embed).to(self.dtype)
        rotary = self._rotary(positions[0] if len(positions) == 1 else torch.cat(positions))
        scale = self.head_dim**-0.5

        def attend(index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            window = self.weights.layers[index].window
            out = []
            if decode is not None:
                cache.write(index, rows.slots, key[:batch], value[:batch])
                attended = rows.attend(self._attention, query[:batch], index, window, scale)
                out.append(attended.reshape(batch, self.q_size))
            if layout is not None:
                layout.store(index, key[batch:], value[batch:])
                q = query[batch:].view(layout.count, layout.width, self.heads, self.head_dim).transpose(1, 2)
                if layout.chunked:  # chunks read their rows' cache: earlier chunks of the same prompt are there
                    attended = layout.attend(self._attention, q, index, window)
                else:
                    k, v = (t[batch:].view(layout.count, layout.width, self.cache_heads, self.head_dim).transpose(1, 2)
                            for t in (key, value))
                    mask = {"attn_mask": prefill_masks[window]} if window else {"is_causal": True}
                    attended = self._attention(q, k, v, **mask)
                out.append(attended.transpose(1, 2).reshape(layout.count * layout.width, self.q_size))
            return out[0] if len(out) == 1 else torch.cat(out)

        for index in range(self.n_layer):
            hidden = self._block(index, hidden, rotary, attend)
        # Only the decode rows and each prompt's last position (a scored prompt's every one) need logits: the LM
        # head is the largest matmul.
        if layout is not None:
            hidden = hidden.index_select(0, layout.picked(batch, self.device))
        return linear(self._norm(hidden, self.weights.norm), self.weights.head, None).float()

    def _windows(self) -> set[int]:
        return {layer.window for layer in self.weights.layers if layer.window}


def open_runner(model: str | Path, plan: DevicePlan, *, max_rows: int, runner: str = "auto") -> Runner:
    """The serving runner for a checkpoint: GPT-2's own, the llama-family one, or for any other causal LM
    transformers' own model over the paged cache (general.py); ValueError for what none of them can serve.
    runner "general": the general runner whatever the model (the built-in runners' reference, and their benchmark)."""
    folder = resolve_folder(model)
    config = json.loads((folder / "config.json").read_text())
    reason = unsupported_reason(config)
    if reason is not None:
        raise ValueError(f"{model}: {reason}")
    kind = config.get("model_type")
    if runner not in ("auto", "general"):
        raise ValueError(f"runner must be 'auto' or 'general', not {runner!r}")
    if runner == "general":
        kind = None
    if kind == "gpt2":
        return Gpt2Runner(load_gpt2(model, plan), plan, max_rows=max_rows)
    if kind in LLAMA_FAMILY:
        return DecoderRunner(load_decoder(model, plan), plan, max_rows=max_rows)
    from worker.engines.generation.runners.general import load_general  # imports transformers' modeling code

    return load_general(model, plan, max_rows=max_rows)
