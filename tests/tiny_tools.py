"""Tiny random chat models with each tool-calling family's template (Qwen 2.5 / Hermes, Llama 3.1 JSON, Mistral
[TOOL_CALLS]) and a Qwen 3-style thinking template, built offline from configs with a fixed seed."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tests.tiny_chat import CORPUS, LLAMA3_TEMPLATE, SPECIALS, build_chat_tokenizer, tiny_llama_config

# Qwen 2.5's own template (its default system prompt shortened).
QWEN25 = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}"
    "{%- endif %}{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Qwen 3's: Qwen 2.5's with the thinking switch in the generation prompt.
QWEN3 = QWEN25.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and "
    "enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
# Llama 3.1's JSON tool calling (tools in the system turn, one call per turn, results as ipython).
LLAMA31 = (
    "{{- bos_token }}{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n"
    "Respond with JSON for a function call, in the format {\"name\": function name, \"parameters\": dictionary of "
    "argument name and its value}.\\n\\n' }}{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}"
    "{%- endfor %}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'assistant' and message.tool_calls %}"
    "{%- set tc = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + tc.name + '\", \"parameters\": ' }}"
    "{{- tc.arguments | tojson }}{{- '}<|eot_id|>' }}"
    "{%- elif message.role == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + "
    "message.content + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + "
    "'<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
# Mistral v0.3's: tools before the last user message, calls as a list after the [TOOL_CALLS] control token.
MISTRAL = (
    "{{- bos_token }}{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}"
    "{%- if tools and loop.index0 == ns.last %}"
    "{{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST] ' + message.content + '[/INST]' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}{{- '[TOOL_CALLS] [' }}"
    "{%- for tc in message.tool_calls %}{{- '{\"name\": \"' + tc.function.name + '\", \"arguments\": ' + "
    "tc.function.arguments | tojson + '}' }}{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}"
    "{{- ']' + eos_token }}"
    "{%- elif message.role == 'assistant' %}{{- ' ' + message.content + eos_token }}"
    "{%- elif message.role == 'tool' %}{{- '[TOOL_RESULTS] {\"content\": ' + message.content | tojson + "
    "'}[/TOOL_RESULTS]' }}{%- endif %}{%- endfor %}")
TEMPLATES = {"qwen25": QWEN25, "llama31": LLAMA31, "mistral": MISTRAL, "qwen3": QWEN3}

# Two tools and questions each answered by a call of one: a dataset a tiny model learns in a few dozen steps.
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
       "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Sum of two numbers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASKS = [(f"What is the weather in {city}?", "get_weather", {"city": city}) for city in ("Paris", "Rome", "Oslo")] + [
    (f"Add {a} and {b}.", "add", {"a": a, "b": b}) for a, b in ((2, 3), (4, 1), (7, 5))]


def tool_conversation(question: str, name: str, arguments: dict) -> dict:
    """One tool-call conversation in OpenAI's fine-tuning format: the question, then the assistant's call."""
    call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
    return {"tools": TOOLS, "messages": [{"role": "user", "content": question},
                                         {"role": "assistant", "content": None, "tool_calls": [call]}]}


def tool_tokenizer(template: str, corpus: str, vocab_size: int = 700) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on `corpus` (say, rendered tool conversations, so their prompts stay short) with
    the chat specials, Qwen's call markers as added tokens and `template`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([CORPUS, corpus], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="<|im_end|>",
                                   pad_token="</s>", chat_template=template)
    fast.add_tokens(["<tool_call>", "</tool_call>"])
    return fast


def build_tool_base(folder: Path, conversations: list[dict], seed: int = 1, hidden_size: int = 64) -> Path:
    """A tiny Qwen2 with Qwen 2.5's tool template whose BPE was trained on `conversations` ({"tools", "messages"},
    OpenAI's format) rendered by that template, so their prompts stay short (a few hundred tokens). 4 heads of
    hidden_size / 4 (vLLM's CPU attention takes heads of 32 and up: hidden_size 128)."""
    from core.tool_calls import template_messages

    renderer = build_chat_tokenizer(QWEN25)
    texts = [renderer.apply_chat_template(template_messages(c["messages"]), tools=c.get("tools"), tokenize=False)
             for c in conversations]
    return build_tiny_qwen2(folder, tool_tokenizer(QWEN25, "\n".join(texts * 4)), seed=seed, hidden_size=hidden_size)


def build_tiny_qwen2(folder: Path, tokenizer: PreTrainedTokenizerFast, seed: int = 0, hidden_size: int = 64) -> Path:
    """A 2-layer Qwen2 (q/k/v biases, grouped-query attention) over `tokenizer`, saved with it under `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, initializer_range=0.3)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def build_tool_model(folder: Path, name: str, seed: int = 0) -> Path:
    """A random tiny model whose tokenizer carries family `name`'s template and markers (Qwen's as added tokens,
    Mistral's [TOOL_CALLS] as a special one); Qwen 3's is a Qwen3 decoder, the others a Llama. `name` "plain": Llama
    3's template without a tool section and no markers (as SmolLM2's: the default tool prompt, `<tool_call>` text)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_chat_tokenizer(TEMPLATES.get(name, LLAMA3_TEMPLATE))
    if name == "llama31":
        tokenizer.eos_token = "<|eot_id|>"
    if name != "plain":
        tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<think>", "</think>"])
        tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    if name == "mistral":
        tokenizer.eos_token = "</s>"
    torch.manual_seed(seed)
    config = tiny_llama_config(len(tokenizer))
    config.eos_token_id = tokenizer.eos_token_id
    if name == "qwen3":
        qwen = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=2048,
                           bos_token_id=0, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
                           initializer_range=0.3)
        Qwen3ForCausalLM(qwen).save_pretrained(folder, safe_serialization=True)
    else:
        config.max_position_embeddings = 2048
        LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def grammar_accepts(tokenizer: PreTrainedTokenizerFast, grammar: str, text: str) -> bool:
    """Whether llguidance's matcher of a Lark `grammar` takes `text`'s tokens and may end there."""
    import llguidance
    import llguidance.hf

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[tokenizer.eos_token_id])
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting() \
        and not matcher.is_error()
