"""Generation on a worker: engines kept warm under a memory budget, events to Redis streams as tokens come.

Token events go through the process's EventPump (worker/servers/events.py), so the engine's scheduler thread never
waits on Redis; a request's last event is written after all its tokens.

The process's `GenerationService` comes from `ctx.service("generation", GenerationService.build)`; it owns
the engine registry and the Redis client, and maps engine outcomes to wire events in one place (`_error`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from pydantic import BaseModel, ValidationError
from redis.exceptions import RedisError

from core.generation_limits import Refusal, fit_refusal
from core.protocol import (
    AcceptedEvent,
    ChoiceOut,
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    GenerateTask,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
    TokensEvent,
    Usage,
)
from core.redis_keys import cancel_key
from core.served_models import is_job_model
from core.settings import Settings
from core.storage import ArtifactStore
from core.tool_calls import ChoiceParser
from worker import metrics
from worker.context import WorkerContext
from worker.model_store import fetch_full_model, fetch_model
from worker.servers.chat_plan import plan_chat
from worker.servers.events import EventPump, EventWriter

if TYPE_CHECKING:
    from worker.engines.serving import ServingEngine
    from worker.engines.vllm.engine import VllmOptions

log = logging.getLogger(__name__)
MB = 1024 * 1024


class Closable(Protocol):
    """What the registry needs of a warm engine: a way to stop it."""

    def close(self) -> None: ...


EngineT = TypeVar("EngineT", bound=Closable)


@dataclass
class _Entry(Generic[EngineT]):
    engine: EngineT
    bytes: int
    users: int = 0


class EngineRegistry(Generic[EngineT]):
    """Warm engines by model, least recently used first; idle ones are evicted to stay under a memory budget.

    Loading a model holds only that model's lock, so requests for models already loaded go on meanwhile.
    """

    def __init__(self, build: Callable[[str], EngineT], budget_bytes: int, footprint: Callable[[EngineT], int],
                 alive: Callable[[EngineT], bool] | None = None) -> None:
        self.build = build
        self.budget_bytes = budget_bytes
        self.footprint = footprint
        self.alive = alive  # an engine that is not (its vLLM server died) is replaced when next used, once idle
        self._entries: OrderedDict[str, _Entry[EngineT]] = OrderedDict()
        self._loading: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()  # guards the two dicts above; never held while a model loads

    @contextmanager
    def use(self, model: str) -> Iterator[EngineT]:
        """The engine for `model` (loaded on first use); it is not evicted while in use."""
        entry = self._acquire(model)
        try:
            yield entry.engine
        finally:
            with self._lock:
                entry.users -= 1
            self._evict()

    def loaded(self) -> list[str]:
        """Models with a warm engine, least recently used first."""
        with self._lock:
            return list(self._entries)

    def engines(self) -> list[EngineT]:
        """The warm engines (a snapshot: one may be evicted after)."""
        return [engine for _, engine in self.warm()]

    def warm(self) -> list[tuple[str, EngineT]]:
        """(model, engine) of each warm engine (a snapshot)."""
        with self._lock:
            return [(model, entry.engine) for model, entry in self._entries.items()]

    def used_bytes(self) -> int:
        """The summed footprint of the warm engines."""
        with self._lock:
            return sum(e.bytes for e in self._entries.values())

    def close(self) -> None:
        """Stop every engine."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), OrderedDict()
        for entry in entries:
            entry.engine.close()

    def _acquire(self, model: str) -> _Entry[EngineT]:
        with self._lock:
            entry = self._hit(model)
            if entry is not None:
                return entry
            load_lock = self._loading.setdefault(model, threading.Lock())
        with load_lock:  # one load per model; other models are served meanwhile
            with self._lock:
                entry = self._hit(model)
                if entry is not None:
                    return entry
            engine = self.build(model)
            entry = _Entry(engine, self.footprint(engine), users=1)
            with self._lock:
                self._entries[model] = entry
                self._loading.pop(model, None)
        self._evict()
        return entry

    def _hit(self, model: str) -> _Entry[EngineT] | None:
        entry = self._entries.get(model)
        if entry is not None and entry.users == 0 and self.alive is not None and not self.alive(entry.engine):
            log.warning("generation engine %s is no longer alive: loading it again", model)
            del self._entries[model]
            threading.Thread(target=entry.engine.close, daemon=True).start()  # never under the registry's lock
            return None
        if entry is not None:
            entry.users += 1
            self._entries.move_to_end(model)
        return entry

    def _evict(self) -> None:
        """Close least recently used idle engines while the warm ones exceed the budget."""
        doomed = []
        with self._lock:
            total = sum(e.bytes for e in self._entries.values())
            for model, entry in list(self._entries.items()):
                if total <= self.budget_bytes:
                    break
                if entry.users == 0:
                    del self._entries[model]
                    total -= entry.bytes
                    doomed.append((model, entry))
        for model, entry in doomed:
            log.info("evicting generation engine %s (%.1f MB) to stay under the memory budget", model,
                     entry.bytes / MB)
            entry.engine.close()


