"""Load a GPT-2 checkpoint for serving and run it over a slot-addressed KV cache."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

from core.paths import GPT2_TOKENIZER_DIR
from worker.engines.device import DevicePlan

ASSETS_TOKENIZER = GPT2_TOKENIZER_DIR
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer_config.json")
# On the CPU in fp32 every projection and the LM head run on oneDNN weights packed once at load: MKL's sgemm
# repacks the weight on every call, which dominates at 4-64 rows (the LM head of a 16-row decode step: 35 ms
# packed, 60 ms plain on a 2-core EPYC) and costs nothing extra at one row. The packed layout replaces the
# original (which is then dropped), so the weights are held once.
PROBE_ROWS = 4


def load_tokenizer(model: str | Path) -> PreTrainedTokenizerBase:
    """The checkpoint's own tokenizer, or the bundled GPT-2 BPE when its folder has no tokenizer files."""
    folder = Path(model)
    if folder.is_dir() and not any((folder / name).exists() for name in _TOKENIZER_FILES):
        return AutoTokenizer.from_pretrained(ASSETS_TOKENIZER)
    return AutoTokenizer.from_pretrained(model)


def load_causal_lm(model: str | Path, plan: DevicePlan) -> PreTrainedModel:
    """A GPT-2 causal LM from safetensors, on the plan's device, in the plan's dtype, in eval mode."""
    config = AutoConfig.from_pretrained(model, trust_remote_code=False)  # checked before any weight is read
    if config.model_type != "gpt2":
        raise ValueError(f"{model}: model_type {config.model_type!r} is not supported; the engine serves GPT-2 only")
    if getattr(config, "add_cross_attention", False):
        raise ValueError(f"{model}: GPT-2 with cross-attention is not supported")
    lm = AutoModelForCausalLM.from_pretrained(model, config=config, use_safetensors=True, trust_remote_code=False)
    # For inference the weights themselves are cast (no autocast): half the memory and no per-op casts.
    return lm.to(device=plan.device, dtype=plan.autocast_dtype or torch.float32).eval()


def eos_ids(model: PreTrainedModel) -> frozenset[int]:
    """The ids that end a choice: generation_config's eos, else the model config's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def token_bytes(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> list[bytes]:
    """The exact bytes each token id stands for (byte-level BPE), so text can be decoded incrementally."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder_kind = type(backend.decoder).__name__ if backend is not None and backend.decoder is not None else None
    if decoder_kind != "ByteLevel":
        raise ValueError(f"tokenizer {type(tokenizer).__name__} is not a byte-level BPE (decoder {decoder_kind})")
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    added = set(tokenizer.get_added_vocab())
    table = [b""] * vocab_size  # ids past the tokenizer (a padded embedding matrix) decode to nothing
    for token, index in tokenizer.get_vocab().items():
        if index >= vocab_size:
            continue
        if token in added or any(char not in byte_of for char in token):
            table[index] = token.encode("utf-8")  # added tokens are stored as plain text
        else:
            table[index] = bytes(byte_of[char] for char in token)
    return table


def _next_pow2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


