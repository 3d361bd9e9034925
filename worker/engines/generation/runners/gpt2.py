"""GPT-2 forward passes for serving over the paged KV cache."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from worker.engines.device import DevicePlan, linear
from worker.engines.generation.caches.paged_cache import DecodeLayout, PagedCache, PrefillLayout, trim_heap
from worker.engines.generation.lora.runner_lora import RunnerLora
from worker.engines.generation.runners.gpt2_weights import (
    ACTIVATIONS,
    PROJECTIONS,
    Gpt2Weights,
    pack_weights,
)
from worker.engines.generation.runners.runner import DecodeInput, PrefillInput

# On the CPU (fp32 or bf16) every projection and the LM head run on oneDNN weights packed once at load: MKL's
# sgemm repacks the weight on every call, which dominates at 4-64 rows (the LM head of a 16-row decode step:
# 8 ms packed, 25 ms plain in fp32 on a 2-core EPYC; bf16 4 ms packed, 7 ms plain) and costs nothing extra at
# one row. The packed layout replaces the original (which is then dropped), so the weights are held once.


class Gpt2Runner:
    """GPT-2 forward passes over the paged KV cache, one block table per running sequence.

    Row r's blocks hold positions 0..len-1 of one sequence, so sequences of any length share a batch without
    padding or shifting: a decode step writes each row's new key/value at its own position and reads only its
    own positions. The forward pass reads plain tensors (Gpt2Weights, no HF modules); on the CPU in
    fp32 or bf16 the projections' and the LM head's weights are packed for oneDNN and the mapped originals
    dropped (the embeddings stay mapped: rows are cast as they are looked up).
    """

    def __init__(self, weights: Gpt2Weights, plan: DevicePlan, *, max_rows: int, pack: bool = True) -> None:
        config = weights.config
        self.weights = weights
        self.config = config
        self.eos_token_ids = weights.eos_token_ids
        self.tensors = weights.tensors
        self.device = torch.device(plan.device)
        self.dtype = weights.dtype
        # Attention's dtype. PyTorch's CPU flash attention is 2.4x slower in bf16 than in fp32 at decode shapes
        # (16 rows x 12 heads x 1 query x 48 keys: 530 us vs 217 us with the casts, on a 2-core EPYC with
        # avx512_bf16), a third of a bf16 decode step; so on a CPU the cache stays in bf16 and attention reads
        # it as fp32. Its inputs are the bf16 values; only its output is rounded. (An fp32 cache was no faster
        # for GPT-2 small at 16 rows: attention then reads twice the bytes from memory, and it is twice the size.)
        self.attention_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        self.n_layer = config.n_layer
        self.n_head = self.cache_heads = config.n_head
        self.n_embd = config.n_embd
        self.head_dim = config.n_embd // config.n_head
        self.eps = config.layer_norm_epsilon
        self.act = ACTIVATIONS[config.activation_function]
        self.max_rows = max_rows
        self.max_length = config.n_positions
        self.cache = PagedCache(n_layer=self.n_layer, cache_heads=self.cache_heads, head_dim=self.head_dim,
                                device=self.device, dtype=self.dtype)
        self.lora: RunnerLora | None = None  # GPT-2 has no adapter path: its adapter requests are refused
        # Eager GPT-2 semantics: 1/sqrt(d) unless scale_attn_weights is off, further divided by the layer
        # number when scale_attn_by_inverse_layer_idx is on. None lets SDPA use its own (identical) 1/sqrt(d).
        self.scales: list[float | None] = []
        for index in range(config.n_layer):
            scale = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
            if config.scale_attn_by_inverse_layer_idx:
                scale /= index + 1
            default = config.scale_attn_weights and not config.scale_attn_by_inverse_layer_idx
            self.scales.append(None if default else scale)
        packable = self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)
        self.packed = pack_weights(weights) if pack and packable else None
        if self.packed is None:
            weights.cast_all()  # plain matmuls need every weight in the compute dtype
        trim_heap()  # packing's transposed temporaries came from the heap: give them back
        # oneDNN's gelu_tanh post-op computes HF's gelu_new (within float rounding: a few 1e-7).
        self.fused_gelu = config.activation_function in ("gelu_new", "gelu_pytorch_tanh")

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights the runner holds: the tensors (mapped or copied) plus the packed copies."""
        held = sum(t.numel() * t.element_size() for t in self.tensors.values())
        packed = sum(t.numel() * t.element_size() for layer in self.packed or [] for t in layer)
        return held + packed

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, **kwargs) -> torch.Tensor:
        """SDPA in the attention dtype, the result in the compute dtype (no casts when they are the same)."""
        dtype = self.attention_dtype
        attended = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), scale=self.scales[layer],
                                                  **kwargs)
        return attended.to(self.dtype)

    def _embed(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows of an embedding table in the compute dtype (a mapped fp32 table is cast row by row, as looked up)."""
        return F.embedding(ids, table).to(self.dtype)

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.n_embd,), self.tensors[f"{name}.weight"], self.tensors[f"{name}.bias"], self.eps)

    def _proj(self, layer: int, part: int, x: torch.Tensor, post: str = "none", algorithm: str = "") -> torch.Tensor:
        """Projection PROJECTIONS[part] of a layer (a Conv1D: x @ W[in, out] + b), packed when it can be."""
        name = f"h.{layer}.{PROJECTIONS[part]}"
        bias = self.tensors[f"{name}.bias"]
        flat = x.reshape(-1, x.shape[-1])
        if self.packed is not None:
            out = linear(flat, self.packed[layer][part], bias, post, algorithm)
        else:
            out = torch.addmm(bias, flat, self.tensors[f"{name}.weight"])
        return out.view(*x.shape[:-1], -1)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        final = self._norm("ln_f", hidden)
        if self.packed is not None:
            return linear(final, self.packed[-1][0], None).float()
        head = self.tensors["wte.weight" if self.weights.tied else "lm_head.weight"]
        return F.linear(final, head).float()

    def _block(self, index: int, hidden: torch.Tensor, attend) -> torch.Tensor:
        """One transformer block over flat tokens [N, E]; attend(index, q, k, v) -> [N, E] does the cache part."""
        query, key, value = self._proj(index, 0, self._norm(f"h.{index}.ln_1", hidden)).split(self.n_embd, dim=1)
        hidden = self._proj(index, 1, attend(index, query, key, value)) + hidden
        ln_2 = self._norm(f"h.{index}.ln_2", hidden)
        if self.packed is not None and self.fused_gelu:  # the tanh GELU runs fused in the c_fc matmul
            inner = self._proj(index, 2, ln_2, "gelu", "tanh")
        else:
            inner = self.act(self._proj(index, 2, ln_2))
        return hidden + self._proj(index, 3, inner)

    def prefill(self, prompts: list[list[int]], rows: list[list[int]]) -> torch.Tensor:
        """Run whole prompts, store their keys/values in the given rows, return each prompt's last logits [P, V].

        rows[i] lists the cache rows that start from prompt i (n choices share one prefill).
        """
        return self.forward(None, PrefillInput(prompts, rows, [0] * len(prompts)))

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, span: int) -> torch.Tensor:
        """One step for rows 0..B-1: token b sits at positions[b]; attention covers positions < span. Logits [B, V]."""
        return self.forward(DecodeInput(tokens, positions, span), None)

    def forward(self, decode: DecodeInput | None, prefill: PrefillInput | None) -> torch.Tensor:
        """A decode step for rows 0..B-1 and the prefill of prompt chunks in one pass: logits [B + P, V].

        One pass reads every weight once for both (a separate prefill costs a whole weight read while the
        running rows wait). All tokens go through the projections as one flat [N, E] matrix; only attention
        is done per part: decode rows against the cache, prompts causally among themselves.
        """
        cache = self.cache
        wte, wpe = self.tensors["wte.weight"], self.tensors["wpe.weight"]
        parts: list[torch.Tensor] = []
        batch = 0
        if decode is not None:
            tokens, positions = decode.tokens, decode.positions
            batch = tokens.shape[0]
            # Token b reads its row (b, or decode.rows[b]) up to positions[b].
            rows = DecodeLayout(cache, positions, decode.span, decode.table, decode.rows)
            parts.append(self._embed(wte, tokens) + self._embed(wpe, positions))
        layout = None
        if prefill is not None:
            layout = PrefillLayout(cache, prefill.prompts, prefill.rows, prefill.starts, self.device,
                                   prefill.scored)
            embedded = self._embed(wte, layout.ids) + self._embed(wpe, layout.positions)
            parts.append(embedded.view(-1, self.n_embd))
        hidden = parts[0] if len(parts) == 1 else torch.cat(parts)
        heads = (self.n_head, self.head_dim)

        def attend(index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            out = []

            def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **mask: Any) -> torch.Tensor:  # its scale
                return self._attention(q, k, v, index, **mask)

            if decode is not None:
                cache.write(index, rows.slots, key[:batch].view(batch, *heads), value[:batch].view(batch, *heads))
                scale = self.scales[index] or self.head_dim**-0.5
                attended = rows.attend(sdpa, query[:batch].view(batch, *heads), index, None, scale)
                out.append(attended.reshape(batch, self.n_embd))
            if layout is not None:
                shape = (layout.count, layout.width, self.n_head, self.head_dim)
                layout.store(index, key[batch:].view(-1, *heads), value[batch:].view(-1, *heads))
                q, k, v = (t[batch:].view(shape).transpose(1, 2) for t in (query, key, value))
                if layout.chunked:  # chunks read their rows' cache: earlier chunks of the same prompt are there
                    attended = layout.attend(sdpa, q, index, None)
                else:
                    attended = self._attention(q, k, v, index, is_causal=True)
                out.append(attended.transpose(1, 2).reshape(layout.count * layout.width, self.n_embd))
            return out[0] if len(out) == 1 else torch.cat(out)

        for index in range(self.n_layer):
            hidden = self._block(index, hidden, attend)
        # Only the decode rows and each prompt's last position (a scored prompt's every one) need logits: the LM
        # head is the largest matmul.
        if layout is not None:
            hidden = hidden.index_select(0, layout.picked(batch, self.device))
        return self._logits(hidden)

