"""How a request ends, and the engine's running totals: its future resolves with its result (finished, or cancelled
with the text so far) or an error (failed, waited past its deadline, the engine closed), each counted once; its
text deltas reach its callback, a callback that raises failing its own request only. The client (engine.py) and
the step loop (step_loop.py) share one Endings; its counters are written under the engine's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from core.protocol import TokenLogprob
from worker.engines.generation.requests import DeadlineExceeded, Request

COUNTERS = ("steps", "prefills", "prompt_tokens", "generated_tokens", "completed", "cancelled", "expired", "failed",
            "peak_running_sequences", "speculative_steps", "draft_tokens", "accepted_draft_tokens",
            "cached_prompt_tokens")


class Endings:
    """Resolves requests' futures and streams their text; holds the counters stats() reports."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self.counters = dict.fromkeys(COUNTERS, 0)

    def count(self, **deltas: int) -> None:
        """Add to the running totals."""
        with self._lock:
            for name, delta in deltas.items():
                self.counters[name] += delta

    def peak(self, rows: int) -> None:
        """The batch held `rows` rows."""
        with self._lock:
            self.counters["peak_running_sequences"] = max(self.counters["peak_running_sequences"], rows)

    def complete(self, request: Request) -> None:
        """Every choice finished: the result."""
        request.done = True
        self.count(completed=1)
        request.future.set_result(request.result())

    def fail(self, request: Request, error: BaseException) -> None:
        """The request fails with `error` (nothing, if it has ended already)."""
        if request.done:
            return
        request.done = True
        self.count(failed=1)
        request.future.set_exception(error)

    def expire(self, request: Request, why: str) -> None:
        """The request's deadline passed before it started."""
        self.count(expired=1)
        request.future.set_exception(DeadlineExceeded(why))

    def cancel(self, request: Request) -> None:
        """Dropped before its rows decoded (its caller went away): empty cancelled choices, unless its poll failed it
        or its caller cancelled the future itself."""
        if request.done:
            return
        request.done = True
        self.count(cancelled=1)
        if not request.future.cancelled():
            request.future.set_result(request.result())

    def dropped(self, expired: Iterable[Request], cancelled: Iterable[Request],
                failed: Iterable[tuple[Request, BaseException]]) -> None:
        """What one admission pass dropped while it waited ends: expired, cancelled, failed (e.g. its adapter)."""
        for request in expired:
            self.expire(request, f"request {request.request_id} waited past its deadline")
        for request in cancelled:
            self.cancel(request)
        for request, error in failed:
            self.fail(request, error)

    def close(self, requests: Iterable[Request], error: BaseException) -> None:
        """The engine closed: every request not ended yet fails with `error` (uncounted)."""
        for request in requests:
            if not request.done and not request.future.done():
                request.done = True
                request.future.set_exception(error)

    def cancelled(self, request: Request, flagged: frozenset[str] = frozenset()) -> bool:
        """Whether the request's caller went away: named by the cancel hook, or its is_cancelled says so (a poll
        that raises fails the request, and counts as gone)."""
        if request.request_id in flagged:
            return True
        if request.is_cancelled is None:
            return False
        try:
            return bool(request.is_cancelled())
        except Exception as error:  # noqa: BLE001
            self.fail(request, error)
            return True

    def emit(self, request: Request, index: int, delta: str, logprobs: list[TokenLogprob] | None = None) -> None:
        """Stream a text delta of choice `index` to the request's callback."""
        assert request.on_token is not None
        try:
            if request.params.logprobs is not None:  # such a request's callback takes the delta's logprobs too
                request.on_token(index, delta, logprobs or [])
            else:
                request.on_token(index, delta)
        except Exception as error:  # noqa: BLE001 - a broken callback fails its own request only
            self.fail(request, error)
