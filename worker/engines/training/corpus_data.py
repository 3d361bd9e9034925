"""A text corpus as one token stream, cut into fixed-length blocks with a seeded order (as in nanoGPT)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from core.errors import DomainError
from core.tabular import read_table

TEXT_SUFFIXES = (".txt",)
_ENCODE_CHUNK = 1024  # documents per tokenizer call: batched for speed, bounded for memory


@dataclass(frozen=True)
class Blocks:
    """Windows of block_size + 1 tokens over one token stream; window i starts at token i * block_size."""

    # Consecutive windows share their seam token (the last target of one is the first input of the
    # next), so every token after the first is predicted exactly once and no text is thrown away.
    tokens: np.ndarray  # int32 (every vocabulary in use fits), widened to int64 per batch
    block_size: int

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.block_size)

    @property
    def num_tokens(self) -> int:
        """Tokens that are predicted (targets) across all blocks."""
        return len(self) * self.block_size

    def batch(self, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets of the chosen blocks, each (len(indices), block_size)."""
        starts = np.asarray(indices, dtype=np.int64) * self.block_size
        windows = self.tokens[starts[:, None] + np.arange(self.block_size + 1)]
        windows = torch.from_numpy(windows.astype(np.int64))
        return windows[:, :-1], windows[:, 1:]


def read_documents(path: Path, text_column: str) -> list[str]:
    """A .txt file is one document; a CSV/TSV/JSONL file gives one document per non-empty row."""
    path = Path(path)
    if path.suffix.lower() in TEXT_SUFFIXES:
        try:
            text = path.read_bytes().decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path.name} is not valid UTF-8 (byte {exc.start})") from exc
        return [text] if text.strip() else []
    try:
        table = read_table(path)
    except DomainError as exc:  # the engine's contract is ValueError for bad input
        raise ValueError(f"{path.name}: {exc.message}") from exc
    if text_column not in table.columns:
        raise ValueError(f"{path.name}: column {text_column!r} not found; columns are {', '.join(table.columns)}")
    texts = (row.get(text_column) for row in table.rows)
    return [str(text) for text in texts if text is not None and str(text).strip()]


def tokenize(tokenizer, documents: list[str]) -> np.ndarray:
    """All documents as one token stream, with the tokenizer's eos after each when there are several."""
    if not documents:
        return np.zeros(0, dtype=np.int32)
    # No special tokens: a BOS/EOS added per call would land mid-stream for some tokenizers.
    # verbose=False silences the "longer than model_max_length" warning; blocks are cut below.
    if len(documents) == 1:
        ids = tokenizer(documents[0], add_special_tokens=False, verbose=False)["input_ids"]
        return np.asarray(ids, dtype=np.int32)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos token to separate the documents (rows) of the corpus")
    parts: list[np.ndarray] = []
    for start in range(0, len(documents), _ENCODE_CHUNK):
        encoded = tokenizer(documents[start:start + _ENCODE_CHUNK], add_special_tokens=False,
                            verbose=False)["input_ids"]
        for ids in encoded:
            parts.append(np.asarray(ids + [eos], dtype=np.int32))
    return np.concatenate(parts)


def split_blocks(tokens: np.ndarray, block_size: int, val_fraction: float) -> tuple[Blocks, Blocks]:
    """Train blocks from the first 1 - val_fraction of the stream, validation blocks from the rest."""
    # Splitting the stream before cutting blocks keeps every validation token out of training.
    cut = int(round(len(tokens) * (1.0 - val_fraction)))
    return Blocks(tokens[:cut], block_size), Blocks(tokens[cut:], block_size)


def require_blocks(blocks: Blocks, what: str, hint: str) -> None:
    """Refuse a split that is too short for even one block of block_size + 1 tokens."""
    if len(blocks) == 0:
        raise ValueError(f"the {what} has {len(blocks.tokens)} tokens, too few for one block of "
                         f"{blocks.block_size} + 1 tokens; {hint}")


def epoch_steps(num_blocks: int, batch_size: int, accumulation: int, seed: int,
                epoch: int) -> list[list[np.ndarray]]:
    """One epoch as optimizer steps, each a list of micro-batches of block indices."""
    # A pure function of (seed, epoch): a resumed run rebuilds the same order and skips what it did.
    order = np.random.default_rng([seed, epoch]).permutation(num_blocks)
    per_step = batch_size * accumulation
    steps = [order[i:i + per_step] for i in range(0, num_blocks, per_step)]
    return [[step[i:i + batch_size] for i in range(0, len(step), batch_size)] for step in steps]


def eval_indices(num_blocks: int, limit: int) -> np.ndarray:
    """All validation blocks, or `limit` of them evenly spaced, so evaluation cost stays bounded."""
    if num_blocks <= limit:
        return np.arange(num_blocks)
    return np.arange(limit, dtype=np.int64) * num_blocks // limit
