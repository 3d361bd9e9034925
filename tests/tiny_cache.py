"""Build each tiny model once per test process and hand out copies: a build costs seconds, a copy milliseconds."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

_built: dict[tuple[object, ...], tuple[Path, torch.Tensor]] = {}
_root: Path | None = None


def _cache_root() -> Path:
    global _root
    if _root is None:
        _root = Path(tempfile.mkdtemp(prefix="trainserve-tiny-"))
        atexit.register(shutil.rmtree, _root, True)
    return _root


def cached_build(key: tuple[object, ...], build: Callable[[Path], Path], path: Path) -> Path:
    """Copy the folder `build` made for `key` (built on first use) to `path`; a copy, so tests may change theirs.

    The builders seed torch's global generator; a copy leaves it in the state the build would have, so a test
    that draws random numbers after building a model sees the same numbers either way.
    """
    if key not in _built:
        source = build(_cache_root() / f"{len(_built)}")
        _built[key] = (source, torch.get_rng_state())
    source, rng_state = _built[key]
    torch.set_rng_state(rng_state)
    path = Path(path)
    shutil.copytree(source, path, dirs_exist_ok=True)
    return path
