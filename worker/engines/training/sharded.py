"""Weights, gradients and AdamW states split over the ranks of one host (FSDP2), for models one device cannot hold.

Each decoder or encoder layer (the classes a transformers model names in `_no_split_modules`), then the whole
model, is wrapped with `fully_shard`: a rank keeps 1/N of every parameter (a DTensor), all-gathers a layer's full
parameters just before the layer runs and frees them after, and reduce-scatters the gradients in backward, so
each rank also keeps 1/N of the gradients and of AdamW's moments. A LoRA model's frozen base is split the same
way; only its adapter has gradients. Under bf16/fp16 the gathered parameters are cast to that dtype (the layers
compute in it, as autocast would) and gradients are reduced in fp32; the shards stay fp32 masters.

What changes for the loop, because every forward gathers from all ranks at once:
- every rank runs every evaluation's forwards together (rank 0 alone would wait forever for its peers);
- a checkpoint is gathered by every rank (full tensors, onto rank 0's CPU) and written by rank 0 in the
  one-process layout; a resume reads it on rank 0 and scatters it back;
- the final model: every rank gathers the full weights, rank 0 loads them into a plain copy of the model (built
  on the meta device before sharding, so it cost no memory until then) and the recipe saves that copy.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from worker.engines.device import DevicePlan
from worker.engines.training import artifacts
from worker.engines.training.distributed import Dist, Replica

# Full (unsharded) tensors, gathered onto rank 0's CPU only: the other ranks get empty dicts, and no device
# ever holds the whole model at once.
_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
# Rank 0 reads a checkpoint and broadcasts it; every rank keeps its own shard of each tensor.
_SCATTER = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


class ShardedReplica(Replica):
    """One rank's share of a model sharded with FSDP2, with the collectives the loop's evaluation, checkpoints and
    final save need (each entered by every rank, in the same order)."""

    def __init__(self, dist: Dist, model: torch.nn.Module, plan: DevicePlan) -> None:
        super().__init__(dist, plan)
        self.adapted = hasattr(model, "peft_config")
        self.trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        # A tied parameter (GPT-2's LM head is its token embedding) has several names; a checkpoint keeps the
        # first, as safetensors' save_model does, and the others are put back from it on load.
        self.aliases = tied_aliases(model)
        # Rank 0's plain copy for the final save: the structure only, its tensors on the meta device.
        self.plain = meta_copy(model) if dist.is_main else None
        half = plan.autocast_dtype
        policy = (MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32) if half is not None
                  else MixedPrecisionPolicy())
        mesh = init_device_mesh(plan.device_type, (dist.world_size,))
        for layer in shard_units(model):  # innermost first: a wrapped module's parameters leave its parent's group
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self.module = model
        self.fsdp: FSDPModule = model  # type: ignore[assignment]  # fully_shard changed the model's class in place

    def sync_unless(self, last: bool) -> contextlib.AbstractContextManager:
        """Keep each micro-batch's unsharded gradients (no reduce-scatter) until the step's last one."""
        self.fsdp.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def gather(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> artifacts.FullState | None:
        """Every rank: a checkpoint's full weights and optimizer state, returned on rank 0 (None elsewhere)."""
        weights = _tensors(get_model_state_dict(model, options=_GATHER))
        state = get_optimizer_state_dict(model, optimizer, options=_GATHER)
        if not self.dist.is_main:
            return None
        return artifacts.FullState(weights=self._checkpoint_weights(weights), optimizer=dict(state))

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
        """Every rank: put a checkpoint's weights and optimizer state (read by rank 0) back into the shards."""
        self.load_weights(model, path)
        state = artifacts.read_optimizer(path) if self.dist.is_main else {}
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=_SCATTER)

    def load_weights(self, model: torch.nn.Module, path: Path) -> None:
        """Every rank: put a checkpoint's weights (read by rank 0) back into the shards."""
        weights: dict[str, Any] = {}
        if self.dist.is_main:
            weights = artifacts.read_weights(path, model)
            if set(weights) != self._saved_names(model):
                raise ValueError(f"{path} does not hold this run's weights; use an empty checkpoint_dir to start over")
            weights.update({alias: weights[name] for alias, name in self.aliases.items() if name in weights})
        # An adapter checkpoint holds the trainable tensors only: the frozen base keeps the weights it has.
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=not self.adapted)
        set_model_state_dict(model, weights, options=options)

    def full_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """Every rank: gather the full weights; rank 0 gets its plain copy of the model holding them (on the CPU)."""
        weights = get_model_state_dict(model, options=_GATHER)
        plain = self.plain
        if plain is None:
            return None
        # assign: the copy takes the gathered CPU tensors as they are, no second copy of the model.
        plain.load_state_dict(weights, strict=True, assign=True)
        for alias, name in self.aliases.items():  # assign gave each name its own tensor: tie them again
            _set_parameter(plain, alias, plain.get_parameter(name))
        # Buffers a state dict leaves out (rotary frequencies, position ids) are the same on every rank.
        live = dict(model.named_buffers())
        for name, buffer in plain.named_buffers():
            if buffer.is_meta:
                _set_buffer(plain, name, live[name].detach().to("cpu", copy=True))
        return plain

    def _checkpoint_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The gathered tensors a checkpoint holds: an adapter run's trainable ones, else all but tied aliases."""
        if self.adapted:
            return {name: tensor for name, tensor in weights.items() if name in self.trainable}
        return {name: tensor for name, tensor in weights.items() if name not in self.aliases}

    def _saved_names(self, model: torch.nn.Module) -> set[str]:
        if self.adapted:
            return set(self.trainable)
        return set(model.state_dict()) - set(self.aliases)


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules sharded on their own, innermost first: each transformers layer class the model names in
    `_no_split_modules` (decoder and encoder layers), except one sharing a parameter with the rest of the model."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    counts: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        counts[id(parameter)] = counts.get(id(parameter), 0) + 1
    units = []
    for module in model.modules():
        if module is model or type(module).__name__ not in names:
            continue
        inside: dict[int, int] = {}
        for _, parameter in module.named_parameters(remove_duplicate=False):
            inside[id(parameter)] = inside.get(id(parameter), 0) + 1
        # A parameter used outside the unit too (a tied embedding) must stay in one FSDP group with all its uses.
        if all(counts[key] == count for key, count in inside.items()):
            units.append(module)
    return units[::-1]  # modules() lists parents before children


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Every parameter name that is another's alias (the same tensor), mapped to the first name of that tensor."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            aliases[name] = first[id(parameter)]
        else:
            first[id(parameter)] = name
    return aliases


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the model whose parameters and buffers are on the meta device (shapes only, no memory)."""
    memo: dict[int, object] = {}
    for parameter in model.parameters():
        memo[id(parameter)] = torch.nn.Parameter(torch.empty_like(parameter, device="meta"),
                                                 requires_grad=parameter.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)


def _tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A model state dict's entries, which are all tensors (the checkpoint API types them more loosely)."""
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def _set_parameter(model: torch.nn.Module, name: str, parameter: torch.nn.Parameter) -> None:
    owner, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(owner), attribute, parameter)


def _set_buffer(model: torch.nn.Module, name: str, buffer: torch.Tensor) -> None:
    owner, _, attribute = name.rpartition(".")
    model.get_submodule(owner)._buffers[attribute] = buffer
