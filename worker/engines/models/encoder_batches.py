"""Encoder inputs as a ragged token array, padded per batch: what training and the encoder servers both feed a model."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Encoded:
    """Tokenized examples stored as one flat token array plus offsets (a ragged array)."""

    tokens: np.ndarray  # int64, all examples' input_ids concatenated
    offsets: np.ndarray  # int64, len(examples) + 1; example i is tokens[offsets[i]:offsets[i+1]]
    label_ids: np.ndarray  # int64, one per example
    pad_id: int

    def __len__(self) -> int:
        return len(self.label_ids)

    @property
    def lengths(self) -> np.ndarray:
        """Token count of every example (after truncation)."""
        return np.diff(self.offsets)


def pack(sequences: Sequence[Sequence[int]], label_ids: Sequence[int], pad_id: int | None) -> Encoded:
    """Pack token id lists into an Encoded set (no datasets round trip: used for live requests)."""
    lengths = np.fromiter((len(seq) for seq in sequences), dtype=np.int64, count=len(sequences))
    offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.fromiter((tok for seq in sequences for tok in seq), dtype=np.int64, count=int(offsets[-1]))
    return Encoded(tokens=tokens, offsets=offsets, label_ids=np.asarray(label_ids, dtype=np.int64),
                   pad_id=0 if pad_id is None else int(pad_id))


def collate(data: Encoded, indices: Sequence[int]) -> dict[str, torch.Tensor]:
    """Pad the chosen examples to the longest of them (dynamic padding) and return model inputs."""
    starts = data.offsets[indices]
    lengths = data.offsets[np.asarray(indices) + 1] - starts
    width = int(lengths.max())
    input_ids = np.full((len(indices), width), data.pad_id, dtype=np.int64)
    attention_mask = np.zeros((len(indices), width), dtype=np.int64)
    for row, (start, length) in enumerate(zip(starts, lengths, strict=True)):
        input_ids[row, :length] = data.tokens[start:start + length]
        attention_mask[row, :length] = 1
    return {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention_mask),
        "labels": torch.from_numpy(data.label_ids[indices]),
    }


def sorted_batches(data: Encoded, batch_size: int, max_tokens: int | None = None) -> Iterator[list[int]]:
    """Batches in descending length order, for evaluation and inference (no randomness needed): at most
    `batch_size` inputs and, with `max_tokens`, at most that many padded tokens (inputs x the batch's longest; an
    input longer than that is a batch of its own)."""
    order = np.argsort(-data.lengths, kind="stable").tolist()
    start = 0
    while start < len(order):
        rows = batch_size
        if max_tokens is not None:
            rows = max(1, min(rows, max_tokens // max(int(data.lengths[order[start]]), 1)))
        yield order[start:start + rows]
        start += rows
