"""A job on several nodes, from each worker's side: the head calls the others and runs node 0; a joining worker runs
one more node and writes nothing about the job (core.gang tells the exchange).

    head:  claim (lifecycle) -> send nodes - 1 GangCalls -> gather the answers -> torchrun as node 0, rank 0 reporting
    join:  take a call -> the row still runs that attempt? -> fetch inputs and checkpoint -> answer -> torchrun as
           node i, until its ranks end or the row leaves that attempt (cancelled, requeued, finished)
A node lost mid-run breaks the collectives: the head's launch fails (code node_lost) and the lifecycle requeues the
job, which resumes from its last stored checkpoint on a gang formed anew.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from core import gang
from core.db import session_scope
from core.rows import Job, JobStatus
from core.settings import Settings
from core.tasks import TASK_JOIN, train_queue
from worker.context import WorkerContext
from worker.engines.training.launch import Rendezvous, join_run, train_on_devices
from worker.engines.training.loop import TrainCallbacks, TrainResult
from worker.jobs.config import EngineConfig, config_for, job_inputs, resolve_job
from worker.jobs.sync import pull_checkpoint
from worker.model_store import storage_errors

log = logging.getLogger(__name__)

JOINED, DROPPED, REFUSED = "joined", "dropped", "refused"  # how a join ended, for the logs


def advertised_address(settings: Settings) -> str:
    """The address other hosts reach this worker on (TRAINSERVE_WORKER_ADDRESS, else the host's name)."""
    return settings.worker_address or socket.gethostname()


def rendezvous_port(settings: Settings) -> int:
    """The port this head serves its rendezvous on: the setting, else one the kernel has free now."""
    if settings.rendezvous_port:
        return settings.rendezvous_port
    with socket.socket() as probe:  # freed at once; torchrun binds it a moment later
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def lead(ctx: WorkerContext, job_id: str, attempt: int, config: EngineConfig, callbacks: TrainCallbacks) -> TrainResult:
    """Call the other nodes, wait until each is ready (GangIncomplete otherwise), then run node 0."""
    settings = ctx.settings
    deadline = time.time() + settings.gang_timeout_s
    meet = Rendezvous(node_rank=0, nodes=config.nodes, address=advertised_address(settings),
                      port=rendezvous_port(settings), timeout_s=settings.gang_timeout_s)
    for call in gang.calls(job_id=job_id, attempt=attempt, nodes=config.nodes, devices=config.devices,
                           address=meet.address, port=meet.port, deadline=deadline):
        ctx.queue.send(TASK_JOIN, [call.model_dump(mode="json")], queue=train_queue(config.devices))
    joined = gang.gather(ctx.redis, job_id=job_id, attempt=attempt, nodes=config.nodes, deadline=deadline)
    log.info("job %s attempt %d: nodes joined (%s); rendezvous on %s:%d", job_id, attempt,
             ", ".join(f"{a.node_rank}: {a.worker}" for a in joined), meet.address, meet.port)
    return train_on_devices(config, callbacks, meet)


def join(ctx: WorkerContext, payload: dict[str, Any]) -> str:
    """Serve one GangCall: run node `node_rank` of the job's attempt while the row says that attempt runs."""
    call = gang.GangCall.model_validate(payload)
    if time.time() > call.deadline:
        log.info("job %s attempt %d: the call for node %d came too late", call.job_id, call.attempt, call.node_rank)
        return DROPPED
    worker = f"{socket.gethostname()}:{os.getpid()}"
    with session_scope(ctx.sessions) as session:
        job = session.get(Job, call.job_id)
        if job is None or job.status != JobStatus.RUNNING or job.attempts != call.attempt:
            return DROPPED  # an earlier attempt's call: nobody waits for it
        if job.devices > ctx.settings.worker_devices:  # routed by queue, so only a hand-made consumer gets here
            gang.answer(ctx.redis, call, gang.GangAnswer(node_rank=call.node_rank, worker=worker, ready=False,
                                                         reason=f"owns {ctx.settings.worker_devices} devices"))
            return REFUSED
        resolved = resolve_job(job)
        try:
            inputs = job_inputs(session, job)
        except ValueError as exc:  # the head fails the job for it; this node just does not join
            gang.answer(ctx.redis, call, gang.GangAnswer(node_rank=call.node_rank, worker=worker, ready=False,
                                                         reason=str(exc)))
            return REFUSED
    try:
        with storage_errors(f"fetch the inputs of {call.job_id} from {ctx.storage.url}"):
            config = config_for(ctx.settings, ctx.storage, resolved, inputs, ctx.settings.worker_device)
            pull_checkpoint(ctx.storage, ctx.settings, call.job_id)
    except Exception as exc:  # noqa: BLE001 - the head hears why and gives the job back
        gang.answer(ctx.redis, call, gang.GangAnswer(node_rank=call.node_rank, worker=worker, ready=False,
                                                     reason=f"{type(exc).__name__}: {exc}"))
        return REFUSED
    gang.answer(ctx.redis, call, gang.GangAnswer(node_rank=call.node_rank, worker=worker, ready=True))
    meet = Rendezvous(node_rank=call.node_rank, nodes=call.nodes, address=call.address, port=call.port,
                      timeout_s=max(1.0, call.deadline - time.time()) + ctx.settings.gang_timeout_s)
    log.info("job %s attempt %d: joining as node %d of %d", call.job_id, call.attempt, call.node_rank, call.nodes)
    try:
        join_run(config, meet, AttemptWatch(ctx, call.job_id, call.attempt).holds)
    except Exception:  # noqa: BLE001 - the head records what became of the attempt; this worker goes back to idle
        log.warning("job %s attempt %d: node %d ended with an error", call.job_id, call.attempt, call.node_rank,
                    exc_info=True)
    return JOINED


class AttemptWatch:
    """Whether the row still runs the attempt a node serves, read every few seconds (a joining worker never writes
    it: rank 0's worker reports)."""

    def __init__(self, ctx: WorkerContext, job_id: str, attempt: int, every_s: float = 3.0) -> None:
        self.ctx, self.job_id, self.attempt, self.every_s = ctx, job_id, attempt, every_s
        self.checked, self.running = 0.0, True

    def holds(self) -> bool:
        """False once the attempt ended (any status but running in this attempt); a database blip keeps it going."""
        now = time.monotonic()
        if now - self.checked < self.every_s:
            return self.running
        self.checked = now
        try:
            with self.ctx.sessions() as session:
                row = session.get(Job, self.job_id)
                self.running = row is not None and row.status == JobStatus.RUNNING and row.attempts == self.attempt
        except Exception:  # noqa: BLE001 - the next look decides
            log.warning("job %s: could not read its row", self.job_id, exc_info=True)
        return self.running
