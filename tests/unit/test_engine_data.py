"""Reading examples, label maps, the length-grouped batch order and dynamic padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.engines.models import encoder_batches as batching
from worker.engines.training import tabular_data as data


def test_batch_order_is_a_permutation_and_deterministic():
    lengths = np.random.default_rng(0).integers(3, 60, size=1003)
    batches = data.length_grouped_batches(lengths, batch_size=16, seed=7, epoch=0)
    flat = [i for batch in batches for i in batch]
    assert sorted(flat) == list(range(len(lengths)))
    assert all(len(batch) <= 16 for batch in batches)
    assert sum(len(batch) < 16 for batch in batches) <= 2  # only mega-chunk tails are short
    assert batches == data.length_grouped_batches(lengths, batch_size=16, seed=7, epoch=0)
    assert batches != data.length_grouped_batches(lengths, batch_size=16, seed=7, epoch=1)
    assert batches != data.length_grouped_batches(lengths, batch_size=16, seed=8, epoch=0)


def test_batch_order_groups_lengths_and_puts_the_longest_first():
    lengths = np.random.default_rng(1).integers(3, 60, size=2000)
    batches = data.length_grouped_batches(lengths, batch_size=32, seed=0, epoch=0)
    assert int(lengths[batches[0]].max()) == int(lengths.max())
    padded = sum(int(lengths[b].max()) * len(b) for b in batches)
    random_order = np.random.default_rng(2).permutation(len(lengths))
    random_padded = sum(int(lengths[random_order[i:i + 32]].max()) * len(random_order[i:i + 32])
                        for i in range(0, len(lengths), 32))
    assert padded < 0.7 * random_padded


def test_epoch_steps_split_each_step_into_micro_batches():
    lengths = np.arange(1, 22)
    steps = data.epoch_steps(lengths, batch_size=4, accumulation=2, seed=0, epoch=0)
    assert len(steps) == data.steps_per_epoch(21, 4, 2) == 3
    assert all(len(mb) <= 4 for step in steps for mb in step)
    assert sorted(i for step in steps for mb in step for i in mb) == list(range(21))
    # Grouping per step makes the step's samples those of one batch of batch_size * accumulation.
    whole = data.length_grouped_batches(lengths, batch_size=8, seed=0, epoch=0)
    assert [[i for mb in step for i in mb] for step in steps] == whole


def test_collate_pads_to_the_longest_in_the_batch():
    encoded = batching.pack([[101, 5, 102], [101, 102], [101, 7, 8, 9, 102]], [1, 0, 1], pad_id=0)
    batch = batching.collate(encoded, [1, 0])
    assert batch["input_ids"].tolist() == [[101, 102, 0], [101, 5, 102]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch["labels"].tolist() == [0, 1]
    assert batch["input_ids"].dtype == torch.long
    assert encoded.lengths.tolist() == [3, 2, 5]
    assert [b for b in batching.sorted_batches(encoded, 2)] == [[2, 0], [1]]


def test_inference_batches_are_bounded_in_padded_tokens_as_well_as_inputs():
    lengths = [40, 3, 9, 12, 3, 70, 8]
    encoded = batching.pack([[1] * n for n in lengths], [0] * len(lengths), pad_id=0)
    batches = list(batching.sorted_batches(encoded, 4, max_tokens=24))
    # Longest first; an input over the bound alone; then as many as fit under 24 padded tokens, at most 4.
    assert batches == [[5], [0], [3, 2], [6, 1, 4]]
    assert all(len(b) * max(lengths[i] for i in b) <= 24 or len(b) == 1 for b in batches)
    assert list(batching.sorted_batches(encoded, 4)) == [[5, 0, 3, 2], [6, 1, 4]]  # no bound: inputs only


def test_read_examples_and_label_maps(tmp_path):
    path = tmp_path / "rows.tsv"
    path.write_text("sentence\tlabel\nfine film \t1\nbad film \t0\nok film \t1\n")
    examples = data.read_examples(path, "sentence", "label")
    assert examples.texts == ["fine film", "bad film", "ok film"]
    assert examples.labels == [1, 0, 1]
    labels = data.build_label_map(examples.labels)
    assert labels == [0, 1]
    assert data.label_ids_for(examples.labels, labels, "train") == [1, 0, 1]
    with pytest.raises(ValueError, match="does not occur"):
        data.label_ids_for([2], labels, "eval")
    with pytest.raises(ValueError, match="column 'text' not found"):
        data.read_examples(path, "text", "label")


def test_string_labels_and_single_label_data(tmp_path):
    assert data.build_label_map(["pos", "neg", "pos"]) == ["neg", "pos"]
    with pytest.raises(ValueError, match="at least 2 distinct labels"):
        data.build_label_map(["pos", "pos"])


def test_encode_truncates_without_padding():
    class Tokenizer:  # the slice of the tokenizer interface that encode() uses
        pad_token_id = 0

        def __call__(self, texts, truncation, max_length):
            return {"input_ids": [list(range(1, len(t.split()) + 1))[:max_length] for t in texts]}

    encoded = data.encode(Tokenizer(), ["a b c d e", "a b"], [1, 0], max_length=4)
    assert encoded.lengths.tolist() == [4, 2]
    assert encoded.label_ids.tolist() == [1, 0]
