"""The LoRA adapters one generation engine serves over its base, rows of many adapters and of the base in one
batch (Punica, S-LoRA): the base loads once, adapters come and go.

The caller's thread reads an adapter's folder (`use`) unless the adapter is resident already, so the decode loop
never waits on disk or network. At admission the scheduler asks `acquire` for a slot of the `AdapterCache`
(max_loras of them, least recently used idle adapter out; installing one is a tensor copy); a request whose
adapter finds every slot held by running requests keeps its place and waits (its deadline still applies), while
requests for the base or for resident adapters pass it. Before each forward the rows' slots go to the runner
(`set_rows`); a request releases its slot once it has left the batch (`release_finished`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path

from worker.engines.generation.lora.adapter_cache import AdapterCache, LoraWeights, load_lora_weights
from worker.engines.generation.lora.runner_lora import RunnerLora, runner_lora
from worker.engines.generation.requests import AdapterUse, Request
from worker.engines.generation.runners.decoder import DecoderRunner


class LoraManager:
    """Which adapters are resident in the runner's slots, which slot each running request uses."""

    def __init__(self, runner: DecoderRunner, *, max_loras: int, adapter_folder: Callable[[str], Path]) -> None:
        if not isinstance(max_loras, int) or max_loras < 1:
            raise ValueError(f"max_loras must be a positive integer, got {max_loras!r}")
        self.max_loras = max_loras
        self._adapter_folder = adapter_folder
        self.stacks: RunnerLora = runner_lora(runner, capacity=max_loras)
        runner.attach_lora(self.stacks)
        self._cache = AdapterCache(self.stacks, self.read)
        self._holders: dict[int, Request] = {}  # requests holding an adapter slot, by id()

    def read(self, name: str) -> LoraWeights:
        """An adapter's weights read from its folder and checked against this base (ValueError if they do not fit)."""
        weights = load_lora_weights(self._adapter_folder(name), name)
        self.stacks.check(weights)
        return weights

    def use(self, name: str) -> AdapterUse:
        """A request's use of adapter `name`, its weights read now (on the caller's thread) unless resident."""
        return AdapterUse(name, None if name in self._cache else self.read(name))

    def __contains__(self, name: object) -> bool:
        """Whether adapter `name` holds a slot now (safe to ask from another thread)."""
        return name in self._cache

    def acquire(self, request: Request) -> None:
        """Give an admitted request's adapter a slot (AdapterCacheFull when every slot is held)."""
        use = request.adapter
        assert use is not None
        use.slot = self._cache.acquire(use.name, use.weights)
        use.weights = None  # in the slot now; the cache re-reads it if it is ever evicted
        self._holders[id(request)] = request

    def release_finished(self, live: Collection[int]) -> None:
        """Give back the slots of requests that have ended and left the batch (`live`: id()s still in it)."""
        for key, request in list(self._holders.items()):
            if key not in live and request.future.done():
                assert request.adapter is not None
                self._cache.release(request.adapter.name)
                del self._holders[key]

    def set_rows(self, rows: list[Request], chunks: list[Request]) -> None:
        """Before a forward: the adapter slot of each decode row and of each prompt chunk (0: the base)."""
        self.stacks.set_rows([slot_of(r) for r in rows], [slot_of(r) for r in chunks])

    def resident(self) -> list[str]:
        """Resident adapters, least recently used first."""
        return self._cache.resident()

    @property
    def nbytes(self) -> int:
        """Bytes of the adapter stacks (allocated by the first adapter, grown with ranks)."""
        return self.stacks.nbytes


def slot_of(request: Request) -> int:
    """The adapter slot a request's rows use (0: the base)."""
    return 0 if request.adapter is None else request.adapter.slot
