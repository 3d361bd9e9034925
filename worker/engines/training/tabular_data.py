"""Tabular files to tokenized examples, length-grouped batch order and dynamic-padding collation."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np

from core.tabular import Value, label_space, label_values, read_table
from worker.engines.models.encoder_batches import Encoded, pack

# Batches are sorted by length inside chunks of this many batches: large enough that neighbours
# have near-equal lengths (little padding), small enough that the order stays random.
MEGA_BATCHES = 50


@dataclass(frozen=True)
class Examples:
    """Raw texts and their labels in file order, as read from one dataset file."""

    texts: list[str]
    labels: list[Value]


def read_examples(path: Path, text_column: str, label_column: str) -> Examples:
    """Read a CSV/TSV/JSONL file and return its texts and labels, checking both columns exist."""
    table = read_table(Path(path))
    for column in (text_column, label_column):
        if column not in table.columns:
            raise ValueError(
                f"{Path(path).name}: column {column!r} not found; columns are {', '.join(table.columns)}"
            )
    labels = label_values(table, label_column)
    texts: list[str] = []
    for line, (row, label) in enumerate(zip(table.rows, labels, strict=True), start=1):
        if label is None or label == "":
            raise ValueError(f"{Path(path).name}: row {line} has an empty {label_column!r}")
        text = row.get(text_column)
        texts.append("" if text is None else str(text))
    return Examples(texts=texts, labels=labels)


def build_label_map(train_labels: Sequence[Value]) -> list[int | str]:
    """The labels in id order; at least two are needed to train a classifier."""
    labels = label_space(list(train_labels))
    if len(labels) < 2:
        raise ValueError(f"training data needs at least 2 distinct labels, found {len(labels)}")
    return labels


def label_ids_for(labels: Sequence[Value], label_map: Sequence[int | str], what: str) -> list[int]:
    """Map labels to ids, refusing labels that the training data does not contain."""
    # label_space() turns every label into str when any is not an int, so look up by the same rule.
    as_text = any(isinstance(label, str) for label in label_map)
    index: dict[Value, int] = {label: i for i, label in enumerate(label_map)}
    ids: list[int] = []
    for row, label in enumerate(labels, start=1):
        key: Value = str(label) if as_text else label
        if key not in index:
            raise ValueError(f"{what} row {row}: label {label!r} does not occur in the training data")
        ids.append(index[key])
    return ids


def encode(tokenizer, texts: list[str], label_ids: list[int], max_length: int) -> Encoded:
    """Tokenize with `datasets` (batched, truncated, unpadded) and pack into an Encoded set."""

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        out = tokenizer(batch["text"], truncation=True, max_length=max_length)
        return {"input_ids": out["input_ids"]}

    dataset = datasets.Dataset.from_dict({"text": texts, "labels": label_ids})
    with _quiet_datasets():
        dataset = dataset.map(tokenize, batched=True, remove_columns=["text"])
    columns = dataset[:]
    return pack(columns["input_ids"], columns["labels"], tokenizer.pad_token_id)


def length_grouped_batches(lengths: Sequence[int] | np.ndarray, batch_size: int, seed: int,
                           epoch: int) -> list[list[int]]:
    """Batches of similar-length examples in a random order that depends only on (seed, epoch)."""
    lengths = np.asarray(lengths)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    chunk = MEGA_BATCHES * batch_size
    batches: list[list[int]] = []
    for start in range(0, len(order), chunk):
        mega = order[start:start + chunk]
        # Stable sort keeps the random order among equal lengths, so the result is reproducible.
        mega = mega[np.argsort(-lengths[mega], kind="stable")]
        batches.extend(mega[i:i + batch_size].tolist() for i in range(0, len(mega), batch_size))
    if not batches:
        return batches
    batches = [batches[i] for i in rng.permutation(len(batches))]
    # The batch holding the longest example goes first, so an out-of-memory error shows at step 1.
    longest = max(range(len(batches)), key=lambda i: int(lengths[batches[i]].max()))
    batches.insert(0, batches.pop(longest))
    return batches


def epoch_steps(lengths: np.ndarray, batch_size: int, accumulation: int, seed: int,
                epoch: int) -> list[list[list[int]]]:
    """One epoch as optimizer steps, each a list of micro-batches of example indices."""
    # Grouping by the whole step's samples makes accumulation equivalent to one large batch.
    steps = length_grouped_batches(lengths, batch_size * accumulation, seed, epoch)
    return [[step[i:i + batch_size] for i in range(0, len(step), batch_size)] for step in steps]


def steps_per_epoch(num_examples: int, batch_size: int, accumulation: int) -> int:
    """Optimizer steps in one epoch (the last step may hold fewer samples)."""
    return max(1, -(-num_examples // (batch_size * accumulation)))


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    # A worker's log should not fill with "Map: 100%" bars; restore the caller's setting after.
    was_disabled = datasets.are_progress_bars_disabled()
    if not was_disabled:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()
