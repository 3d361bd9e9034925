"""Running a chunk of batch lines on a generation worker: generation requests submitted to the engines at once,
no streaming, within a share of the engine's rows that shrinks while interactive requests are in it; embeddings
in length-sorted groups on the worker's encoder, giving way to interactive generation between groups (Pacer).

LINE_HANDLERS maps a batch endpoint to the function that runs its lines; an endpoint without an entry answers each
line with an error (app.services.batch_plan.PLANNERS is the API's side of the same table).
"""

from __future__ import annotations

import base64
import hashlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.batches import LineError, PlannedLine
from core.protocol import ErrorCode, ErrorEvent, GenerateTask, Usage
from worker.context import WorkerContext
from worker.servers.chat_plan import ChatPlan, plan_chat
from worker.servers.embeddings import embedder_for
from worker.servers.generation import GenerationService, choice_out, engine_fit

if TYPE_CHECKING:
    from worker.engines.generation.requests import GenerationResult
    from worker.engines.serving import ServingEngine

QUEUE_FULL_PAUSE_S = 0.05  # the engine's waiting queue is full of interactive requests: let them go first
PACE_POLL_S = 0.02  # how soon a batch at its share looks again (a decode step of a small model)
# Interactive clients leave gaps between requests (a round trip, the API): rows a batch took in such a gap would
# hold the next request back for a whole batch request's decode, so the batch stays at `busy` for a while.
BUSY_HOLD_S = 2.0
EMBED_GROUP = 32  # embedding inputs run between two looks at the interactive traffic


@dataclass
class Outcome:
    """A line's answer: the HTTP status and body the interactive route would have given."""

    status_code: int
    body: dict[str, Any]


LineHandler = Callable[[WorkerContext, str, list[tuple[int, PlannedLine]], "Pacer"], dict[int, Outcome]]


def error_outcome(error: LineError) -> Outcome:
    """OpenAI's error body for a line that could not run."""
    kind = "server_error" if error.status_code >= 500 else "invalid_request_error"
    return Outcome(error.status_code, {"error": {"message": error.message, "type": kind, "param": error.param,
                                                 "code": error.code}})


def digest(*parts: object) -> str:
    """A stable hex id for a line (the same after a redelivery): 24 hex digits."""
    return hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:24]


def _reason(reason: str | None) -> str | None:
    return None if reason is None else "length" if reason == "length" else "stop"


def _usage(result: Any) -> dict[str, Any]:
    return Usage(prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
                 cached_tokens=result.cached_tokens).openai()


def chat_body(line: PlannedLine, result: Any, rid: str, plan: ChatPlan | None = None) -> dict[str, Any]:
    """A ChatCompletion, as /v1/chat/completions answers it (content, tool calls and reasoning apart)."""
    wants = line.params is not None and line.params.logprobs is not None
    choices = []
    for engine_choice in result.choices:
        parser = plan.parser() if plan is not None else None
        if parser is not None:
            parser.feed(engine_choice.text)
        c = choice_out(engine_choice, parser)
        message: dict[str, Any] = {"role": "assistant", "content": c.text if c.text or not c.tool_calls else None,
                                   "refusal": None}
        if c.tool_calls:
            message["tool_calls"] = c.tool_calls
        if c.reasoning:
            message["reasoning_content"] = c.reasoning
        reason = "tool_calls" if c.finish_reason == "tool_calls" else _reason(c.finish_reason)
        choices.append({"index": c.index, "message": message, "finish_reason": reason,
                        "logprobs": {"content": [e.model_dump() for e in c.logprobs or []]} if wants else None})
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()), "model": line.model,
            "choices": choices, "usage": _usage(result)}


def completion_body(line: PlannedLine, result: Any, rid: str, plan: ChatPlan | None = None) -> dict[str, Any]:
    """A Completion, as /v1/completions answers it (without logprobs: the plan refuses them)."""
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()), "model": line.model,
            "choices": [{"text": c.text, "index": c.index, "logprobs": None, "finish_reason": _reason(c.finish_reason)}
                        for c in result.choices],
            "usage": _usage(result)}


def _prompt_ids(engine: ServingEngine, line: PlannedLine, request_id: str
                ) -> tuple[list[int], PlannedLine, ChatPlan | None] | LineError:
    assert line.params is not None and line.path is not None
    plan: ChatPlan | None = None
    if line.messages is not None:
        task = GenerateTask(request_id=request_id, model=line.path, prompt="", messages=line.messages,
                            chat=line.chat, params=line.params, tokens_field=line.tokens_field,
                            deadline=time.time() + 60)
        planned = plan_chat(engine, task)
        if isinstance(planned, ErrorEvent):
            return LineError(status_code=422, code=planned.error.code, message=planned.error.message or "",
                             param=planned.error.field)
        plan, ids, line = planned, planned.ids, line.model_copy(update={"params": planned.params})
    else:
        ids = engine.encode(line.prompt or "")
    if not ids:
        return LineError(status_code=422, code=ErrorCode.VALIDATION_ERROR, message="the prompt encodes to no tokens",
                         param="prompt")
    refusal = engine_fit(engine, len(ids), line.params, line.tokens_field) if line.params else None
    if refusal is not None:
        return LineError(status_code=422, code=ErrorCode.VALIDATION_ERROR, message=refusal.message,
                         param=refusal.field)
    return ids, line, plan


