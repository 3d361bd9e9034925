"""Device and precision resolution; CUDA is faked only at the torch.cuda edge."""

from __future__ import annotations

import contextlib

import pytest
import torch

from worker.engines.device import DevicePlan, release_memory, resolve_device


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
