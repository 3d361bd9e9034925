"""vLLM behind trainserve's engine interface (worker/engines/serving.py): the same submit, stream, cancel, adapters,
stats and memory as the built-in GenerationEngine, over a vLLM server the engine starts (server.py).

What stays trainserve's, whichever engine decodes:
- Prompts: encoded, and chats rendered with their tools, by the worker's own tokenizer, so both engines get the same
  ids; constraints are compiled and probed here first (sampling/grammar.py), so a constraint that cannot be enforced
  is the same 422 naming the same field on either engine, before vLLM sees it.
- Admission and the fair share: vLLM has priorities, not tenants, so requests wait here, in the built-in engine's
  own scheduler (its queues, the per-tenant share of the queue and of the rows, interactive before batch lines,
  deadlines), and only admitted requests go to vLLM, at most max_batch_size rows at once, so what is admitted runs.
  vLLM cannot pause a running row for another tenant (the built-in engine does), so its --max-num-seqs is
  max_batch_size + spare_rows: a tenant within its share may start in the spare rows while another tenant holds
  more than its own, instead of waiting for that tenant's answers to end. QueueFull (429) and DeadlineExceeded (504)
  mean what they mean on the built-in engine.
- Cancel on disconnect: the worker's cancel flags are read every CANCEL_POLL_S for waiting and running requests;
  a running one's streams are closed, and vLLM aborts a request whose client went away.

What vLLM brings: its kernels, tensor parallelism over the worker's GPUs, any architecture it serves, its own
prefix cache (its cached tokens are reported as the built-in's are), LoRA adapters loaded at run time
(`/v1/load_lora_adapter`) up to its --max-lora-rank.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoConfig

from core.estimate import architecture
from core.protocol import SamplingParams
from worker.engines.generation.caches.prefix_cache import salt_of
from worker.engines.generation.endings import Endings
from worker.engines.generation.requests import (
    AdapterUse,
    Choice,
    EngineClosed,
    GenerationResult,
    OnToken,
    Request,
    check_fits,
    prompt_ids,
)
from worker.engines.generation.runners.gpt2_weights import eos_ids, resolve_folder
from worker.engines.generation.sampling.detokenize import logprob_table
from worker.engines.generation.sampling.grammar import GrammarError, Grammars, field_of
from worker.engines.generation.scheduler import Scheduler
from worker.engines.generation.tokenizer import chat_ids, load_tokenizer
from worker.engines.vllm.server import ServerSpec, VllmServer
from worker.engines.vllm.wire import ChoiceStream, choice_body, error_message

log = logging.getLogger(__name__)
# httpx logs every request at INFO: each streamed choice and cache-use read would be a line of the worker's log.
logging.getLogger("httpx").setLevel(logging.WARNING)

CANCEL_POLL_S = 0.2  # how often waiting and running requests' cancel flags are read
USAGE_POLL_S = 1.0  # how often vLLM's KV cache use is read while requests run (for the worker's metrics)
BLOCK = 16  # positions per KV block (vLLM's default block size), for the cache figures stats() reports
GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}


class AdapterRefused(ValueError):
    """An adapter this vLLM server cannot serve (its rank, or vLLM's own refusal): a 422 naming `model`."""

    field = "model"


@dataclass(frozen=True)
class VllmOptions:
    """How the worker runs vLLM, from its settings (plain data: the engine reads no settings itself)."""

    python: str
    device: str = "cpu"  # "cpu" or "cuda"
    visible_devices: str | None = None
    tensor_parallel: int = 1
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool | None = None  # None: eager on a CPU, compiled on a GPU
    max_lora_rank: int = 64
    threads: int = 0  # on a CPU: OMP threads (0: every core)
    lora_at_start: bool = False  # False: vLLM starts without LoRA and restarts with it when an adapter is first asked
    startup_s: float = 900.0
    extra_args: tuple[str, ...] = ()


@dataclass(eq=False)
class _Running:
    """An admitted request: one stream per choice, the choices still streaming, whether its caller went away."""

    request: Request
    model: str
    streams: list[ChoiceStream]
    left: int
    gone: bool = False
    error: BaseException | None = None


class VllmEngine:
    """One model served by a vLLM server; submit() is thread-safe and behaves as GenerationEngine.submit."""

    engine_name = "vllm"

    def __init__(self, model: str | Path, options: VllmOptions, *, max_batch_size: int = 32,
                 max_tokens_in_flight: int = 16384, max_queue: int = 256, tenant_queue_share: float = 1.0,
                 cancelled_ids: Callable[[list[str]], Collection[str]] | None = None, prefix_cache_bytes: int = 0,
                 max_loras: int = 8, adapter_folder: Callable[[str], Path] | None = None,
                 prefix_cache_across_tenants: bool = False) -> None:
        folder = resolve_folder(model)
        self.model = str(folder)
        config = AutoConfig.from_pretrained(folder)
        text = config.get_text_config()
        self.tokenizer = load_tokenizer(folder)
        self.vocab_size: int = int(text.vocab_size)
        # vLLM's --max-model-len: the model's context, within the positions the engine holds for its running rows
        # (a request longer than either is refused by the same fit check as the built-in engine's).
        self.context_length: int = min(max_tokens_in_flight, int(getattr(text, "max_position_embeddings", None)
                                                                 or getattr(text, "n_positions", None) or 2048))
        self.eos_token_ids = eos_ids(folder, text) | ({self.tokenizer.eos_token_id}
                                                      if self.tokenizer.eos_token_id is not None else set())
        self.max_batch_size = max_batch_size
        self.max_tokens_in_flight = max_tokens_in_flight
        self.max_queue = max_queue
        self.max_loras = max_loras
        self.prefix_cache_across_tenants = prefix_cache_across_tenants  # else each tenant is its own cache_salt
        self.weight_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        # vLLM cannot pause a running row for another tenant, so its batch is wider than max_batch_size by rows only
        # a newcomer within its share may take while another tenant holds more than its own (scheduler.py).
        self.spare_rows = max(1, max_batch_size // 2)
        self.scheduler = Scheduler(max_batch_size=max_batch_size, max_tokens_in_flight=max_tokens_in_flight,
                                   max_queue=max_queue, tenant_queue_share=tenant_queue_share,
                                   spare_rows=self.spare_rows)
        self._lock = threading.RLock()
        self._endings = Endings(self._lock)
        self._encode_lock = threading.Lock()
        self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._table = logprob_table(self.tokenizer, self.vocab_size)
        self._cancelled_ids = cancelled_ids
        self._adapter_folder = adapter_folder or Path
        self._adapters: dict[str, str] = {}  # adapter name -> the folder vLLM loaded it from
        self._adapter_lock = threading.Lock()
        self._running: dict[int, _Running] = {}
        self._closed = False
        self._dead: str | None = None  # why the server stopped serving, once a request saw it
        self._wake = threading.Event()
        kv_bytes = self._kv_bytes(config, options.dtype)
        kv_gib = max(1, math.ceil(kv_bytes / GIB))  # vLLM's CPU cache is set in whole GiB
        if options.device == "cpu":
            kv_bytes = kv_gib * GIB
        self._block_bytes = max(1, kv_bytes // self.max_tokens_in_flight) * BLOCK
        self._cache_blocks = kv_bytes // self._block_bytes
        self._cache_usage = 0.0  # vLLM's kv_cache_usage_perc, read from its /metrics while requests run
        self._usage_read = 0.0
        # vLLM keeps its whole KV cache allocated while it runs: that, not a prefix-cache budget, is what an idle
        # engine holds beside its weights (the registry's footprint).
        self.prefix_cache_bytes = kv_bytes if options.device == "cpu" else 0
        spec = ServerSpec(
            python=options.python, model=self.model, served_name="base", dtype=options.dtype, device=options.device,
            visible_devices=options.visible_devices, tensor_parallel=options.tensor_parallel,
            max_num_seqs=max_batch_size + self.spare_rows, max_model_len=self.context_length,
            kv_cache_gib=kv_gib, gpu_memory_utilization=options.gpu_memory_utilization,
            enforce_eager=options.device == "cpu" if options.enforce_eager is None else options.enforce_eager,
            prefix_caching=prefix_cache_bytes > 0, max_loras=max_loras, max_lora_rank=options.max_lora_rank,
            threads=options.threads or _cores(), lora=options.lora_at_start, extra_args=options.extra_args)
        self.max_lora_rank = options.max_lora_rank
        self._startup_s = options.startup_s
        self._paused = False  # True while the server restarts (with LoRA): nothing is admitted meanwhile
        self._spec = spec
        self.server = VllmServer(spec, options.startup_s)
        self._http = self._client()
        self._streams = ThreadPoolExecutor(max_batch_size + self.spare_rows, thread_name_prefix="vllm-stream")
        self._thread = threading.Thread(target=self._dispatch, name="vllm-dispatch", daemon=True)
        self._thread.start()

    def _client(self) -> httpx.Client:
        return httpx.Client(base_url=self.server.url, timeout=httpx.Timeout(None, connect=10.0),
                            limits=httpx.Limits(max_connections=self.max_batch_size + self.spare_rows + 4,
                                                max_keepalive_connections=self.max_batch_size + self.spare_rows + 4))

    def _kv_bytes(self, config: Any, dtype: str) -> int:
        """KV cache bytes for max_tokens_in_flight positions (every layer's keys and values)."""
        arch = architecture(config.get_text_config().to_dict())
        per_token = 2 * arch.layers * arch.kv_hidden * DTYPE_BYTES.get(dtype, 2) if arch is not None else 0
        return per_token * self.max_tokens_in_flight

    # -- the callers' side --

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        with self._encode_lock:
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    **template_kwargs: Any) -> list[int]:
        with self._encode_lock:
            return chat_ids(self.tokenizer, messages, tools, **template_kwargs)

    def decode(self, ids: Sequence[int]) -> str:
        with self._encode_lock:
            return str(self.tokenizer.decode(list(ids)))

    def read_adapter(self, name: str) -> AdapterUse:
        """Adapter `name` loaded into vLLM (once; its folder fetched on this, the caller's, thread)."""
        with self._adapter_lock:
            if name not in self._adapters:
                folder = self._adapter_folder(name)
                rank = _lora_rank(folder)
                if rank is not None and rank > self.max_lora_rank:
                    raise AdapterRefused(f"adapter {name!r} has LoRA rank {rank}; this vLLM serves ranks up to "
                                         f"{self.max_lora_rank} (TRAINSERVE_VLLM_MAX_LORA_RANK)")
                if not self._spec.lora:
                    self._restart_with_lora()
                response = self._http.post("/v1/load_lora_adapter", json={"lora_name": name,
                                                                          "lora_path": str(folder)})
                if response.status_code != 200 and "already" not in response.text:
                    raise AdapterRefused(f"adapter {name!r}: vLLM could not load it: {error_message(response.text)}")
                self._adapters[name] = str(folder)
        return AdapterUse(name)

    def submit(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, *, request_id: str | None = None,
        on_token: OnToken | None = None, is_cancelled: Callable[[], bool] | None = None,
        deadline: float | None = None, adapter: str | AdapterUse | None = None, tenant: str | None = None,
        batch: bool = False,
    ) -> Future[GenerationResult]:
        """Queue a request (GenerationEngine.submit's contract); ValueError, QueueFull, EngineClosed."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = prompt_ids(prompt, self.encode, self.vocab_size)
        check_fits(len(ids), params, context_length=self.context_length, max_batch_size=self.max_batch_size,
                   max_tokens_in_flight=self.max_tokens_in_flight)
        use = self.read_adapter(adapter) if isinstance(adapter, str) else adapter
        if params.constraint is not None:  # compiled and probed here, as the built-in engine does: the same 422
            self._grammars.matcher(params.constraint)
        request = Request(request_id or uuid.uuid4().hex, ids, params, on_token, is_cancelled, deadline,
                          adapter=use, tenant=tenant, batch=batch)
        with self._lock:
            if self._closed:
                raise EngineClosed("the generation engine is closed")
            if not self.alive():
                raise EngineClosed(f"vLLM's server for {self.model} stopped serving (its log: "
                                   f"{self.server.log_path}): {self._dead or self.server.tail(5)}")
            if deadline is not None and deadline <= time.monotonic():
                self._endings.expire(request, f"request {request.request_id}: deadline already passed")
                return request.future
            self.scheduler.add(request)
        self._wake.set()
        return request.future

    def _restart_with_lora(self) -> None:
        """Restart the server with LoRA enabled, once, when an adapter is first asked of this base: vLLM without
        LoRA decodes about twice as fast on a CPU (docs/guides/serving.md). Nothing is admitted meanwhile (requests
        wait in the queue, under their deadlines); the requests running finish first. The caller holds the adapter
        lock."""
        log.info("restarting vLLM for %s with LoRA enabled (an adapter was asked for)", self.model)
        with self._lock:
            self._paused = True
        try:
            deadline = time.monotonic() + self._startup_s
            while True:
                with self._lock:
                    if not self._running:
                        break
                if time.monotonic() > deadline:
                    raise EngineClosed("requests running on vLLM did not finish for its restart with LoRA")
                time.sleep(0.05)
            self._spec = replace(self._spec, lora=True)
            self._http.close()
            self.server.stop()
            self.server = VllmServer(self._spec, self._startup_s)
            self._http = self._client()
        finally:
            with self._lock:
                self._paused = False
            self._wake.set()

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> GenerationResult:
        return self.submit(prompt, params).result()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            rows = sum(r.request.params.n for r in self._running.values())
            return {"engine": self.engine_name, "running": len(self._running), "running_sequences": rows,
                    **self.scheduler.stats(), "cache_blocks": self._cache_blocks,
                    "cache_blocks_used": round(self._cache_usage * self._cache_blocks),
                    "cache_block_bytes": self._block_bytes, "max_batch_size": self.max_batch_size,
                    "max_tokens_in_flight": self.max_tokens_in_flight, "closed": self._closed,
                    "alive": self.alive(), "adapters": sorted(self._adapters),
                    "max_loras": self.max_loras, **self._endings.counters}

    def alive(self) -> bool:
        """False once closed, once the server's process exited, or once its engine core died (seen by a request)."""
        return not self._closed and self._dead is None and self.server.alive()

    def close(self) -> None:
        """Stop admitting; requests waiting or running fail with EngineClosed; the server stops."""
        with self._lock:
            self._closed = True
            waiting = self.scheduler.drain()
            running = [r.request for r in self._running.values()]
        self._wake.set()
        try:
            self._endings.close([*waiting, *running], EngineClosed("the generation engine is closed"))
            self._thread.join(timeout=5)
            self._http.close()
            self._streams.shutdown(wait=False, cancel_futures=True)
        finally:
            self.server.stop()

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the dispatch thread: admission, cancel flags --

    def _dispatch(self) -> None:
        while not self._closed:
            self._wake.wait(CANCEL_POLL_S)
            self._wake.clear()
            if self._closed:
                return
            try:
                self._admit()
            except Exception:  # noqa: BLE001 - a failed poll must not stop the engine
                log.exception("vLLM dispatch step failed")

    def _admit(self) -> None:
        with self._lock:
            waiting = self.scheduler.waiting
            running = list(self._running.values())
        if not waiting and not running:
            self._cache_usage = 0.0
            return
        if running and time.monotonic() - self._usage_read > USAGE_POLL_S:
            self._usage_read = time.monotonic()
            self._cache_usage = self._read_cache_usage()
        flagged: frozenset[str] = frozenset()
        if self._cancelled_ids is not None:
            flagged = frozenset(self._cancelled_ids([r.request_id for r in waiting]
                                                    + [r.request.request_id for r in running]))
        gone = {id(r) for r in waiting if self._endings.cancelled(r, flagged)}
        for run in running:
            if not run.gone and self._endings.cancelled(run.request, flagged):
                run.gone = True  # its streams close at their next chunk; vLLM aborts a request its client left
        with self._lock:
            admission = self.scheduler.admit(gone, time.monotonic(), None, start=not self._paused)
            started = []
            for request in admission.admitted:
                if not request.start():  # its caller cancelled the future meanwhile
                    self.scheduler.release(request, request.params.n)
                    continue
                model = request.adapter.name if request.adapter is not None else "base"
                scored = len(request.prompt) if request.params.prompt_logprobs is not None else 0
                run = _Running(request, model, [ChoiceStream(i, self._table, self.eos_token_ids,
                                                             echoed=scored if i == 0 else 0)
                                                for i in range(request.params.n)], request.params.n)
                self._running[id(request)] = run
                started.append(run)
            self._endings.peak(sum(r.request.params.n for r in self._running.values()))
        self._endings.dropped(admission.expired, admission.cancelled, admission.failed)
        for run in started:
            for index in range(run.request.params.n):
                self._streams.submit(self._stream_choice, run, index)

    def _healthy(self) -> bool:
        """vLLM's /health: 200 while its engine core runs."""
        try:
            return self._http.get("/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def _read_cache_usage(self) -> float:
        """The share of vLLM's KV cache in use, from its Prometheus metrics (0 when it cannot be read)."""
        try:
            text = self._http.get("/metrics", timeout=2).text
        except httpx.HTTPError:
            return 0.0
        for line in text.splitlines():
            if line.startswith("vllm:kv_cache_usage_perc"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    # -- one choice's stream (a pool thread) --

    def _stream_choice(self, run: _Running, index: int) -> None:
        request, stream = run.request, run.streams[index]
        body = choice_body(run.model, request.prompt, request.params, index,
                           salt_of(request, self.prefix_cache_across_tenants))
        try:
            with self._http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise self._refusal(response.status_code, response.read().decode(errors="replace"), request)
                for line in response.iter_lines():
                    if run.gone or self._closed or request.done:
                        break
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise RuntimeError(f"vLLM failed the request: {error_message(data)}")
                    delta, logprobs = stream.take(chunk, request.params.logprobs, request.params.prompt_logprobs)
                    if (delta or logprobs) and request.on_token is not None:
                        self._endings.emit(request, index, delta, logprobs)
        except BaseException as error:  # noqa: BLE001 - the request fails; the engine goes on
            if not (run.gone or self._closed):
                run.error = error
                if not isinstance(error, ValueError) and not self._healthy():
                    self._dead = f"{type(error).__name__}: {error}"
        finally:
            self._choice_ended(run)

    def _refusal(self, status: int, text: str, request: Request) -> Exception:
        message = error_message(text)
        if status == 400 and request.params.constraint is not None and "structured" in message.lower():
            return GrammarError(message, field_of(request.params.constraint))
        if 400 <= status < 500:
            return ValueError(message)
        return RuntimeError(f"vLLM answered {status}: {message}")

    def _choice_ended(self, run: _Running) -> None:
        with self._lock:
            run.left -= 1
            if run.left:
                return
            self._running.pop(id(run.request), None)
            self.scheduler.release(run.request, run.request.params.n)
        self._wake.set()
        request = run.request
        if run.error is not None:
            self._endings.fail(request, run.error)
            return
        if request.done:
            return
        request.done = True
        choices = [Choice(s.index, s.text, s.finish or "cancelled", s.token_ids, s.logprobs) for s in run.streams]
        completion = sum(len(c.token_ids) for c in choices)
        self._endings.count(prompt_tokens=len(request.prompt), generated_tokens=completion,
                            cached_prompt_tokens=max(s.cached_tokens for s in run.streams),
                            **({"cancelled": 1} if run.gone else {"completed": 1}))
        request.future.set_result(GenerationResult(request.request_id, choices, len(request.prompt), completion,
                                                   max(s.cached_tokens for s in run.streams),
                                                   run.streams[0].prompt_logprobs))


def _lora_rank(folder: Path) -> int | None:
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return None
    ranks = [config.get("r")] + list((config.get("rank_pattern") or {}).values())
    ranks = [r for r in ranks if isinstance(r, int)]
    return max(ranks) if ranks else None


def _cores() -> int:
    """OMP_NUM_THREADS where the worker was given a share of the cores, else every core it may run on."""
    import os

    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
