"""Turns at an inference worker's model, fair over tenants in compute time: a share per tenant, not arrival order.

An inference worker (embeddings, classify) runs its tasks in threads; each task computes its inputs in batches of
at most TRAINSERVE_INFERENCE_BATCH_SIZE inputs and TRAINSERVE_INFERENCE_TURN_TOKENS padded tokens, and takes a turn
for every batch. One batch runs at a time. Each tenant is charged the seconds its batches held the model (its
virtual time, as a fair-queueing scheduler or Linux's CFS keeps it), and the model goes to the waiting tenant with
the least. A tenant arriving after being idle starts at the least virtual time of the tenants busy now, less
ARRIVAL_CREDIT_S: it cannot bank idle time, but its first request runs ahead of a tenant that has been computing.

A batch is also paused between the model's layers (`pause`, called by hooks the engines put on each layer): when a
waiting tenant has used PREEMPT_S less than the running batch's tenant, the batch gives the model up and resumes,
ahead of its own tenant's other batches, when its tenant's turn comes again. So another tenant's one-sentence
request waits for one layer of a long request's batch, not the whole batch. Within a tenant, batches go in arrival
order. A waiting batch whose caller has gone (disconnected, timed out) is dropped when its turn comes: Abandoned.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# How often a waiting batch re-checks whether its caller has gone (a Redis read), in seconds.
RECHECK_S = 1.0
# Tenants whose virtual time is remembered; one forgotten starts again at the busy tenants' least, less the credit.
KEPT = 1024
# Compute seconds a tenant arriving after being idle is put ahead of the tenants computing now.
ARRIVAL_CREDIT_S = 0.25
# How far behind (in compute seconds) a waiting tenant must be for a running batch to pause for it at a layer.
PREEMPT_S = 0.02

Pause = Callable[[], None]


class Abandoned(Exception):
    """The caller stopped waiting; the rest of its work is dropped."""


class _Ticket:
    """One batch's claim on the model."""

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        self.thread = threading.get_ident()


class FairTurns:
    """One holder at a time; the model goes to the waiting tenant with the least compute time charged."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._waiting: dict[str, deque[_Ticket]] = {}  # tenants with waiters, each its tickets in arrival order
        self._vtime: dict[str, float] = {}  # compute seconds charged per tenant (relative to the others)
        self._floor = 0.0  # the least virtual time of the tenants busy at the last grant (never goes back)
        self._granted: _Ticket | None = None  # the batch holding the model
        self._since = 0.0  # when the holder's current stretch began (charged at a pause or at release)

    @contextmanager
    def turn(self, tenant: str, gone: Callable[[], bool] = lambda: False) -> Iterator[Pause]:
        """Hold the model for one batch; Abandoned (before it runs) once `gone()` says the caller left. Yields the
        pause to call between the batch's layers (it may give the model to a tenant behind and wait to get it back)."""
        ticket = _Ticket(tenant)
        with self._cond:
            if not self._busy_with(tenant):
                self._arrive(tenant)
            self._waiting.setdefault(tenant, deque()).append(ticket)
            self._grant()
            try:
                while self._granted is not ticket:
                    if not self._cond.wait(timeout=RECHECK_S) and gone():
                        raise Abandoned(f"a batch of tenant {tenant!r}: its caller has gone")
            except BaseException:
                self._withdraw(ticket)
                raise
        try:
            if gone():
                raise Abandoned(f"a batch of tenant {tenant!r}: its caller has gone")
            yield lambda: self._pause(ticket)
        finally:
            with self._cond:
                if self._granted is ticket:
                    self._charge(ticket)
                    self._granted = None
                    self._grant()

    def charged(self, tenant: str) -> float:
        """The compute seconds charged to `tenant` (its virtual time)."""
        with self._cond:
            return self._vtime.get(tenant, 0.0)

    def _busy_with(self, tenant: str) -> bool:
        return tenant in self._waiting or (self._granted is not None and self._granted.tenant == tenant)

    def _arrive(self, tenant: str) -> None:
        """A tenant with nothing waiting or running comes (back): no less than the busy tenants' least, less the
        credit (idle time is not banked), and no more than it had."""
        busy = [self._vtime.get(t, 0.0) for t in self._waiting]
        if self._granted is not None:
            busy.append(self._vtime.get(self._granted.tenant, 0.0))
        floor = max(self._floor, min(busy)) if busy else self._floor  # arrivals do not chain their credits
        self._vtime[tenant] = max(self._vtime.get(tenant, floor - ARRIVAL_CREDIT_S), floor - ARRIVAL_CREDIT_S)
        if len(self._vtime) > KEPT:  # forget idle tenants charged the most (they start again at the floor)
            idle = sorted((t for t in self._vtime if not self._busy_with(t) and t != tenant),
                          key=self._vtime.__getitem__, reverse=True)
            for old in idle[:len(self._vtime) - KEPT]:
                del self._vtime[old]

    def _grant(self) -> None:
        """Give the free model to the first waiter of the waiting tenant charged least."""
        if self._granted is not None or not self._waiting:
            return
        tenant = min(self._waiting, key=lambda t: self._vtime.get(t, 0.0))
        self._floor = max(self._floor, self._vtime.get(tenant, 0.0))
        tickets = self._waiting[tenant]
        self._granted = tickets.popleft()
        if not tickets:
            del self._waiting[tenant]
        self._since = self._clock()
        self._cond.notify_all()

    def _charge(self, ticket: _Ticket) -> None:
        now = self._clock()
        self._vtime[ticket.tenant] = self._vtime.get(ticket.tenant, 0.0) + (now - self._since)
        self._since = now

    def _pause(self, ticket: _Ticket) -> None:
        """Between layers: give the model up while a waiting tenant is PREEMPT_S behind, then wait for it back
        (first among the tenant's batches). A no-op off the holder's thread (a model called outside a turn)."""
        if self._granted is not ticket or threading.get_ident() != ticket.thread:
            return
        with self._cond:
            self._charge(ticket)
            mine = self._vtime[ticket.tenant]
            if not any(self._vtime.get(t, 0.0) + PREEMPT_S < mine for t in self._waiting if t != ticket.tenant):
                return
            self._waiting.setdefault(ticket.tenant, deque()).appendleft(ticket)
            self._granted = None
            self._grant()
            while self._granted is not ticket:
                self._cond.wait()

    def _withdraw(self, ticket: _Ticket) -> None:
        if self._granted is ticket:  # granted just as it gave up: pass the turn on
            self._granted = None
        else:
            tickets = self._waiting.get(ticket.tenant)
            if tickets is not None and ticket in tickets:
                tickets.remove(ticket)
                if not tickets:
                    del self._waiting[ticket.tenant]
        self._grant()
