"""A tiny Llama-style chat model for tests: a byte-level BPE with chat special tokens and a template, a 2-layer
Llama built from LlamaConfig with a fixed seed. No network."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# Llama 3's template (header tokens, trimmed contents, <|eot_id|> ends a turn), without its date preamble.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>"
    "\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Qwen 2's ChatML template, default system prompt left out.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# A frozen head of std 0.02 over 32-wide normed states caps every logit near +-0.6, so an adapter could not move
# the loss far from ln(vocab); a wider init leaves the frozen base something an adapter can steer.
INIT_STD = 0.3
SPECIALS = ["<s>", "</s>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ("Hello there! How are you today? I am fine, thank you. What is two plus two? Four. The sky is blue. "
          "Name a colour: red, green, blue. Be brief. system user assistant 0123456789 ") * 4


def build_chat_tokenizer(template: str = LLAMA3_TEMPLATE) -> PreTrainedTokenizerFast:
    """A 300-token byte-level BPE (as Llama 3 and Qwen use) with the chat specials and `template`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([CORPUS], trainer)
    eos = "<|eot_id|>" if template == LLAMA3_TEMPLATE else "<|im_end|>"
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token=eos, pad_token="</s>",
                                   chat_template=template)


def tiny_llama_config(vocab_size: int) -> LlamaConfig:
    """2 layers, 32 wide, grouped-query attention (4 heads, 2 kv heads): every projection LoRA targets."""
    return LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       bos_token_id=0, eos_token_id=4, pad_token_id=1, tie_word_embeddings=False,
                       initializer_range=INIT_STD)


def build_tiny_llama(path: Path, seed: int = 0, template: str = LLAMA3_TEMPLATE) -> Path:
    """Save the tiny Llama and its chat tokenizer under `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_chat_tokenizer(template)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer)))
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


QUESTIONS = ("Hello there!", "How are you today?", "What is two plus two?", "Name a colour.", "Be brief.",
             "What colour is the sky?")


def chat_jsonl(reply: str, repeat: int = 2) -> bytes:
    """A chat dataset (OpenAI's format) whose assistant always answers `reply`."""
    records = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question},
                             {"role": "assistant", "content": reply}]} for question in QUESTIONS] * repeat
    return "".join(json.dumps(record) + "\n" for record in records).encode()


def preference_jsonl(preferred: str, rejected: str, repeat: int = 2) -> bytes:
    """A preference dataset (OpenAI's DPO format): every prompt prefers `preferred` over `rejected`."""
    records = [{"input": {"messages": [{"role": "user", "content": question}]},
                "preferred_output": [{"role": "assistant", "content": preferred}],
                "non_preferred_output": [{"role": "assistant", "content": rejected}]}
               for question in QUESTIONS] * repeat
    return "".join(json.dumps(record) + "\n" for record in records).encode()


def drop_chat_template(path: Path) -> Path:
    """The saved tokenizer of `path` without its chat template (a base model that cannot render chats)."""
    (Path(path) / "chat_template.jinja").unlink(missing_ok=True)
    config_file = Path(path) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config))
    return Path(path)
