"""Tiny decoders and their tokenizers for generation and training tests: the llama family (llama, mistral, qwen2,
qwen3; VARIANTS, the llama-family runner's) and today's other architectures (TODAYS, the general runner's: Gemma 2
and 3, Phi-3, OLMo 2, Granite, Mixtral, Qwen3-MoE, gpt-oss).

Random weights from a fixed seed, 2 layers, hidden 64; the variants cover head counts, GQA ratios (MQA too),
tied and untied heads, rope settings (theta, linear, llama3, yarn, dynamic), qwen2's q/k/v biases, qwen3's
q/k norms and head_dim != hidden / heads, and sliding windows shorter than the prompts. Two tokenizers are
trained here from examples/data: a Llama-2-style one (BPE, Metaspace, byte fallback with `<0xNN>` tokens,
Llama 2's decoder chain) and a byte-level BPE (as Qwen and Llama 3 ship).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from tests.conftest import DATA

CORPUS = DATA / "tinyshakespeare_sample.txt"
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "max_position_embeddings": 256,
         "initializer_range": 0.1}  # a wider init than HF's 0.02: peaked logits, so greedy has no near-ties

# name -> (config class, config overrides, tokenizer kind). Llama-2-style ids: <unk> 0, <s> 1, </s> 2.
VARIANTS: dict[str, tuple[type[PretrainedConfig], dict[str, Any], str]] = {
    "llama": (LlamaConfig, {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
                            "rope_theta": 10000.0}, "metaspace"),
    "llama-linear-bias": (LlamaConfig, {"num_attention_heads": 2, "num_key_value_heads": 2, "attention_bias": True,
                                        "tie_word_embeddings": True,
                                        "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "metaspace"),
    "llama3": (LlamaConfig, {"num_attention_heads": 8, "num_key_value_heads": 1, "tie_word_embeddings": True,
                             "rope_theta": 500000.0, "rope_scaling": {
                                 "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}, "bytelevel"),
    "mistral": (MistralConfig, {"num_attention_heads": 4, "num_key_value_heads": 1, "sliding_window": 6,
                                "tie_word_embeddings": False}, "metaspace"),
    "qwen2": (Qwen2Config, {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
                            "use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1,
                            "rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                                             "original_max_position_embeddings": 128}}, "bytelevel"),
    "qwen3": (Qwen3Config, {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                            "tie_word_embeddings": False, "rope_theta": 1000000.0,
                            "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "bytelevel"),
}

# Each with what sets it apart: Gemma's scaled embeddings, (1 + w) norms, four norms a block, query_pre_attn_scalar,
# alternating sliding and full layers (Gemma 3 with q/k norms and two rope bases, Gemma 2 with soft-capped scores
# and logits); Phi-3's joined projections and partial rotary; OLMo 2's norms after each sublayer; Granite's
# multipliers; the MoE routers (Mixtral, Qwen3-MoE: top-2 of 4 experts); gpt-oss's sink logits, biased experts and
# alternating windows. Byte-level tokenizer for all.
GQA = {"num_attention_heads": 4, "num_key_value_heads": 2}
TODAYS: dict[str, tuple[type[PretrainedConfig], dict[str, Any], str]] = {
    "gemma3": (Gemma3TextConfig, {**GQA, "head_dim": 16, "sliding_window": 4, "query_pre_attn_scalar": 16,
                                  "layer_types": ["sliding_attention", "full_attention"]}, "bytelevel"),
    "gemma2": (Gemma2Config, {**GQA, "head_dim": 16, "sliding_window": 4, "query_pre_attn_scalar": 16,
                              "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}, "bytelevel"),
    "phi3": (Phi3Config, {**GQA, "partial_rotary_factor": 0.5, "tie_word_embeddings": False,
                          "pad_token_id": 0}, "bytelevel"),
    "olmo2": (Olmo2Config, {**GQA, "tie_word_embeddings": False, "pad_token_id": 0}, "bytelevel"),
    "granite": (GraniteConfig, {**GQA, "embedding_multiplier": 6.0, "residual_multiplier": 0.5,
                                "attention_multiplier": 0.1, "logits_scaling": 2.0}, "bytelevel"),
    "mixtral": (MixtralConfig, {**GQA, "num_local_experts": 4, "num_experts_per_tok": 2,
                                "tie_word_embeddings": False}, "bytelevel"),
    "qwen3_moe": (Qwen3MoeConfig, {**GQA, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                   "moe_intermediate_size": 32, "norm_topk_prob": True,
                                   "tie_word_embeddings": False}, "bytelevel"),
    "gpt_oss": (GptOssConfig, {**GQA, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                               "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
                               "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 2.0,
                                                   "original_max_position_embeddings": 128, "beta_fast": 32.0,
                                                   "beta_slow": 1.0, "truncate": False},
                               "tie_word_embeddings": False}, "bytelevel"),
}


def _lines() -> list[str]:
    return [line for line in CORPUS.read_text().splitlines() if line.strip()]


@functools.cache
def llama2_tokenizer_json(vocab_size: int = 600) -> str:
    """A Llama-2-style tokenizer.json: BPE + byte fallback (<0x00>..<0xFF> at ids 3..258), Metaspace, BOS added."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trained.train_from_iterator(_lines(), trainers.BpeTrainer(
        vocab_size=vocab_size - 259, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    spec = json.loads(trained.to_str())["model"]
    learned = sorted((i, t) for t, i in spec["vocab"].items() if i > 2)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for _, token in learned:
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                                     fuse_unk=True))
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    # Llama 2's own decoder chain: spaces back, byte runs to text, one leading space stripped.
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", 1)])
    return tokenizer.to_str()


@functools.cache
def bytelevel_tokenizer_json(vocab_size: int = 600) -> str:
    """A byte-level BPE tokenizer.json (Qwen / Llama 3 style) with <|endoftext|> and <|im_end|> as specials."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(_lines(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tokenizer.to_str()


def save_tokenizer(kind: str, folder: Path) -> PreTrainedTokenizerFast:
    """Save one of the two tokenizers to `folder` as a transformers fast tokenizer; returns it."""
    if kind == "metaspace":
        from transformers import LlamaTokenizerFast

        tokenizer: PreTrainedTokenizerFast = LlamaTokenizerFast(
            tokenizer_object=Tokenizer.from_str(llama2_tokenizer_json()), bos_token="<s>", eos_token="</s>",
            unk_token="<unk>", add_bos_token=True, add_eos_token=False, legacy=True)
    else:
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(bytelevel_tokenizer_json()),
                                            eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.save_pretrained(folder)
    return tokenizer


def build_tiny_decoder(name: str, folder: Path, seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Save variant `name` (VARIANTS or TODAYS) with its tokenizer under `folder`; returns the fp32 HF model and
    tokenizer."""
    config_class, overrides, kind = VARIANTS[name] if name in VARIANTS else TODAYS[name]
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = save_tokenizer(kind, folder)
    eos = tokenizer.convert_tokens_to_ids("</s>" if kind == "metaspace" else "<|endoftext|>")
    bos = tokenizer.convert_tokens_to_ids("<s>") if kind == "metaspace" else eos
    config = config_class(vocab_size=len(tokenizer), bos_token_id=bos, eos_token_id=eos, **SMALL, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = eos
    model.save_pretrained(folder, safe_serialization=True)
    return model.eval(), tokenizer
