"""A generation engine that also serves LoRA adapters of its base model, rows of many adapters and of the base in
one batch (Punica, S-LoRA): the base loads once, adapters come and go.

The caller's thread reads an adapter's folder (`load_lora_weights`) in `submit`, unless the adapter is resident
already, so the decode loop never waits on disk or network. At admission the scheduler takes a slot of the
`AdapterCache` (max_loras of them, least recently used idle adapter out; installing one is a tensor copy). A request
whose adapter finds every slot held by running requests goes back to the queue head and waits (its deadline still
applies, then DeadlineExceeded: a retryable 503), while requests for the base or for resident adapters pass it.
Before each forward the rows' slots go to the runner (`RunnerLora.set_rows`); a request releases its slot once it
has left the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from core.protocol import SamplingParams
from worker.engines.serving.engine import GenerationEngine
from worker.engines.serving.lora.adapter_slots import AdapterCache, AdapterCacheFull, LoraWeights, load_lora_weights
from worker.engines.serving.lora.runner_lora import RunnerLora, runner_lora
from worker.engines.serving.prefill import Chunk
from worker.engines.serving.requests import AdapterUse, GenerationResult, Request
from worker.engines.serving.runners.decoder import DecoderRunner


class LoraGenerationEngine(GenerationEngine):
    """GenerationEngine plus `submit(..., adapter=name)`: `adapter_folder(name)` gives the adapter's PEFT folder."""

    def __init__(self, model: str | Path, *, max_loras: int = 8,
                 adapter_folder: Callable[[str], Path] | None = None, **kwargs: Any) -> None:
        if not isinstance(max_loras, int) or max_loras < 1:
            raise ValueError(f"max_loras must be a positive integer, got {max_loras!r}")
        self.max_loras = max_loras
        self._adapter_folder = adapter_folder or Path
        self._lora: RunnerLora | None = None
        self._adapters: AdapterCache | None = None
        self._holders: dict[int, Request] = {}  # requests holding an adapter slot, by id()
        super().__init__(model, **kwargs)
        if isinstance(self._runner, DecoderRunner):  # GPT-2 has no adapter path here: its requests are refused
            self._lora = runner_lora(self._runner, capacity=max_loras)
            self._runner.attach_lora(self._lora)
            self._adapters = AdapterCache(self._lora, self.read_adapter)

    def read_adapter(self, name: str) -> LoraWeights:
        """An adapter's weights read from its folder and checked against this base (ValueError if they do not fit)."""
        if self._lora is None:
            raise ValueError(f"adapter {name!r}: adapters are served over llama-family bases "
                             f"({self.config.model_type} is not one); serve the merged model instead")
        weights = load_lora_weights(self._adapter_folder(name), name)
        self._lora.check(weights)
        return weights

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               adapter: str | AdapterUse | None = None, **kwargs: Any) -> Future[GenerationResult]:
        """GenerationEngine.submit, through adapter `adapter` (by name) when given; ValueError if it cannot serve."""
        if isinstance(adapter, str):
            resident = self._adapters is not None and adapter in self._adapters
            # Read on the caller's thread: the scheduler only copies tensors into a slot.
            adapter = AdapterUse(adapter, None if resident else self.read_adapter(adapter))
        return super().submit(prompt, params, adapter=adapter, **kwargs)

    @property
    def weight_bytes(self) -> int:
        """The base's weights plus the adapter slots' stacks (allocated by the first adapter, grown with ranks)."""
        return super().weight_bytes + (self._lora.nbytes if self._lora is not None else 0)

    def stats(self) -> dict:
        """GenerationEngine.stats plus the resident adapters (least recently used first)."""
        with self._lock:  # the scheduler changes the cache under this lock
            adapters = self._adapters.resident() if self._adapters is not None else []
        return {**super().stats(), "adapters": adapters, "max_loras": self.max_loras}

    def _admit(self, flagged: frozenset[str] = frozenset()) -> list[Request]:
        self._release_finished()
        admitted, back = [], []
        for request in super()._admit(flagged):
            use = request.adapter
            if use is None or self._adapters is None:
                admitted.append(request)
                continue
            if back and use.name not in self._adapters:
                back.append(request)  # an earlier request waits for a slot: no later one takes it
                continue
            try:
                with self._lock:
                    use.slot = self._adapters.acquire(use.name, use.weights)
            except AdapterCacheFull:
                back.append(request)
                continue
            except Exception as error:  # noqa: BLE001 - e.g. a re-read folder that vanished: fail this request
                with self._lock:
                    self._tokens_in_flight -= request.cost
                self._fail(request, error)
                continue
            use.weights = None  # in the slot now; the cache re-reads it if it is ever evicted
            self._holders[id(request)] = request
            admitted.append(request)
        if back:
            with self._lock:  # back to the head, in their order: they keep their turn
                self._waiting.extendleft(reversed(back))
                self._tokens_in_flight -= sum(request.cost for request in back)
        return admitted

    def _step(self, chunks: list[Chunk]) -> None:
        if self._lora is not None:  # each prompt chunk keeps its request's adapter
            self._lora.set_rows([slot_of(s.request) for s in self._rows], [slot_of(c.request) for c in chunks])
        super()._step(chunks)

    def _sweep(self) -> None:
        super()._sweep()
        self._release_finished()

    def _reset(self, error: BaseException) -> None:
        super()._reset(error)
        self._release_finished()

    def _release_finished(self) -> None:
        """Give back the slots of requests that have ended and left the batch."""
        if not self._holders or self._adapters is None:
            return
        live = {id(s.request) for s in self._rows}
        for key, request in list(self._holders.items()):
            if key not in live and request.future.done():
                assert request.adapter is not None
                with self._lock:
                    self._adapters.release(request.adapter.name)
                del self._holders[key]


def slot_of(request: Request) -> int:
    """The adapter slot a request's rows use (0: the base)."""
    return 0 if request.adapter is None else request.adapter.slot
