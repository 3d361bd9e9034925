"""The machine line of a bench/results file: the CPU, its cores, its vector extensions and the library versions."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def describe() -> str:
    """E.g. "2-core AMD EPYC (AVX-512, bf16), torch 2.13.0+cpu, transformers 4.57.6"."""
    import torch
    import transformers

    cpu, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        lines = cpuinfo.read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), cpu)
        flags = next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())
    vector = ("AVX-512" + (", bf16" if "avx512_bf16" in flags else "")) if "avx512f" in flags else \
        "AVX2 only" if "avx2" in flags else ""
    return (f"{os.cpu_count()}-core {cpu}{f' ({vector})' if vector else ''}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}")
