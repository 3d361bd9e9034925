"""The machine line of a bench/results file (the CPU, its cores, its vector extensions and the library versions) and
the commit it measured."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# The code each script's records measure (a record's `measures`): a later commit that changes one of these paths
# marks the record stale on the results page (trainserve/docs_reference.py).
_GENERATION = ["worker/engines/generation", "worker/engines/models", "worker/engines/serving.py"]
_HTTP = ["app/services/chat.py", "app/services/completions.py", "app/services/generation.py",
         "app/services/inference.py", "worker/servers"]
_TRAINING = ["worker/engines/models", "worker/engines/training"]
MEASURES = {
    "bench/batch.py": ["app/services/batches.py", "worker/batches", "worker/engines/encoders", *_GENERATION, *_HTTP],
    "bench/general_runner.py": _GENERATION,
    "bench/guidellm_load.py": [*_GENERATION, *_HTTP, "worker/engines/vllm", "bench/peers.py"],
    "bench/paged_memory.py": _GENERATION,
    "bench/peers.py": [*_GENERATION, *_HTTP, "worker/engines/vllm"],
    "bench/speculative.py": _GENERATION,
    "bench/training_memory.py": [*_TRAINING, "core/estimate.py"],
    "bench/trl_compare.py": _TRAINING,
    "bench/vllm_cpu_settings.py": ["worker/engines/vllm"],
}


def provenance(script: str) -> dict[str, str | list[str]]:
    """A record's `commit` and `measures` (the script itself and the code it drives)."""
    return {"commit": commit(), "measures": sorted({script, *MEASURES[script]})}


def commit() -> str:
    """The checkout's commit (`git rev-parse --short=9 HEAD`): a record's `commit`, the code it measured."""
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=9", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def describe() -> str:
    """E.g. "2-core AMD EPYC (family 23 model 1, AVX2 only), torch 2.13.0+cpu, transformers 4.57.6": the family and
    model numbers tell apart generations that a virtual machine's model name hides (Zen 1 runs AVX2 at half the
    width of Zen 3)."""
    import torch
    import transformers

    cpu, flags, generation = platform.processor() or platform.machine(), set(), ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        lines = cpuinfo.read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), cpu)
        flags = next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())
        numbers = {key: next((line.split(":", 1)[1].strip() for line in lines if line.split(":")[0].strip() == key), "")
                   for key in ("cpu family", "model")}
        if all(numbers.values()):
            generation = f"family {numbers['cpu family']} model {numbers['model']}, "
    vector = ("AVX-512" + (", bf16" if "avx512_bf16" in flags else "")) if "avx512f" in flags else \
        "AVX2 only" if "avx2" in flags else ""
    details = f"{generation}{vector}".rstrip(", ")
    return (f"{os.cpu_count()}-core {cpu}{f' ({details})' if details else ''}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}")
