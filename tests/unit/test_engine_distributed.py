"""Two gloo processes under torchrun train as one job (whole replicas or sharded): one process's steps and losses,
one history, exact resume."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.tiny_models import build_tiny_bert
from tests.unit.test_engine_training import Recorder, make_config, write_tsv
from worker.engines.training.classifier import train
from worker.engines.training.distributed import Dist, shard, step_share
from worker.engines.training.launch import train_on_devices


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


def test_step_shares_weigh_examples_so_the_ranks_sum_to_the_step_mean():
    step = [[5, 9, 2, 7, 1], [3, 8, 4]]
    ranks = [step_share(step, Dist(rank=r, local_rank=r, world_size=3)) for r in range(3)]
    assert ranks[0] == ([[5, 7], [3]], [2 / 8, 1 / 8])
    assert sum(w for _, weights in ranks for w in weights) == pytest.approx(1.0)
    # A one-example step on two ranks: rank 1 still runs (and all-reduces) one example, at weight zero.
    assert step_share([[6]], Dist(rank=1, local_rank=1, world_size=2)) == ([[6]], [0.0])


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_two_processes_train_like_one_and_resume_as_one_job(tmp_path, tiny_model, sharding):
    # 32 rows, steps of two micro-batches of 4 (the ranks accumulate without syncing, then all-reduce once).
    common = dict(epochs=10, batch_size=4, gradient_accumulation_steps=2, learning_rate=1e-2, device="cpu")
    train_file = write_tsv(tmp_path / "train.tsv")
    one = Recorder()
    single = train(make_config(tmp_path / "one", tiny_model, train_file=train_file, **common), one)

    config = make_config(tmp_path / "two", tiny_model, train_file=train_file, devices=2, sharding=sharding, **common)
    first = Recorder(stop_at=12)  # cancelled after step 12: rank 0 checkpoints, every rank stops
    stopped = train_on_devices(config, first)
    assert (stopped.status, stopped.global_step) == ("cancelled", 12)
    assert first.info["world_size"] == 2 and first.info["device"] == "cpu x2"
    assert [step for step, _ in first.checkpoints] == [12]
    second = Recorder()
    done = train_on_devices(config, second)

    assert done.status == "completed" and second.info["resumed_from_step"] == 12
    assert done.total_steps == single.total_steps == 40  # the same optimizer steps as one process
    history = first.logs + second.logs  # one history across the two launches: every step once
    assert [step for step, _, _ in history] == list(range(1, single.total_steps + 1))
    # Same global batch, gradient and schedule: the losses follow one process's (float noise apart).
    np.testing.assert_allclose([m["train_loss"] for _, _, m in history],
                               [m["train_loss"] for _, _, m in one.logs], rtol=2e-3)
    assert abs(done.metrics["eval_accuracy"] - single.metrics["eval_accuracy"]) <= 1 / 8
    assert done.metrics["eval_accuracy"] == single.metrics["eval_accuracy"] == 1.0
    assert done.manifest["hyperparameters"]["world_size"] == 2
    assert done.manifest["hyperparameters"]["sharding"] == sharding and first.info["sharded"] == (sharding == "fsdp")
    assert (done.model_dir / "model.safetensors").is_file()  # rank 0 saved the one model

    with pytest.raises(ValueError, match="same number of devices"):  # its checkpoint is from two processes
        train(make_config(tmp_path / "two", tiny_model, train_file=train_file, **common))