class Gpt2Runner:
    """GPT-2 forward passes over a KV cache with one row per running sequence.

    Row r holds positions 0..len-1 of one sequence, so sequences of any length share a batch without
    padding or shifting: a decode step writes each row's new key/value at its own position and masks
    the positions past it. The HF modules (layer norms, Conv1D projections, MLP) are reused as they are;
    only attention and the cache are ours. On the CPU in fp32 the projections' and the LM head's weights
    are packed (read from `source`, the checkpoint's folder or safetensors file, when given: see `_pack_weights`) and
    the modules' own weights are dropped, so the model is no longer usable as an HF module.
    """

    def __init__(self, lm: PreTrainedModel, plan: DevicePlan, *, max_rows: int, source: Path | None = None,
                 pack: bool = True) -> None:
        config = lm.config
        self.device = torch.device(plan.device)
        self.dtype = lm.transformer.wte.weight.dtype
        self.wte = lm.transformer.wte
        self.wpe = lm.transformer.wpe
        self.blocks = list(lm.transformer.h)
        self.ln_f = lm.transformer.ln_f
        self.lm_head = lm.lm_head
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.max_rows = max_rows
        self.max_length = config.n_positions
        # Eager GPT-2 semantics: 1/sqrt(d) unless scale_attn_weights is off, further divided by the layer
        # number when scale_attn_by_inverse_layer_idx is on. None lets SDPA use its own (identical) 1/sqrt(d).
        self.scales: list[float | None] = []
        for index in range(config.n_layer):
            scale = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
            if config.scale_attn_by_inverse_layer_idx:
                scale /= index + 1
            default = config.scale_attn_weights and not config.scale_attn_by_inverse_layer_idx
            self.scales.append(None if default else scale)
        self.keys: torch.Tensor | None = None  # [layer, row, head, position, head_dim]
        self.values: torch.Tensor | None = None
        cpu_fp32 = self.device.type == "cpu" and self.dtype == torch.float32
        self.packed = _pack_weights(lm, source) if pack and cpu_fp32 else None
        _trim_heap()  # packing's transposed temporaries came from the heap: give them back
        # oneDNN's gelu_tanh post-op computes HF's gelu_new (within float rounding: a few 1e-7).
        self.fused_gelu = config.activation_function in ("gelu_new", "gelu_pytorch_tanh")

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights the runner holds: parameters still in the model plus the packed copies."""
        params = {p.data_ptr(): p.numel() * p.element_size() for p in self.lm_parameters() if p.numel()}
        packed = sum(t.numel() * t.element_size() for layer in self.packed or [] for t in layer if t is not None)
        return sum(params.values()) + packed

    def lm_parameters(self) -> list[torch.Tensor]:
        """The model's parameters the runner reads (the tied embedding counted once by its data pointer)."""
        modules = [self.wte, self.wpe, self.ln_f, self.lm_head, *self.blocks]
        return [p for m in modules for p in m.parameters()]

    @property
    def capacity(self) -> tuple[int, int]:
        """(rows, positions) the cache holds now; (0, 0) when released."""
        return (0, 0) if self.keys is None else (self.keys.shape[1], self.keys.shape[3])

    def reserve(self, rows: int, length: int) -> None:
        """Grow the cache (by doubling, keeping its contents) to hold `rows` sequences of `length` positions."""
        have_rows, have_length = self.capacity
        if rows <= have_rows and length <= have_length:
            return
        new_rows = min(self.max_rows, max(have_rows, _next_pow2(rows)))
        new_length = min(self.max_length, max(have_length, _next_pow2(length)))
        shape = (len(self.blocks), new_rows, self.n_head, new_length, self.head_dim)
        # Zeros, not empty: masked positions still meet V in the P@V product and 0 * NaN would be NaN.
        keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.keys is not None and self.values is not None:
            keys[:, :have_rows, :, :have_length] = self.keys
            values[:, :have_rows, :, :have_length] = self.values
        self.keys, self.values = keys, values

    def release(self) -> None:
        """Drop the cache (it is rebuilt on the next reserve) and hand freed heap memory back to the system."""
        if self.keys is not None:
            self.keys = self.values = None
            _trim_heap()

    def move_row(self, source: int, target: int, length: int) -> None:
        """Copy the first `length` positions of row `source` into row `target` (compaction after a finish)."""
        assert self.keys is not None and self.values is not None
        self.keys[:, target, :, :length] = self.keys[:, source, :, :length]
        self.values[:, target, :, :length] = self.values[:, source, :, :length]

    def _mlp_in(self, block: torch.nn.Module, packed: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        # GPT2MLP's first half without its no-op dropout; packed, the tanh GELU runs fused in the matmul.
        if packed is None or not self.fused_gelu:
            return block.mlp.act(_linear(block.mlp.c_fc, packed, x))
        return _linear(block.mlp.c_fc, packed, x, "gelu", "tanh")

    def prefill(self, prompts: list[list[int]], rows: list[list[int]]) -> torch.Tensor:
        """Run whole prompts (right-padded), store their keys/values in the given rows, return last logits [R, V].

        rows[i] lists the cache rows that start from prompt i (n choices share one prefill).
        """
        assert self.keys is not None and self.values is not None
        lengths = [len(prompt) for prompt in prompts]
        width = max(lengths)
        # Right padding needs no mask: with causal attention a real position never sees a later pad.
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], dtype=torch.long, device=self.device)
        target = torch.tensor([row for group in rows for row in group], dtype=torch.long, device=self.device)
        source = torch.tensor([i for i, group in enumerate(rows) for _ in group], dtype=torch.long, device=self.device)
        positions = torch.arange(width, device=self.device)
        hidden = self.wte(ids) + self.wpe(positions)[None]
        batch = len(prompts)
        packed = self.packed
        for index, block in enumerate(self.blocks):
            attn, proj, fc, out = packed[index] if packed else _UNPACKED
            query, key, value = _linear(block.attn.c_attn, attn, block.ln_1(hidden)).split(hidden.shape[-1], dim=2)
            query = query.view(batch, width, self.n_head, self.head_dim).transpose(1, 2)
            key = key.view(batch, width, self.n_head, self.head_dim).transpose(1, 2)
            value = value.view(batch, width, self.n_head, self.head_dim).transpose(1, 2)
            layer_keys, layer_values = self.keys[index], self.values[index]
            layer_keys[target, :, :width] = key.index_select(0, source)
            layer_values[target, :, :width] = value.index_select(0, source)
            attended = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=self.scales[index])
            hidden = _linear(block.attn.c_proj, proj, attended.transpose(1, 2).reshape(batch, width, -1)) + hidden
            hidden = hidden + _linear(block.mlp.c_proj, out, self._mlp_in(block, fc, block.ln_2(hidden)))
        last = torch.tensor([length - 1 for length in lengths], device=self.device)
        # Only the last position's logits are needed: the LM head is the largest matmul of the model.
        final = self.ln_f(hidden[torch.arange(batch, device=self.device), last])
        return _linear(self.lm_head, packed[-1][0] if packed else None, final).float()

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, span: int) -> torch.Tensor:
        """One step for rows 0..B-1: token b sits at positions[b]; attention covers positions < span. Logits [B, V]."""
        assert self.keys is not None and self.values is not None
        batch = tokens.shape[0]
        packed = self.packed
        # Where each row's new key/value vectors go in a layer's cache seen as [rows * head * position, head_dim]:
        # one index_copy_ per layer instead of an index_put with two advanced indices (several times slower).
        length = self.keys.shape[3]
        heads = torch.arange(self.n_head, device=self.device)
        rows = torch.arange(batch, device=self.device)
        slots = ((rows[:, None] * self.n_head + heads[None]) * length + positions[:, None]).reshape(-1)
        hidden = (self.wte(tokens) + self.wpe(positions))[:, None]  # [B, 1, E]
        # Row b may see its own positions 0..positions[b]; later slots hold stale or padding keys.
        mask = (torch.arange(span, device=self.device)[None] <= positions[:, None])[:, None, None]
        for index, block in enumerate(self.blocks):
            attn, proj, fc, out = packed[index] if packed else _UNPACKED
            query, key, value = _linear(block.attn.c_attn, attn, block.ln_1(hidden)).split(hidden.shape[-1], dim=2)
            query = query.view(batch, 1, self.n_head, self.head_dim).transpose(1, 2)
            layer_keys, layer_values = self.keys[index], self.values[index]
            layer_keys.view(-1, self.head_dim).index_copy_(0, slots, key.reshape(-1, self.head_dim))
            layer_values.view(-1, self.head_dim).index_copy_(0, slots, value.reshape(-1, self.head_dim))
            attended = F.scaled_dot_product_attention(
                query, layer_keys[:batch, :, :span], layer_values[:batch, :, :span],
                attn_mask=mask, scale=self.scales[index],
            )
            hidden = _linear(block.attn.c_proj, proj, attended.transpose(1, 2).reshape(batch, 1, -1)) + hidden
            hidden = hidden + _linear(block.mlp.c_proj, out, self._mlp_in(block, fc, block.ln_2(hidden)))
        return _linear(self.lm_head, packed[-1][0] if packed else None, self.ln_f(hidden[:, 0])).float()