def _footprint(engine: ServingEngine) -> int:
    """What an idle engine may hold, in bytes: its weights and buffers, and the prefix cache's budget (an idle
    built-in engine keeps the prefix cache's blocks, the rest of its KV cache is released whenever it is idle; vLLM
    keeps its whole KV cache)."""
    return engine.weight_bytes + engine.prefix_cache_bytes


class GenerationService:
    """One per generation worker process: the engine registry, Redis, and the request flow."""

    def __init__(self, settings: Settings, redis: Any, storage: ArtifactStore) -> None:
        self.settings = settings
        self.redis = redis
        self.storage = storage
        self.events = EventPump(redis)
        self.registry = EngineRegistry(self._load, int(settings.generation_memory_budget_mb * MB), _footprint,
                                       alive=lambda engine: engine.alive())
        metrics.ENGINE_STATE.source = self.engine_stats  # the worker's scrapes read this service's engines

    def engine_stats(self) -> list[tuple[str, dict[str, Any]]]:
        """(model, stats) of each warm engine, for the worker's metrics."""
        return [(model, engine.stats()) for model, engine in self.registry.warm()]

    def close(self) -> None:
        """Stop every warm engine (a vLLM engine stops its server): the worker is shutting down."""
        self.registry.close()

    @classmethod
    def build(cls, ctx: WorkerContext) -> GenerationService:
        """The factory for `ctx.service("generation", ...)`."""
        return cls(ctx.settings, ctx.redis, ctx.storage)

    def _load(self, model: str) -> ServingEngine:
        name = model
        if is_job_model(model):  # a trained job's model (an adapter folded into its base): from the artifact store
            model = str(fetch_full_model(self.storage, model))
        if self._engine_for(name) == "vllm":
            return self._load_vllm(name, model)
        return self._load_builtin(model)

    def _engine_for(self, name: str) -> str:
        from worker.engines.vllm.server import find_python

        return self.settings.generation_engine_for(
            name, cuda=_on_cuda(self.settings), vllm_installed=find_python(self.settings.vllm_python) is not None)

    def _load_builtin(self, model: str) -> ServingEngine:
        from worker.engines.generation.engine import GenerationEngine

        # Also serves the LoRA adapter jobs trained on this model (GenerateTask.adapter), in the same batches.
        engine = GenerationEngine(model, device=self.settings.worker_device,
                                precision=self.settings.generation_precision,
                                max_batch_size=self.settings.max_batch_size,
                                max_tokens_in_flight=self.settings.max_tokens_in_flight,
                                prefill_chunk_tokens=self.settings.prefill_chunk_tokens,
                                prefill_step_ratio=self.settings.prefill_step_ratio,
                                prefix_cache_bytes=int(self.settings.prefix_cache_mb * MB),
                                prefix_cache_across_tenants=self.settings.prefix_cache_across_tenants,
                                decode_graphs="cuda" if self.settings.cuda_graphs else "off",
                                max_queue=self.settings.generation_queue_per_model * 4,
                                tenant_queue_share=self.settings.generation_tenant_queue_share,
                                speculative_tokens=self.settings.speculative_tokens,
                                speculative_max_rows=self.settings.speculative_max_rows,
                                cancelled_ids=self.cancelled_ids, on_step=metrics.observe_batch,
                                max_loras=self.settings.max_loras, adapter_folder=self._adapter_folder)
        log.info("generation engine loaded: %s on %s in %s, %.1f MiB of weights", model, engine.plan.device,
                 engine.plan.precision, engine.weight_bytes / MB)
        return engine

    def _load_vllm(self, name: str, model: str) -> ServingEngine:
        from worker.engines.vllm.engine import VllmEngine
        from worker.engines.vllm.server import INSTALL_HINT, VllmUnavailable, find_python

        python = find_python(self.settings.vllm_python)
        if python is None:
            raise VllmUnavailable(INSTALL_HINT)
        options = vllm_options(self.settings, name, python)
        engine = VllmEngine(model, options, max_batch_size=self.settings.max_batch_size,
                          max_tokens_in_flight=self.settings.max_tokens_in_flight,
                          max_queue=self.settings.generation_queue_per_model * 4,
                          tenant_queue_share=self.settings.generation_tenant_queue_share,
                          cancelled_ids=self.cancelled_ids, prefix_cache_bytes=int(self.settings.prefix_cache_mb * MB),
                          max_loras=self.settings.max_loras, adapter_folder=self._adapter_folder,
                          prefix_cache_across_tenants=self.settings.prefix_cache_across_tenants)
        log.info("generation engine loaded: %s through vLLM on %s (%s, %d device(s)), %.1f MiB of weights; vLLM's "
                 "log: %s", model, options.device, options.dtype, options.tensor_parallel, engine.weight_bytes / MB,
                 engine.server.log_path)
        return engine

    def _adapter_folder(self, job_id: str) -> Path:
        """A LoRA adapter job's folder on this host (fetched once), on a request's thread: off the decode loop."""
        return fetch_model(self.storage, job_id)

    def cancelled_ids(self, request_ids: list[str]) -> set[str]:
        """The requests whose clients went away: one MGET per scheduler step for all of them."""
        try:
            flags = self.redis.mget([cancel_key(r) for r in request_ids])
        except RedisError:
            log.warning("could not read cancel flags; asking again next step", exc_info=True)
            return set()
        return {r for r, flag in zip(request_ids, flags, strict=True) if flag}

    def serve(self, payload: dict[str, Any]) -> None:
        """Run one request from the API end to end; every outcome is written to its event stream."""
        metrics.GEN_IN_FLIGHT.inc()
        try:
            self._serve(payload)
        finally:
            metrics.GEN_IN_FLIGHT.dec()

    def _serve(self, payload: dict[str, Any]) -> None:
        try:
            task = GenerateTask.model_validate(payload)
        except ValidationError:
            log.exception("dropping a malformed generation task")
            return
        writer = EventWriter(self.events, task.request_id,
                             int(self.settings.generation_wait_s + self.settings.generation_timeout_s))
        remaining = task.remaining()
        if remaining <= 0:  # waited in the broker too long: drop it before it reaches the model
            writer.emit(ErrorEvent.of(ErrorCode.QUEUE_TIMEOUT, "the request waited too long for a generation "
                                      "worker; retry"))
            metrics.GEN_REQUESTS.labels(ErrorCode.QUEUE_TIMEOUT).inc()
            return
        try:
            with self.registry.use(task.model) as engine:
                outcome = self._run(engine, task, writer, remaining)
        except Exception as exc:  # noqa: BLE001 - model failed to load, etc.: the client gets a clear error event
            outcome = _error(exc, task.request_id)
        writer.emit(outcome)
        if isinstance(outcome, DoneEvent):
            metrics.GEN_REQUESTS.labels("done").inc()
            metrics.GEN_TOKENS.inc(outcome.usage.completion_tokens)
        elif isinstance(outcome, ErrorEvent):
            metrics.GEN_REQUESTS.labels(outcome.error.code).inc()

    def _run(self, engine: ServingEngine, task: GenerateTask, writer: EventWriter, remaining: float) -> BaseModel:
        from worker.engines.generation.requests import GRAMMAR_ERROR  # the engine and torch are loaded by now

        if task.op != "generate":
            return tokens_event(engine, task)
        parsers: list[ChoiceParser | None] = [None] * task.params.n
        if task.messages is not None:
            plan = plan_chat(engine, task)
            if isinstance(plan, ErrorEvent):
                return plan
            prompt_ids, params = plan.ids, plan.params
            parsers = [plan.parser() for _ in range(params.n)]
        elif task.prompt_ids is not None:
            prompt_ids, params = task.prompt_ids, task.params
            if refused := _token_ids_refusal(prompt_ids, engine.vocab_size, "prompt"):
                return refused
        else:
            prompt_ids, params = engine.encode(task.prompt), task.params
        if not prompt_ids:
            return ErrorEvent.of(ErrorCode.VALIDATION_ERROR, "the prompt encodes to no tokens", "prompt")
        refusal = engine_fit(engine, len(prompt_ids), params, task.tokens_field)
        if refusal is not None:  # the engine would refuse it too; here the error names the request's field
            return ErrorEvent.of(ErrorCode.VALIDATION_ERROR, refusal.message, refusal.field)
        if params.prompt_logprobs is not None:  # each choice's answer repeats the scored prompt (an echo)
            entries = params.n * (len(prompt_ids) + params.max_new_tokens) * (1 + params.prompt_logprobs)
            if entries > self.settings.max_response_entries:
                return ErrorEvent.of(ErrorCode.VALIDATION_ERROR, f"n ({params.n}) x (prompt tokens "
                                     f"({len(prompt_ids)}) + tokens to generate ({params.max_new_tokens})) x (1 + "
                                     f"logprobs {params.prompt_logprobs}) = {entries} token entries; a response "
                                     f"holds at most {self.settings.max_response_entries} on this server", "logprobs")
        clock = metrics.TokenClock()

        def on_token(index: int, text: str, logprobs: list[TokenLogprob] | None = None) -> None:
            clock.tick(index)
            parser = parsers[index]
            if parser is None:
                writer.token(TokenEvent(index=index, text=text, logprobs=logprobs))
            else:
                _emit(writer, index, parser.feed(text), logprobs)

        # The adapter's folder is read here, on this thread, before the queue (unless it is resident).
        future = engine.submit(prompt_ids, params, request_id=task.request_id, on_token=on_token,
                               deadline=time.monotonic() + remaining, adapter=task.adapter, tenant=task.tenant)
        writer.emit(AcceptedEvent(prompt_tokens=len(prompt_ids)))
        metrics.GEN_PROMPT_TOKENS.inc(len(prompt_ids))
        result = future.result(timeout=self.settings.generation_timeout_s)
        for index, parser in enumerate(parsers):
            if parser is not None:  # what was held back (a marker's possible start) goes out before the result
                _emit(writer, index, parser.finish(), None)
        if any(c.finish_reason == GRAMMAR_ERROR for c in result.choices):
            from worker.engines.generation.sampling.grammar import field_of

            assert params.constraint is not None
            return ErrorEvent.of(ErrorCode.VALIDATION_ERROR, "the output constraint is too complex to enforce: its "
                                 "matcher failed during generation; simplify the schema or pattern",
                                 field_of(params.constraint))
        done = done_event(result, parsers)
        done.usage.reasoning_tokens = sum(len(engine.encode(c.reasoning, add_special_tokens=False))
                                          for c in done.choices if c.reasoning)
        if task.prompt_ids is not None:  # the text of a prompt given as ids, for an echo
            done.prompt_text = engine.decode(task.prompt_ids)
        return done


