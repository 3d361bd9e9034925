"""A served model's tokenizer, and a chat rendered to prompt ids through the model's own template."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from transformers import GPT2Tokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from core.paths import GPT2_TOKENIZER_DIR
from worker.engines.generation.runners.gpt2_weights import model_type, resolve_folder
from worker.engines.generation.sampling.grammar_vocab import with_plain_byte_tokens

_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer_config.json")
def load_tokenizer(model: str | Path) -> PreTrainedTokenizerBase:
    """The checkpoint's own fast tokenizer, or the bundled GPT-2 BPE when its folder has no tokenizer files."""
    # Concrete classes, not AutoTokenizer: the auto class imports HF's modeling code (see gpt2_weights).
    folder = resolve_folder(model)
    kind = model_type(folder)
    if kind != "gpt2":  # Llama, Mistral, Qwen: whatever their tokenizer.json says
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"{model}: no tokenizer.json; a {kind} model is served with the fast tokenizer it ships")
        return with_plain_byte_tokens(PreTrainedTokenizerFast.from_pretrained(folder))
    if not any((folder / name).exists() for name in _TOKENIZER_FILES):
        return GPT2Tokenizer.from_pretrained(GPT2_TOKENIZER_DIR)
    return GPT2Tokenizer.from_pretrained(folder)


class NoChatTemplate(ValueError):
    """The model's tokenizer has no chat template."""


def chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
             tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> list[int]:
    """Prompt ids of a chat through the tokenizer's own chat template, with the assistant's turn opened.

    `tools` and `template_kwargs` (enable_thinking) go to the template. Raises NoChatTemplate when it has none;
    a template's own raise_exception propagates.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplate("this model has no chat template; use /v1/completions")
    ids = tokenizer.apply_chat_template(messages, tools=cast(Any, tools), add_generation_prompt=True, tokenize=True,
                                        return_dict=False,
                                        **template_kwargs)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