_UNPACKED = (None, None, None, None)


def _pack_weights(lm: PreTrainedModel, source: Path | None) -> list[tuple[torch.Tensor | None, ...]] | None:
    """oneDNN-packed [out, in] copies of every projection and the LM head, the originals dropped; None without oneDNN.

    Weights are read from `source` (a safetensors file, through a mapping freed after each tensor) when it
    holds them in fp32, so the model's own mapped pages are never touched: with HF's lazily mapped
    checkpoints only the embedding rows actually looked up become resident. Otherwise from the modules.
    """
    convs = [(b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj) for b in lm.transformer.h]
    names = {id(p): n for n, p in lm.named_parameters(remove_duplicate=False)}
    tied = lm.lm_head.weight is lm.transformer.wte.weight
    try:
        with torch.inference_mode(), _weights_from(source) as read:
            def pack(module: torch.nn.Module, transposed: bool) -> torch.Tensor:
                name = "transformer.wte.weight" if module is lm.lm_head and tied else names[id(module.weight)]
                weight = read(name, module.weight)
                weight = weight.t() if transposed else weight
                return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)

            layers: list[tuple[torch.Tensor | None, ...]] = [tuple(pack(c, True) for c in group) for group in convs]
            layers.append((pack(lm.lm_head, False), None, None, None))
            # Probe once: a build without these ops, or one that computes differently, keeps the HF modules.
            probe = torch.randn(PROBE_ROWS, lm.config.n_embd)
            conv = convs[0][0]
            expected = probe @ read(names[id(conv.weight)], conv.weight) + conv.bias
            if not torch.allclose(_linear(conv, layers[0][0], probe), expected, rtol=1e-4, atol=1e-4):
                return None
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    empty = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    for module in [c for group in convs for c in group] + ([] if tied else [lm.lm_head]):
        module.weight = empty  # the packed copy is the only one now
    return layers


