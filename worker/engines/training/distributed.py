"""Data parallelism on several devices of one host: a rank's share of each step and the collectives the loop needs.

Every rank (one process per device, started by torchrun) builds the same model and walks the same seeded
step plan; each step's micro-batches are dealt out example by example, so every rank's share keeps the
length grouping and the global batch is the one a single process would take. DistributedDataParallel
(WholeReplica) or FSDP2 (worker.engines.training.sharded) averages the gradients; rank 0 alone talks to the
outside (callbacks) and saves, and its answer to "stop?" is broadcast so that all ranks leave the loop after the
same step. A whole replica is evaluated by rank 0 alone; a sharded one by all ranks together.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.nn.parallel import DistributedDataParallel

from worker.engines.device import DevicePlan, rank_device, resolve_device

# Long enough for rank 0 to write a large checkpoint or evaluate while the others wait in the next collective.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class Dist:
    """Where this process sits in a data-parallel run (torchrun's RANK, LOCAL_RANK and WORLD_SIZE)."""

    rank: int
    local_rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        """True on rank 0: the rank that reports, evaluates and saves."""
        return self.rank == 0

    @classmethod
    def from_env(cls) -> Dist:
        """Read the rank from the environment torchrun gives each process."""
        return cls(rank=int(os.environ["RANK"]), local_rank=int(os.environ["LOCAL_RANK"]),
                   world_size=int(os.environ["WORLD_SIZE"]))


def join(dist: Dist, device: str, precision: str) -> DevicePlan:
    """Join the process group and return this rank's plan, with the precision rank 0 resolved for all."""
    name = rank_device(device, dist.local_rank)
    backend = resolve_device(name, "fp32").backend
    if backend == "nccl":
        torch.cuda.set_device(torch.device(name))
    torch_dist.init_process_group(backend=backend, rank=dist.rank, world_size=dist.world_size,
                                  timeout=COLLECTIVE_TIMEOUT)
    # "auto" may time a calibration step on a CPU; ranks timing it apart could disagree, so rank 0 decides.
    chosen = [resolve_device(name, precision, training=True).precision if dist.is_main else None]
    torch_dist.broadcast_object_list(chosen, src=0)
    return resolve_device(name, str(chosen[0]), training=True)


def leave() -> None:
    """Leave the process group (at the end of the rank's process)."""
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def shard(micro_batches: Sequence[Any], dist: Dist) -> list[Any]:
    """This rank's share of one step: every world_size-th example of each micro-batch, empty shares dropped."""
    # Striding within a micro-batch of similar-length rows gives every rank similar-length rows too (the
    # padding stays what one process would pay), and the shares differ in size by one example at most.
    parts = [micro_batch[dist.rank::dist.world_size] for micro_batch in micro_batches]
    return [part for part in parts if len(part)]


def step_share(micro_batches: Sequence[Any], dist: Dist) -> tuple[list[Any], list[float]]:
    """This rank's micro-batches of a step and the weight of each in the step's loss (its share of all examples).

    A rank left without examples (a last step shorter than the world) runs one example at weight zero: it
    must still join the step's gradient all-reduce.
    """
    examples = sum(len(m) for m in micro_batches)
    parts = shard(micro_batches, dist)
    if not parts:
        return [micro_batches[0][:1]], [0.0]
    return parts, [len(p) / examples for p in parts]


class Replica:
    """One rank's model in a data-parallel run and the collectives the loop uses; subclasses decide who holds what.

    WholeReplica keeps the whole model on every rank (DDP); worker.engines.training.sharded.ShardedReplica splits
    weights, gradients and AdamW states over the ranks (FSDP2).
    """

    module: torch.nn.Module  # what the micro-batches run through

    def __init__(self, dist: Dist, plan: DevicePlan) -> None:
        self.dist = dist
        self.plan = plan

    def share(self, micro_batches: Sequence[Any]) -> tuple[list[Any], list[float]]:
        """This rank's micro-batches of a step and their weights (see step_share)."""
        return step_share(micro_batches, self.dist)

    @property
    def gradient_scale(self) -> float:
        """What a rank's weighted loss is multiplied by before backward: DDP and FSDP average over ranks, we want
        the sum (each rank's loss is already weighted by its share of the step's examples)."""
        return float(self.dist.world_size)

    def sync_unless(self, last: bool) -> contextlib.AbstractContextManager:
        """Accumulate locally (no gradient collective) for every micro-batch of a step but its last."""
        raise NotImplementedError

    def total(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of `value` over all ranks (the step's mean loss from each rank's weighted part)."""
        torch_dist.all_reduce(value, op=torch_dist.ReduceOp.SUM)
        return value

    def agree(self, flag: bool) -> bool:
        """Rank 0's answer, on every rank (stop requests reach rank 0 only)."""
        box = torch.tensor([int(flag)], device=self.plan.device)
        torch_dist.broadcast(box, src=0)
        return bool(box.item())

    def from_main(self, value: int | None) -> int | None:
        """Rank 0's value, on every rank (what only rank 0 tracks, such as the best evaluation's step)."""
        box = [value]
        torch_dist.broadcast_object_list(box, src=0)
        return box[0]


class WholeReplica(Replica):
    """The whole model on every rank, wrapped in DistributedDataParallel: rank 0 alone evaluates and saves it."""

    def __init__(self, dist: Dist, model: torch.nn.Module, plan: DevicePlan) -> None:
        super().__init__(dist, plan)
        # broadcast_buffers off: rank 0 evaluates alone with the inner model, and BERT/GPT-2 buffers are
        # constants (position ids), so there is nothing to keep in step and no forward may wait on a peer.
        self.ddp = DistributedDataParallel(model, device_ids=[plan.device] if plan.is_cuda else None,
                                           broadcast_buffers=False)
        self.module = self.ddp

    def sync_unless(self, last: bool) -> contextlib.AbstractContextManager:
        """Accumulate locally (no all-reduce) for every micro-batch of a step but its last."""
        return contextlib.nullcontext() if last else self.ddp.no_sync()
