"""Device and precision resolution; CUDA is faked only at the torch.cuda edge."""

from __future__ import annotations

import contextlib

import pytest
import torch

from worker.engines import device as device_module
from worker.engines.device import DevicePlan, cpu_bf16_faster, release_memory, resolve_device


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend two CUDA devices exist with the given compute capability."""

    def install(capability: tuple[int, int] = (9, 0), count: int = 2) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    return install


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_auto_on_cpu_is_fp32_without_autocast(no_cuda):
    plan = resolve_device()
    assert plan == DevicePlan(device="cpu", precision="fp32", autocast_dtype=None, use_grad_scaler=False)
    assert isinstance(plan.autocast(), contextlib.nullcontext)
    assert not plan.grad_scaler().is_enabled()


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "CUDA:1"])
def test_explicit_cuda_without_cuda_is_a_clear_error(no_cuda, device):
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device(device)


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "tpu", ""])
def test_unknown_device_is_rejected(device):
    with pytest.raises(ValueError, match="invalid device"):
        resolve_device(device)


def test_unknown_precision_is_rejected():
    with pytest.raises(ValueError, match="unknown precision"):
        resolve_device("cpu", "fp8")


def test_auto_prefers_bf16_on_ampere_or_newer(fake_cuda):
    fake_cuda((9, 0))
    plan = resolve_device()
    assert (plan.device, plan.precision, plan.autocast_dtype, plan.use_grad_scaler) == (
        "cuda:0", "bf16", torch.bfloat16, False)
    assert plan.is_cuda and plan.device_type == "cuda"


def test_auto_falls_back_to_fp16_with_scaler_on_older_cards(fake_cuda):
    fake_cuda((7, 5))
    plan = resolve_device("cuda")
    assert (plan.device, plan.precision, plan.autocast_dtype, plan.use_grad_scaler) == (
        "cuda:0", "fp16", torch.float16, True)


def test_explicit_bf16_on_a_card_without_it_is_refused(fake_cuda):
    fake_cuda((7, 0))
    with pytest.raises(ValueError, match="bf16"):
        resolve_device("cuda:0", "bf16")


def test_cuda_index_is_checked_against_device_count(fake_cuda):
    fake_cuda(count=2)
    assert resolve_device("cuda:1", "fp32").device == "cuda:1"
    with pytest.raises(ValueError, match="only 2 CUDA device"):
        resolve_device("cuda:2")


def test_fp32_on_cuda_has_no_autocast_or_scaler(fake_cuda):
    fake_cuda()
    plan = resolve_device("cuda:0", "fp32")
    assert plan.autocast_dtype is None and not plan.use_grad_scaler


@pytest.mark.parametrize(("precision", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_half_precision_on_cpu_means_cpu_autocast_without_scaler(precision, dtype):
    plan = resolve_device("cpu", precision)
    assert plan.autocast_dtype == dtype and not plan.use_grad_scaler
    with plan.autocast():
        product = torch.ones(2, 2) @ torch.ones(2, 2)
    assert product.dtype == dtype


def test_release_memory_on_cpu_is_harmless():
    release_memory(resolve_device("cpu"))


@pytest.fixture
def fresh_calibration(monkeypatch):
    """An empty per-process calibration cache, and fake timers (training's by default) that log their calls."""
    monkeypatch.setattr(device_module, "_cpu_bf16_calibration", {})
    calls: list[str] = []

    def install(fp32_seconds: float, bf16_seconds: float, timer: str = "_time_cpu_matmuls") -> list:
        def timings() -> tuple[float, float]:
            calls.append(timer)
            return fp32_seconds, bf16_seconds

        monkeypatch.setattr(device_module, timer, timings)
        return calls

    return install


def test_auto_training_on_a_cpu_with_fast_bf16_picks_bf16_autocast(no_cuda, fresh_calibration):
    calls = fresh_calibration(fp32_seconds=2e-3, bf16_seconds=0.5e-3)
    plan = resolve_device("cpu", "auto", training=True)
    assert (plan.precision, plan.autocast_dtype, plan.use_grad_scaler) == ("bf16", torch.bfloat16, False)
    assert resolve_device("auto", "auto", training=True).precision == "bf16"
    assert len(calls) == 1  # calibrated once per process, then cached
    # Inference keeps fp32 on a CPU whatever the calibration says; explicit choices are never overridden.
    assert resolve_device("cpu", "auto").precision == "fp32"
    assert resolve_device("cpu", "fp32", training=True).precision == "fp32"
    assert len(calls) == 1


@pytest.mark.parametrize("bf16_seconds", [2e-3, 1.5e-3, 0.3])  # equal, 1.33x faster, emulated (slow)
def test_auto_training_stays_fp32_when_bf16_is_not_clearly_faster(no_cuda, fresh_calibration, bf16_seconds):
    fresh_calibration(fp32_seconds=2e-3, bf16_seconds=bf16_seconds)
    plan = resolve_device("cpu", "auto", training=True)
    assert plan == DevicePlan(device="cpu", precision="fp32", autocast_dtype=None, use_grad_scaler=False)


def test_auto_generation_on_a_cpu_with_fast_bf16_picks_bf16_weights(no_cuda, fresh_calibration):
    calls = fresh_calibration(fp32_seconds=6e-3, bf16_seconds=3e-3, timer="_time_cpu_decode")
    fresh_calibration(fp32_seconds=1.0, bf16_seconds=1.0)  # training: bf16 no faster
    plan = resolve_device("cpu", "auto", generation=True)
    # Generation casts the weights (no autocast context needed at run time, but the plan names the dtype).
    assert (plan.precision, plan.autocast_dtype, plan.use_grad_scaler) == ("bf16", torch.bfloat16, False)
    assert resolve_device("auto", "auto", generation=True).precision == "bf16"
    assert calls == ["_time_cpu_decode"]  # calibrated once per process, then cached
    # Each workload has its own calibration and answer; classification and explicit choices stay as they are.
    assert resolve_device("cpu", "auto", training=True).precision == "fp32"
    assert resolve_device("cpu", "auto").precision == "fp32"
    assert resolve_device("cpu", "fp32", generation=True).precision == "fp32"
    assert calls == ["_time_cpu_decode", "_time_cpu_matmuls"]


@pytest.mark.parametrize("bf16_seconds", [6e-3, 5e-3, 0.3])  # equal, 1.2x faster, emulated (slow)
def test_auto_generation_stays_fp32_when_bf16_is_not_clearly_faster(no_cuda, fresh_calibration, bf16_seconds):
    fresh_calibration(fp32_seconds=6e-3, bf16_seconds=bf16_seconds, timer="_time_cpu_decode")
    assert resolve_device("cpu", "auto", generation=True).precision == "fp32"
    assert resolve_device("cpu", "bf16", generation=True).precision == "bf16"  # explicit wins


def test_auto_generation_on_cuda_does_not_calibrate(fake_cuda, fresh_calibration):
    calls = fresh_calibration(fp32_seconds=1.0, bf16_seconds=1.0, timer="_time_cpu_decode")
    fake_cuda((8, 0))
    assert resolve_device("cuda", "auto", generation=True).precision == "bf16"
    assert calls == []


def test_decode_calibration_threshold_and_real_calibration_is_cheap():
    assert cpu_bf16_faster(lambda: (1.3, 1.0), workload="generation")
    assert not cpu_bf16_faster(lambda: (1.29, 1.0), workload="generation")
    assert not cpu_bf16_faster(lambda: (1.3, 1.0), workload="training")  # training asks for 1.5x
    with pytest.raises(ValueError, match="unknown workload"):
        cpu_bf16_faster(lambda: (1.0, 1.0), workload="classify")
    fp32_seconds, bf16_seconds = device_module._time_cpu_decode(rounds=2)
    assert 0 < fp32_seconds < 1 and 0 < bf16_seconds < 5


def test_cpu_bf16_faster_threshold_and_real_calibration_is_cheap():
    assert cpu_bf16_faster(lambda: (1.5, 1.0)) and not cpu_bf16_faster(lambda: (1.49, 1.0))
    fp32_seconds, bf16_seconds = device_module._time_cpu_matmuls(rounds=2)
    assert 0 < fp32_seconds < 1 and 0 < bf16_seconds < 5
