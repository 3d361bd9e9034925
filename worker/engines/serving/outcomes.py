"""How a generation request ends: its text deltas streamed to the caller, cancellation, completion, failure, and
the engine's shutdown. Mixed into GenerationEngine, whose scheduler thread alone calls these."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from core.protocol import TokenLogprob
from worker.engines.serving.requests import EngineClosed, Request, SequenceState


class RequestOutcomes:
    """The scheduler's bookkeeping of how requests end (the engine holds the state these read and write)."""

    _lock: threading.RLock
    _counters: dict[str, int]
    _rows: list[SequenceState]
    _waiting: deque[Request]
    _runner: Any
    _prefilling: Any  # prefill.PrefillQueue: started requests whose prompts are not all in the cache yet
    _tokens_in_flight: int
    _sweep: Callable[[], None]  # GenerationEngine's: removes finished rows and resolves completed requests

    def _emit(self, request: Request, index: int, delta: str, logprobs: list[TokenLogprob] | None = None) -> None:
        try:
            if request.params.logprobs is not None:  # such a request's callback takes the delta's logprobs too
                request.on_token(index, delta, logprobs or [])
            else:
                request.on_token(index, delta)
        except Exception as error:  # noqa: BLE001 - a broken callback fails its own request only
            self._fail(request, error)

    def _cancelled(self, request: Request, flagged: frozenset[str] = frozenset()) -> bool:
        if request.request_id in flagged:
            return True
        if request.is_cancelled is None:
            return False
        try:
            return bool(request.is_cancelled())
        except Exception as error:  # noqa: BLE001
            self._fail(request, error)
            return True

    def _poll_cancelled(self, flagged: frozenset[str] = frozenset()) -> None:
        # Requests still being prefilled: dropped at once (a long prompt's remaining chunks are not run).
        dropped = [r for r in self._prefilling.requests
                   if (r.is_cancelled is not None or r.request_id in flagged) and self._cancelled(r, flagged)]
        self._prefilling.remove(dropped)
        for request in dropped:
            with self._lock:
                self._tokens_in_flight -= request.cost
                self._counters["cancelled"] += not request.done
            if not request.done:  # (is_cancelled raised: already failed)
                request.done = True
                request.future.set_result(request.result())
        requests = {id(s.request): s.request for s in self._rows
                    if s.request.is_cancelled is not None or s.request.request_id in flagged}
        hit = False
        for request in requests.values():
            if request.done or not self._cancelled(request, flagged):
                continue
            hit = True
            if request.done:  # is_cancelled raised: the request has already failed
                continue
            for index, delta in request.cancel():
                if request.on_token is not None:
                    self._emit(request, index, delta)
            with self._lock:
                self._counters["cancelled"] += 1
        if hit:
            self._sweep()

    def _complete(self, request: Request) -> None:
        request.done = True
        with self._lock:
            self._counters["completed"] += 1
        request.future.set_result(request.result())

    def _fail(self, request: Request, error: BaseException) -> None:
        if request.done:
            return
        request.done = True
        with self._lock:
            self._counters["failed"] += 1
        request.future.set_exception(error)

    def _shutdown(self) -> None:
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
        error = EngineClosed("the generation engine was closed")
        for request in [*waiting, *self._prefilling.requests, *(s.request for s in self._rows)]:
            if not request.done and not request.future.done():
                request.done = True
                request.future.set_exception(error)
        self._rows.clear()
        self._runner.release()
