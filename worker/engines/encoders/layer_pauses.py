"""Points between a model's layers where the batch running it may give the model to another tenant's batch.

An inference worker's model is shared by request threads that take turns at it (worker/servers/fair_turns.py). A turn
yields a pause function; while a batch runs, a forward pre-hook on each of the model's layers calls the running
thread's pause, which may block until the batch's tenant gets the model back. Threads that run the model without a
turn (warm-up, tests) call nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn


def model_layers(model: nn.Module) -> nn.ModuleList | None:
    """The model's stack of layers: the first module list as long as its config's layer count (BERT's
    encoder.layer, a decoder's layers); None for a model without one (it is then paused only between batches)."""
    count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and len(module) == count:
            return module
    return None


class LayerPauses:
    """Calls the running thread's pause before each layer of `model`."""

    def __init__(self, model: nn.Module) -> None:
        self._local = threading.local()
        layers = model_layers(model)
        self.layers = 0 if layers is None else len(layers)
        for layer in layers or []:
            layer.register_forward_pre_hook(self._before_layer)

    @contextmanager
    def around(self, pause: Callable[[], None] | None) -> Iterator[None]:
        """Pause with `pause` between the layers of forwards this thread runs inside the block."""
        self._local.pause = pause
        try:
            yield
        finally:
            self._local.pause = None

    def _before_layer(self, module: nn.Module, args: Any) -> None:
        pause = getattr(self._local, "pause", None)
        if pause is not None:
            pause()