def _submit(engine: ServingEngine, ids: list[int], line: PlannedLine, request_id: str, tenant: str | None
            ) -> Future[GenerationResult]:
    """Submit as a batch line of `tenant` (admitted after interactive requests, within the tenant's share of the
    engine's rows), waiting while the engine's queue is full (interactive requests fill it first)."""
    from worker.engines.generation.engine import QueueFull

    while True:
        try:
            # A LoRA adapter job's lines run over its base, in the base's batches.
            return engine.submit(ids, line.params, request_id=request_id, adapter=line.adapter, tenant=tenant,
                                 batch=True)
        except QueueFull:
            time.sleep(QUEUE_FULL_PAUSE_S)


@dataclass(frozen=True)
class Share:
    """Rows of an engine one batch may hold: `busy` while interactive requests are in it, `idle` while none are;
    `time`: the fraction of the time work outside the engines (embeddings) takes while interactive requests run."""

    busy: int
    idle: int
    time: float = 1.0


class Pacer:
    """Keeps a batch's requests in an engine within its share, re-read before each submit: a batch backs off to
    `busy` rows as soon as interactive requests arrive (the engine admits interactive requests before batch
    lines, so rows it does not hold are rows an interactive request is admitted to at once) and fills `idle` rows
    only once the engine has had no interactive request for BUSY_HOLD_S. One per batch run, so the memory of
    interactive traffic spans chunks."""

    def __init__(self, share: Share, tenant: str | None = None) -> None:
        self.share = share
        self.tenant = tenant  # the batch's owner: its lines count toward that tenant's share in the engine
        self.in_flight = 0  # submitted and not finished (waiting or running in the engine)
        self._busy_at = float("-inf")  # when interactive requests were last seen in the engine
        self._changed = threading.Condition()

    def submit(self, engine: ServingEngine, ids: list[int], line: PlannedLine, request_id: str
               ) -> Future[GenerationResult]:
        """Submit once the batch holds fewer rows than its share allows now; the row frees when it finishes."""
        while True:
            limit = self._limit(engine)  # outside the condition: the engine's lock is never taken inside it
            with self._changed:
                if self.in_flight < limit:
                    self.in_flight += 1
                    break
                self._changed.wait(PACE_POLL_S)  # interactive requests leaving do not notify: look again soon
        try:
            future = _submit(engine, ids, line, request_id, self.tenant)
        except BaseException:
            self._done()
            raise
        future.add_done_callback(lambda _: self._done())
        return future

    def _done(self) -> None:
        with self._changed:
            self.in_flight -= 1
            self._changed.notify()

    def _limit(self, engine: ServingEngine) -> int:
        stats = engine.stats()
        now = time.monotonic()
        if stats["running"] + stats["waiting"] > self.in_flight:
            self._busy_at = now
        return self.share.busy if now - self._busy_at < BUSY_HOLD_S else self.share.idle

    def give_way(self, engines: list[ServingEngine], spent_s: float) -> float:
        """After `spent_s` of batch work outside the engines: while requests are in any engine (or were within
        BUSY_HOLD_S), pause so the batch takes about `share.time` of the time; the pause in seconds."""
        now = time.monotonic()
        if any(stats["running"] + stats["waiting"] > 0 for stats in (engine.stats() for engine in engines)):
            self._busy_at = now
        if now - self._busy_at >= BUSY_HOLD_S or self.share.time >= 1:
            return 0.0
        pause = spent_s * (1 - self.share.time) / self.share.time
        time.sleep(pause)
        return pause