def _on_cuda(settings: Settings) -> bool:
    """Whether this worker's device is a GPU (its precision is not resolved: no calibration runs)."""
    from worker.engines.device import resolve_device

    return resolve_device(settings.worker_device, "fp32").device.startswith("cuda")


VLLM_DTYPES = {"auto": "auto", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def vllm_options(settings: Settings, name: str, python: str) -> VllmOptions:
    """How this worker runs vLLM for model `name`: on its device (every GPU it owns is visible to the server, as
    `trainserve worker --device` set CUDA_VISIBLE_DEVICES), sharded over vllm_devices_for(name) of them (0: all)."""
    from worker.engines.vllm.engine import VllmOptions
    from worker.engines.vllm.server import split_args

    cuda = _on_cuda(settings)
    return VllmOptions(python=python, device="cuda" if cuda else "cpu",
                       tensor_parallel=(settings.vllm_devices_for(name) or settings.worker_devices) if cuda else 1,
                       dtype=VLLM_DTYPES[settings.generation_precision],
                       gpu_memory_utilization=settings.vllm_gpu_memory_utilization,
                       enforce_eager=settings.vllm_enforce_eager, max_lora_rank=settings.vllm_max_lora_rank,
                       lora_at_start=settings.vllm_lora_at_start,
                       startup_s=settings.vllm_startup_s, extra_args=split_args(settings.vllm_args))


def _emit(writer: EventWriter, index: int, deltas: tuple[str, str, list[dict[str, Any]]],
          logprobs: list[TokenLogprob] | None) -> None:
    content, reasoning, calls = deltas
    if content or reasoning or calls or logprobs:
        writer.token(TokenEvent(index=index, text=content, logprobs=logprobs, reasoning=reasoning or None,
                                tool_calls=calls or None))


def choice_out(choice: Any, parser: ChoiceParser | None) -> ChoiceOut:
    """One engine choice as the wire's, its text split into content, reasoning and calls when it is a chat's."""
    if parser is None:
        return ChoiceOut(index=choice.index, text=choice.text, finish_reason=choice.finish_reason,
                         logprobs=choice.logprobs)
    parsed = parser.result()
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in parsed.calls] or None
    reason = "tool_calls" if calls and choice.finish_reason in ("eos", "stop") else choice.finish_reason
    return ChoiceOut(index=choice.index, text=parsed.content, finish_reason=reason, logprobs=choice.logprobs,
                     reasoning=parsed.reasoning or None, tool_calls=calls)


