"""`trainserve worker --device/--devices`: what a worker owns, and which training queues it consumes."""

from __future__ import annotations

import pytest

from core.tasks import train_queue, train_queues
from trainserve.cli import worker_devices


@pytest.mark.parametrize(("device", "devices", "expected"), [
    ("cuda:0,cuda:1", None, ("cuda:0", 2, "0,1")),  # two GPUs, seen inside the worker as cuda:0 and cuda:1
    ("cuda:3", None, ("cuda:0", 1, "3")),
    ("cpu", 2, ("cpu", 2, "")),  # two gloo processes per job, no GPU visible
    ("cpu", None, ("cpu", 1, "")),
    ("auto", None, ("auto", 1, None)),
    ("auto", 2, ("auto", 2, "0,1")),
])
def test_worker_devices(device, devices, expected):
    assert worker_devices(device, devices) == expected


@pytest.mark.parametrize(("device", "devices"), [("cuda:0,cuda:1", 3), ("cpu,cuda:0", None), ("tpu", None),
                                                 ("cpu", 0), ("cuda:x", None)])
def test_inconsistent_device_options_are_refused(device, devices):
    with pytest.raises(ValueError, match="--device"):
        worker_devices(device, devices)


def test_a_worker_owning_n_devices_consumes_every_job_size_up_to_n():
    assert train_queue(1) == "training" and train_queue(4) == "training.4"
    assert train_queues(3) == ["training", "training.2", "training.3"]
