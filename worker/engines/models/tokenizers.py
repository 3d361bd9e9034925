"""A model folder's tokenizer, read as its tokenizer.json says: the one definition training and serving share.

transformers 5's AutoTokenizer builds a model type's own tokenizer class, which may rebuild the pipeline (a Qwen2
tokenizer splits text with Qwen's pattern whatever the folder's tokenizer.json holds); a model trained on one
tokenization and served with another answers wrongly. So where a folder ships tokenizer.json, both sides load exactly
that file (PreTrainedTokenizerFast), special tokens and chat template from tokenizer_config.json; elsewhere
(vocab files only, a hub id) AutoTokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer_files(source: str | Path, **kwargs: Any) -> Any:
    """The tokenizer of a model folder (its tokenizer.json when it has one) or of a hub id."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = Path(source)
    if (folder / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(folder, **kwargs)
    return AutoTokenizer.from_pretrained(str(source), **kwargs)