def run_generation(body: Callable[[PlannedLine, Any, str, ChatPlan | None], dict[str, Any]]) -> LineHandler:
    """The line handler of a generation endpoint: the chunk's lines submitted at once, within the batch's share."""

    def run(ctx: WorkerContext, batch_id: str, lines: list[tuple[int, PlannedLine]], pacer: Pacer
            ) -> dict[int, Outcome]:
        service = ctx.service("generation", GenerationService.build)
        outcomes: dict[int, Outcome] = {}
        pending: list[tuple[int, PlannedLine, str, Future[Any], ChatPlan | None]] = []
        with ExitStack() as stack:
            engines: dict[str, Any] = {}
            for index, line in lines:
                rid = digest(batch_id, index)
                path = line.path or ""
                try:
                    if path not in engines:
                        engines[path] = stack.enter_context(service.registry.use(path))
                    prepared = _prompt_ids(engines[path], line, f"batch-{rid}")
                    if isinstance(prepared, LineError):
                        outcomes[index] = error_outcome(prepared)
                        continue
                    ids, line, plan = prepared
                    future = pacer.submit(engines[path], ids, line, f"batch-{rid}")
                except Exception as exc:  # noqa: BLE001 - this line fails (e.g. its model cannot load), not the batch
                    outcomes[index] = _failure(exc)
                    continue
                pending.append((index, line, rid, future, plan))
            for index, line, rid, future, plan in pending:
                try:
                    outcomes[index] = Outcome(200, body(line, future.result(), rid, plan))
                except Exception as exc:  # noqa: BLE001 - a failed forward fails its lines only
                    outcomes[index] = _failure(exc)
        return outcomes

    return run


def _failure(exc: Exception) -> Outcome:
    status = 422 if isinstance(exc, ValueError) else 500
    code = ErrorCode.VALIDATION_ERROR if status == 422 else ErrorCode.WORKER_ERROR
    return error_outcome(LineError(status_code=status, code=code, message=f"{type(exc).__name__}: {exc}"))


def embedding_body(line: PlannedLine, vectors: Any, tokens: int) -> dict[str, Any]:
    """A CreateEmbeddingResponse, as /v1/embeddings answers it (base64: little-endian float32)."""
    little = vectors.astype("<f4", copy=False)
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(row.tobytes()).decode("ascii") if line.encoding_format == "base64"
             else row.tolist()} for i, row in enumerate(little)]
    return {"object": "list", "data": data, "model": line.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def run_embeddings(ctx: WorkerContext, batch_id: str, lines: list[tuple[int, PlannedLine]], pacer: Pacer
                   ) -> dict[int, Outcome]:
    """Embed the chunk's lines: inputs of every line with the same model and `dimensions` in length-sorted groups
    of EMBED_GROUP, each followed by Pacer.give_way; a refused input fails its line only."""
    from worker.engines.encoders.embedder import EmbeddingRefused

    outcomes: dict[int, Outcome] = {}
    groups: dict[tuple[str, int | None], list[tuple[int, PlannedLine, list[list[int]]]]] = {}
    for index, line in lines:
        try:
            ids = embedder_for(ctx, line.path or "").tokenize(line.texts, line.token_ids)
        except EmbeddingRefused as exc:
            outcomes[index] = error_outcome(LineError(status_code=422, code=ErrorCode.VALIDATION_ERROR,
                                                      message=str(exc), param=exc.field))
            continue
        except Exception as exc:  # noqa: BLE001 - e.g. its model cannot load: this line fails, not the batch
            outcomes[index] = _failure(exc)
            continue
        groups.setdefault((line.path or "", line.dimensions), []).append((index, line, ids))
    registry = ctx.service("generation", GenerationService.build).registry
    for (path, dimensions), members in groups.items():
        try:
            vectors = _embed_paced(embedder_for(ctx, path), [row for *_, ids in members for row in ids],
                                   dimensions, lambda spent: pacer.give_way(registry.engines(), spent))
        except EmbeddingRefused as exc:  # dimensions the model cannot give: every line asking for them
            refused = LineError(status_code=422, code=ErrorCode.VALIDATION_ERROR, message=str(exc), param=exc.field)
            outcomes.update({index: error_outcome(refused) for index, *_ in members})
            continue
        except Exception as exc:  # noqa: BLE001 - a failed forward fails its lines only
            outcomes.update({index: _failure(exc) for index, *_ in members})
            continue
        start = 0
        for index, line, ids in members:
            outcomes[index] = Outcome(200, embedding_body(line, vectors[start:start + len(ids)],
                                                          sum(map(len, ids))))
            start += len(ids)
    return outcomes


def _embed_paced(embedder: Any, rows: list[list[int]], dimensions: int | None,
                 give_way: Callable[[float], float]) -> Any:
    """[rows, width] vectors in input order, computed EMBED_GROUP rows at a time (shortest first)."""
    import numpy as np

    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    out = np.zeros((len(rows), embedder.check_dimensions(dimensions)), dtype=np.float32)
    for start in range(0, len(order), EMBED_GROUP):
        group = order[start:start + EMBED_GROUP]
        began = time.monotonic()
        out[group] = embedder.embed([rows[i] for i in group], dimensions, batch_size=EMBED_GROUP)
        give_way(time.monotonic() - began)
    return out


LINE_HANDLERS: dict[str, LineHandler] = {
    "/v1/chat/completions": run_generation(chat_body),
    "/v1/completions": run_generation(completion_body),
    "/v1/embeddings": run_embeddings,
}
