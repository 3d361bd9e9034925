"""Turns at an inference worker's model, round robin over tenants: a share per tenant instead of arrival order.

An inference worker (embeddings, classify) runs its tasks in threads; each task computes its inputs in batches of
TRAINSERVE_INFERENCE_BATCH_SIZE and takes a turn for every batch. One batch runs at a time and the next turn goes to
the waiting tenant served longest ago, so a tenant's 2,048-input request runs a batch, then another tenant's
one-sentence request runs its batch, then the long request goes on. Within a tenant, batches go in arrival order.
A waiting batch whose caller has gone (disconnected, timed out) is dropped when its turn comes: Abandoned.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# How often a waiting batch re-checks whether its caller has gone (a Redis read), in seconds.
RECHECK_S = 1.0
# Tenants whose last turn is remembered; one forgotten counts as never served (it goes first once).
SERVED_KEPT = 1024


class Abandoned(Exception):
    """The caller stopped waiting; the rest of its work is dropped."""


class FairTurns:
    """One holder at a time; the next turn goes round robin over the tenants with waiters."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: dict[str, deque[object]] = {}  # tenants with waiters, each its tickets in arrival order
        self._served: dict[str, int] = {}  # when each tenant was last granted a turn (a grant counter)
        self._grants = 0
        self._busy = False
        self._granted: object | None = None

    @contextmanager
    def turn(self, tenant: str, gone: Callable[[], bool] = lambda: False) -> Iterator[None]:
        """Hold the model for one batch; Abandoned (before it runs) once `gone()` says the caller left."""
        ticket = object()
        with self._cond:
            self._waiting.setdefault(tenant, deque()).append(ticket)
            self._grant()
            try:
                while self._granted is not ticket:
                    if not self._cond.wait(timeout=RECHECK_S) and gone():
                        raise Abandoned(f"a batch of tenant {tenant!r}: its caller has gone")
            except BaseException:
                self._withdraw(tenant, ticket)
                raise
        try:
            if gone():
                raise Abandoned(f"a batch of tenant {tenant!r}: its caller has gone")
            yield
        finally:
            with self._cond:
                self._busy, self._granted = False, None
                self._grant()

    def _grant(self) -> None:
        """Give the free model to the first waiter of the waiting tenant served longest ago (or never): a tenant
        whose batch just ran goes after every other tenant waiting, even one that arrived after its next batch."""
        if self._busy or not self._waiting:
            return
        tenant = min(self._waiting, key=lambda t: self._served.get(t, -1))
        tickets = self._waiting[tenant]
        self._granted = tickets.popleft()
        if not tickets:
            del self._waiting[tenant]
        self._grants += 1
        self._served[tenant] = self._grants
        if len(self._served) > SERVED_KEPT:  # forget the tenants served longest ago (they count as never served)
            for old in sorted(self._served, key=self._served.__getitem__)[:len(self._served) - SERVED_KEPT]:
                del self._served[old]
        self._busy = True
        self._cond.notify_all()

    def _withdraw(self, tenant: str, ticket: object) -> None:
        if self._granted is ticket:  # granted just as it gave up: pass the turn on
            self._busy, self._granted = False, None
        else:
            tickets = self._waiting.get(tenant)
            if tickets is not None and ticket in tickets:
                tickets.remove(ticket)
                if not tickets:
                    del self._waiting[tenant]
        self._grant()
