"""Decode attention read in place from the paged cache's blocks: a small C++ kernel (paged_attention.cpp), built once
per machine with PyTorch's extension builder and cached.

Without it every decode step would gather each row's blocks into a dense copy for SDPA: on a 2-core CPU that copy
costs about what the attention itself does. The kernel is built for the CPU's vector width (PyTorch's own
dispatch level: AVX-512, AVX2 or plain), under PyTorch's TORCH_EXTENSIONS_DIR when it is set, else
~/.cache/trainserve/extensions. Where it cannot be built (no C++ compiler) or does not apply (a CUDA device),
`kernel()` is None and the runners gather (the tests compare both paths).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("paged_attention.cpp")
# PyTorch's CPU dispatch level -> the compiler flags and ATen vector capability the kernel is built with.
CAPABILITIES = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY=AVX512",
               "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "DEFAULT": ["-DCPU_CAPABILITY=DEFAULT"],
}


def extensions_dir() -> Path:
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "trainserve" / "extensions")


def capability() -> str:
    found = torch.backends.cpu.get_cpu_capability()
    return found if found in CAPABILITIES else "DEFAULT"


@functools.cache
def kernel() -> ModuleType | None:
    """The built kernel module (paged_decode), or None where it cannot be built."""
    level = capability()
    name = f"trainserve_paged_attention_{level.lower()}"
    # One build folder per source file's location: two checkouts sharing the cache never rebuild each other's.
    build = extensions_dir() / f"{name}-{hashlib.sha256(str(SOURCE).encode()).hexdigest()[:12]}"
    try:
        from torch.utils.cpp_extension import load

        build.mkdir(parents=True, exist_ok=True)
        return load(name=name, sources=[str(SOURCE)], build_directory=str(build),
                    extra_cflags=["-O3", *CAPABILITIES[level]], verbose=False)
    except Exception as error:  # noqa: BLE001 - no compiler, headers or toolchain: the gather path serves
        log.warning("the paged attention kernel could not be built (%s: %s); decode steps gather the cache instead",
                    type(error).__name__, error)
        return None


def parts_for(rows: int, kv_heads: int) -> int:
    """How many position ranges each (row, kv head) is split into: enough work items for every thread, several each
    (a lone long row otherwise runs on one core)."""
    items = rows * kv_heads
    return max(1, -(-4 * torch.get_num_threads() // items))


if __name__ == "__main__":  # `python -m worker.engines.generation.caches.paged_attention`: build it now (make setup)
    logging.basicConfig(level=logging.INFO)
    built = kernel()
    print(f"paged attention kernel ({capability()}): {'built' if built is not None else 'unavailable'}")
    raise SystemExit(0)