def done_event(result: Any, parsers: list[ChoiceParser | None]) -> DoneEvent:
    """The engine's result as the wire's last event, each chat choice split into content, reasoning and calls."""
    return DoneEvent(choices=[choice_out(c, parsers[c.index]) for c in result.choices],
                     usage=Usage(prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
                                 cached_tokens=result.cached_tokens), prompt_logprobs=result.prompt_logprobs)


def tokens_event(engine: ServingEngine, task: GenerateTask) -> TokensEvent | ErrorEvent:
    """A tokenizer's answer: the prompt's ids ("tokenize"), or the text of prompt_ids ("detokenize")."""
    if task.op == "tokenize":
        ids = engine.encode(task.prompt, add_special_tokens=task.add_special_tokens)
        return TokensEvent(ids=ids, text=task.prompt, context=engine.context_length)
    ids = task.prompt_ids or []
    if refused := _token_ids_refusal(ids, engine.vocab_size, "tokens"):
        return refused
    return TokensEvent(ids=ids, text=engine.decode(ids), context=engine.context_length)


def _token_ids_refusal(ids: list[int], vocab_size: int, field: str) -> ErrorEvent | None:
    """A 422 naming `field` for token ids outside the model's vocabulary, else None."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if not bad:
        return None
    return ErrorEvent.of(ErrorCode.VALIDATION_ERROR, f"token ids must be in [0, {vocab_size}) for this model, got "
                         f"{bad[:5]!r}", field)


def engine_fit(engine: ServingEngine, prompt_tokens: int, params: SamplingParams, field: str) -> Refusal | None:
    """core.generation_limits.fit_refusal on this engine (its context, rows and cache positions), naming `field`."""
    return fit_refusal(prompt_tokens, params, context_length=engine.context_length,
                       max_batch_size=engine.max_batch_size, max_tokens_in_flight=engine.max_tokens_in_flight,
                       field=field)


def _error(exc: Exception, request_id: str) -> ErrorEvent:
    """The engine's exceptions as wire errors: the worker's one mapping."""
    from worker.engines.generation.engine import DeadlineExceeded, QueueFull

    if isinstance(exc, QueueFull):
        return ErrorEvent.of(ErrorCode.OVERLOADED, str(exc))
    if isinstance(exc, DeadlineExceeded):
        return ErrorEvent.of(ErrorCode.QUEUE_TIMEOUT, "the request waited too long for a batch slot; retry")
    if isinstance(exc, ValueError):  # a GrammarError names the request field its constraint came from
        return ErrorEvent.of(ErrorCode.VALIDATION_ERROR, str(exc), getattr(exc, "field", None))
    log.error("generation request %s failed", request_id, exc_info=exc)
    return ErrorEvent.of(ErrorCode.WORKER_ERROR, f"{type(exc).__name__}: {exc}")


def serve(ctx: WorkerContext, payload: dict[str, Any]) -> None:
    """Serve one generation task with the process's GenerationService."""
    ctx.service("generation", GenerationService.build).serve(payload)
