"""Two nodes of one gloo process each, as two workers start them (static rendezvous, node 0 beside the caller),
train like one process; the other node's launch ends with the run, or early when its caller says so."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.tiny_models import build_tiny_bert
from tests.unit.test_engine_training import Recorder, make_config, write_tsv
from worker.engines.training.classifier import train
from worker.engines.training.launch import LaunchFailed, Rendezvous, join_run, train_on_devices


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-nodes") / "model", seed=0, dropout=0.0)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_rendezvous_gives_torchrun_the_node_rank_and_the_heads_address():
    meet = Rendezvous(node_rank=1, nodes=3, address="head.example", port=29400, timeout_s=59.5)
    assert meet.torchrun_args() == ["--nnodes=3", "--node-rank=1", "--master-addr=head.example",
                                    "--master-port=29400", "--rdzv-backend=static", "--rdzv-conf=timeout=60"]


@pytest.mark.slow
def test_two_nodes_train_like_one_process(tmp_path, tiny_model):
    common = dict(max_steps=8, batch_size=8, learning_rate=1e-2, device="cpu")
    train_file = write_tsv(tmp_path / "train.tsv")
    one = Recorder()
    train(make_config(tmp_path / "one", tiny_model, train_file=train_file, **common), one)

    port = free_port()
    head = make_config(tmp_path / "head", tiny_model, train_file=train_file, nodes=2, **common)
    other = make_config(tmp_path / "other", tiny_model, train_file=train_file, nodes=2, **common)
    ended: list[float] = []

    def node_one() -> None:
        join_run(other, Rendezvous(node_rank=1, nodes=2, address="127.0.0.1", port=port, timeout_s=60), lambda: True)
        ended.append(time.monotonic())

    joiner = threading.Thread(target=node_one)
    joiner.start()
    recorder = Recorder()
    done = train_on_devices(head, recorder, Rendezvous(node_rank=0, nodes=2, address="127.0.0.1", port=port,
                                                       timeout_s=60))
    finished = time.monotonic()
    joiner.join(60)
    assert ended and ended[0] - finished < 10  # the other node ends with the run
    assert done.status == "completed" and recorder.info["device"] == "cpu x2"
    np.testing.assert_allclose([m["train_loss"] for _, _, m in recorder.logs],
                               [m["train_loss"] for _, _, m in one.logs], rtol=2e-3)
    assert not (tmp_path / "other" / "out").exists()  # only rank 0 saves


def test_a_node_whose_head_never_comes_fails_after_the_rendezvous_timeout(tmp_path, tiny_model):
    config = make_config(tmp_path, tiny_model, nodes=2, max_steps=2, device="cpu")
    with pytest.raises(LaunchFailed) as failed:
        join_run(config, Rendezvous(node_rank=1, nodes=2, address="127.0.0.1", port=free_port(), timeout_s=3),
                 lambda: True)
    assert failed.value.code == "node_lost"
