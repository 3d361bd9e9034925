"""A job on several nodes: what the worker heading it and the workers joining it say to each other.

The head is the worker that claimed the job (core.job_order, as any job): node 0, whose rank 0 reports. It sends
one GangCall per other node as a TASK_JOIN message on the job's size queue, so an idle worker owning enough devices
takes each. A joining worker checks that the row still runs that attempt (the row is the truth: a call of an
earlier attempt is dropped), fetches the job's inputs, pushes a GangAnswer on the attempt's Redis list and starts
its node's ranks against the head's rendezvous. The head gathers the answers until the call's deadline; when a node
is missing or refused, it puts the job back in the queue instead of holding its devices.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis
from pydantic import BaseModel, Field

from core.redis_keys import gang_key
from core.tasks import MAX_JOB_NODES


class GangCall(BaseModel):
    """The head's call to one more node of a job's attempt: where the rendezvous is, and as which node to join."""

    job_id: str
    attempt: int = Field(ge=1)  # the fencing token of the claim: the joining worker serves this attempt only
    node_rank: int = Field(ge=1, lt=MAX_JOB_NODES)
    nodes: int = Field(ge=2, le=MAX_JOB_NODES)
    devices: int = Field(ge=1)  # per node
    address: str = Field(min_length=1)  # the head's address, reachable from every node
    port: int = Field(ge=1, le=65535)  # the head's rendezvous port
    deadline: float  # Unix time: a worker that takes the call later ignores it (the head stopped waiting)

    @property
    def world_size(self) -> int:
        """Processes of the whole run."""
        return self.nodes * self.devices


class GangAnswer(BaseModel):
    """A joining worker's answer to a GangCall: ready (inputs fetched, ranks starting), or why it cannot join."""

    node_rank: int
    worker: str  # host and process id, for the job's events and the logs
    ready: bool
    reason: str = ""


class GangIncomplete(Exception):
    """The other nodes did not all join before the deadline (or one refused): the attempt gives the job back."""


def calls(*, job_id: str, attempt: int, nodes: int, devices: int, address: str, port: int,
          deadline: float) -> list[GangCall]:
    """One call per node but the head's, node ranks 1 to nodes - 1."""
    return [GangCall(job_id=job_id, attempt=attempt, node_rank=rank, nodes=nodes, devices=devices, address=address,
                     port=port, deadline=deadline) for rank in range(1, nodes)]


def answer(client: redis.Redis, call: GangCall, reply: GangAnswer) -> None:
    """Push a joining worker's answer where the head gathers them (kept a while past the deadline, then gone)."""
    key = gang_key(call.job_id, call.attempt)
    pipe = client.pipeline()
    pipe.rpush(key, reply.model_dump_json())
    pipe.expireat(key, int(call.deadline) + 60)
    pipe.execute()


def gather(client: redis.Redis, *, job_id: str, attempt: int, nodes: int, deadline: float,
           now: Callable[[], float] = time.time) -> list[GangAnswer]:
    """Wait for a ready answer from each of the nodes - 1 others until `deadline`; GangIncomplete otherwise."""
    key = gang_key(job_id, attempt)
    ready: dict[int, GangAnswer] = {}
    try:
        while len(ready) < nodes - 1:
            left = deadline - now()
            if left <= 0:
                raise GangIncomplete(f"{len(ready) + 1} of {nodes} nodes joined in time")
            popped: list[bytes] | None = client.blpop([key], timeout=max(0.1, min(left, 5.0)))  # type: ignore[assignment]
            if popped is None:
                continue
            reply = GangAnswer.model_validate_json(popped[1])
            if not reply.ready:
                raise GangIncomplete(f"node {reply.node_rank} ({reply.worker}) could not join: {reply.reason}")
            ready[reply.node_rank] = reply
    finally:
        client.delete(key)
    return [ready[rank] for rank in sorted(ready)]
