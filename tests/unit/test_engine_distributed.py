"""Two gloo processes under torchrun train as one job: one process's steps and losses, one history, exact resume."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.tiny_models import build_tiny_bert
from tests.unit.test_engine_training import Recorder, make_config, write_tsv
from worker.engines.distributed import Dist, shard
from worker.engines.launch import train_on_devices
from worker.engines.training import train


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    # No dropout: one process and two then see the same function, so their losses can be compared step by step.
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-ddp") / "model", seed=0, dropout=0.0)


def test_shard_deals_every_micro_batch_out_so_shares_keep_its_length_group():
    step = [[5, 9, 2, 7, 1], [3, 8, 4]]  # two length-grouped micro-batches of one step
    shares = [shard(step, Dist(rank=r, local_rank=r, world_size=2)) for r in range(2)]
    assert shares == [[[5, 2, 1], [3, 4]], [[9, 7], [8]]]
    assert sorted(i for share in shares for part in share for i in part) == sorted(i for m in step for i in m)
    blocks = [np.arange(3)]  # causal-LM micro-batches are arrays; a rank left without examples gets no part
    assert [len(shard(blocks, Dist(rank=r, local_rank=r, world_size=4))) for r in range(4)] == [1, 1, 1, 0]


@pytest.mark.slow
def test_two_processes_train_like_one_and_resume_as_one_job(tmp_path, tiny_model):
    # 36 rows in micro-batches of 8 with accumulation 2: steps of 16, 16 and a short last one of 4 examples.
    common = dict(epochs=2, batch_size=8, gradient_accumulation_steps=2, checkpoint_steps=None, device="cpu")
    train_file = write_tsv(tmp_path / "train.tsv")
    rows = train_file.read_text().splitlines()
    train_file.write_text("\n".join(rows + rows[1:5]) + "\n")
    one = Recorder()
    single = train(make_config(tmp_path / "one", tiny_model, train_file=train_file, **common), one)

    config = make_config(tmp_path / "two", tiny_model, train_file=train_file, devices=2, **common)
    first = Recorder(stop_at=2)  # cancelled after step 2: rank 0 checkpoints, every rank stops
    stopped = train_on_devices(config, first)
    assert (stopped.status, stopped.global_step) == ("cancelled", 2)
    assert first.info["world_size"] == 2 and first.info["device"] == "cpu x2"
    assert [step for step, _ in first.checkpoints] == [2]
    second = Recorder()
    done = train_on_devices(config, second)

    assert done.status == "completed" and second.info["resumed_from_step"] == 2
    assert done.total_steps == single.total_steps == 6  # the same optimizer steps as one process
    history = first.logs + second.logs  # one history across the two launches: every step once
    assert [step for step, _, _ in history] == list(range(1, single.total_steps + 1))
    # Same global batch, gradient and schedule: the losses follow one process's (float noise apart).
    np.testing.assert_allclose([m["train_loss"] for _, _, m in history],
                               [m["train_loss"] for _, _, m in one.logs], rtol=2e-3)
    assert abs(done.metrics["eval_accuracy"] - single.metrics["eval_accuracy"]) <= 1 / 8
    assert done.metrics["eval_accuracy"] >= 0.75
    assert done.manifest["hyperparameters"]["world_size"] == 2
    assert (done.model_dir / "model.safetensors").is_file()  # rank 0 saved the one model

    with pytest.raises(ValueError, match="same number of devices"):  # its checkpoint is from two processes
        train(make_config(tmp_path / "two", tiny_model, train_file=train_file, **common))
