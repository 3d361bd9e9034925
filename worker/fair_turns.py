"""Turns at an inference worker's model, round robin over tenants: a share per tenant instead of arrival order.

An inference worker (embeddings, classify) runs its tasks in threads; each task computes its inputs in batches and
takes a turn for every batch. One batch runs at a time, and when it ends the next turn goes to the tenant after the
last one served that has a batch waiting, so a tenant's 2,048-input request runs a batch, then another tenant's
one-sentence request runs its batch, then the long request goes on. Within a tenant, batches go in arrival order.
A waiting batch whose caller has gone (disconnected, timed out) is dropped when its turn comes: Abandoned.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# How often a waiting batch re-checks whether its caller has gone (a Redis read), in seconds.
RECHECK_S = 1.0


class Abandoned(Exception):
    """The caller stopped waiting; the rest of its work is dropped."""


class FairTurns:
    """One holder at a time; the next turn goes round robin over the tenants with waiters."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: OrderedDict[str, deque[object]] = OrderedDict()  # rotation order of tenants with waiters
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
        """Give the free model to the first waiter of the next tenant in rotation (that tenant then goes last)."""
        if self._busy or not self._waiting:
            return
        tenant, tickets = next(iter(self._waiting.items()))
        self._granted = tickets.popleft()
        self._busy = True
        del self._waiting[tenant]
        if tickets:
            self._waiting[tenant] = tickets  # to the back of the rotation
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
