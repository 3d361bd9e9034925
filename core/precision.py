"""What precision "auto" means on a device: one pure function the API (admission) and the worker (DevicePlan) share."""

from __future__ import annotations


def auto_precision(*, is_cuda: bool, bf16_supported: bool = True, cpu_bf16_faster: bool = False) -> str:
    """The precision "auto" resolves to, from the device's facts.

    On a GPU bf16 where it is native (Ampere and newer), else fp16 (older cards emulate bf16 slowly); on a
    CPU fp32, unless a calibration on that CPU showed bf16 clearly faster (only the worker can time that).
    """
    if is_cuda:
        return "bf16" if bf16_supported else "fp16"
    return "bf16" if cpu_bf16_faster else "fp32"