@contextmanager
def _weights_from(source: Path | None) -> Iterator[Callable[[str, torch.Tensor], torch.Tensor]]:
    """read(name, fallback): the fp32 tensor `name` from the checkpoint's safetensors file, else the fallback."""
    if source is not None and source.is_dir():
        source = source / "model.safetensors"  # a sharded checkpoint has none: the modules' weights are used
    if source is None or not source.is_file():
        yield lambda name, fallback: fallback
        return
    with safe_open(str(source), framework="pt") as handle:
        keys = set(handle.keys())

        def read(name: str, fallback: torch.Tensor) -> torch.Tensor:
            for key in (name, name.removeprefix("transformer.")):  # checkpoints saved with or without the prefix
                if key in keys:
                    tensor = handle.get_tensor(key)
                    if tensor.dtype == torch.float32 and tensor.shape == fallback.shape:
                        return tensor
            return fallback

        yield read


def _trim_heap() -> None:
    # glibc keeps freed heap memory (per-thread arenas, and chunks below its adaptive mmap threshold) resident
    # until asked; elsewhere this is a no-op.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _linear(module: torch.nn.Module, packed: torch.Tensor | None, x: torch.Tensor, post: str = "none",
            algorithm: str = "") -> torch.Tensor:
    """module(x) (a Conv1D or Linear), through its packed weight when there is one, with an optional post-op."""
    if packed is None:
        return module(x)
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, module.bias, post, [], algorithm)
    return out.view(*x.shape[:-1], -1)
