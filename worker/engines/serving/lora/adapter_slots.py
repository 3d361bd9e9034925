"""Many LoRA adapters over one base model in one batch: gathered LoRA matmuls per row (Punica, S-LoRA).

Every resident adapter has a slot. For each adapted projection (layer, q/k/v/o/gate/up/down) the slots' A matrices
are stacked into one [slots, max_rank, in] tensor and their B^T matrices, pre-multiplied by alpha / r, into one
[slots, max_rank, out] tensor; an adapter of a lower rank or without that projection is zero-padded. Slot 0 is
all zeros: the rows of the base model. Once per forward, `plan_rows` turns the rows' slot indices into the
distinct adapters the batch uses (U of them) and a 0/1 mask [rows, U * max_rank] of each row's own rank block.
Then, per projection, with A_U and B_U the gathered blocks of those U adapters side by side,
    y = x W^T + ((x A_U^T) * mask) B_U
adds every row's own update with two matmuls for the whole batch, whatever adapters it mixes. The gather reads
each used adapter once (not once per row, as a per-row gather followed by bmm does: on a CPU that copy cost
2-4x the base projection in a decode step), and the extra work is U * r / out of the base matmul's.

`AdapterCache` keeps up to capacity (TRAINSERVE_MAX_LORAS) adapters resident, least recently used out first,
never one that a running request holds. Reading an adapter folder (`load_lora_weights`) touches no slot, so a
worker reads it off the decode loop and `acquire` only copies the tensors into a free slot.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import safetensors.torch
import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BASE_SLOT = 0
_MODULE = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
Key = tuple[int, str]  # (layer index, projection name)


class AdapterCacheFull(RuntimeError):
    """Every slot holds an adapter that a running request uses; the caller waits or refuses (429)."""


@dataclass(frozen=True)
class LoraWeights:
    """One adapter read from PEFT's folder: per (layer, projection) A [r, in] and B * alpha / r [out, r]."""

    name: str
    rank: int
    layers: dict[Key, tuple[torch.Tensor, torch.Tensor]]


def load_lora_weights(folder: Path, name: str | None = None) -> LoraWeights:
    """Read a PEFT LoRA folder (adapter_config.json, adapter_model.safetensors) of a Llama-style model."""
    folder = Path(folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora") or config.get("bias", "none") != "none":
        raise ValueError(f"{folder.name}: only plain LoRA adapters (no DoRA, no bias) are served in batches")
    if config.get("modules_to_save"):
        raise ValueError(f"{folder.name}: an adapter that also trains whole modules cannot share the base")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    parts: dict[Key, dict[str, torch.Tensor]] = {}
    for key, tensor in safetensors.torch.load_file(str(folder / "adapter_model.safetensors")).items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in PROJECTIONS:
            raise ValueError(f"{folder.name}: {key} adapts a module batched serving does not cover "
                             f"(only {', '.join(PROJECTIONS)} of each layer)")
        parts.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    layers = {key: (ab["A"].float(), ab["B"].float() * scaling) for key, ab in parts.items()}
    return LoraWeights(name=name or folder.name, rank=rank, layers=layers)


@dataclass(frozen=True)
class RowPlan:
    """The adapters one batch uses and which rank block each row takes: computed once per forward."""

    used: torch.Tensor  # [U] distinct adapter slots of the batch (no base slot)
    mask: torch.Tensor  # [rows, 1, U * max_rank]: 1 on the row's own adapter block, 0 elsewhere (base rows: all 0)


def plan_rows(slots: torch.Tensor, max_rank: int, dtype: torch.dtype = torch.float32) -> RowPlan | None:
    """The plan of a batch whose row i uses adapter slots[i] (0: the base); None when no row has an adapter."""
    used, position = torch.unique(slots, return_inverse=True)
    has_base = bool(used[0] == BASE_SLOT)  # one device sync per forward, not per projection
    if has_base and len(used) == 1:
        return None
    if has_base:
        used, position = used[1:], position - 1  # base rows get -1: no block
    blocks = torch.arange(len(used), device=slots.device)
    mask = (position[:, None] == blocks[None, :]).to(dtype)  # [rows, U]
    mask = mask.repeat_interleave(max_rank, dim=1).unsqueeze(1)  # [rows, 1, U * max_rank]
    return RowPlan(used=used, mask=mask)


def lora_delta(x: torch.Tensor, a_stacked: torch.Tensor, b_stacked: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """Every row's LoRA update: x [rows, tokens, in] -> [rows, tokens, out], row i through its own adapter."""
    if x.dim() == 2:  # [rows, in]: one token per row
        return lora_delta(x.unsqueeze(1), a_stacked, b_stacked, plan).squeeze(1)
    a = a_stacked.index_select(0, plan.used).flatten(0, 1)  # [U * rank, in]: each used adapter read once
    b = b_stacked.index_select(0, plan.used).flatten(0, 1)  # [U * rank, out]
    return ((x @ a.T) * plan.mask.to(x.dtype)) @ b


class LoraSlots:
    """The stacked A and B tensors of every adapted projection, `capacity` adapter slots plus the zero slot."""

    def __init__(self, shapes: dict[Key, tuple[int, int]], *, capacity: int, max_rank: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if capacity < 1 or max_rank < 1:
            raise ValueError("capacity and max_rank must be at least 1")
        self.capacity, self.max_rank = capacity, max_rank
        self.a = {key: torch.zeros(capacity + 1, max_rank, fan_in, device=device, dtype=dtype)
                  for key, (fan_in, _) in shapes.items()}
        self.b = {key: torch.zeros(capacity + 1, max_rank, fan_out, device=device, dtype=dtype)
                  for key, (_, fan_out) in shapes.items()}  # B^T: a used adapter's block is contiguous
        self.plan: RowPlan | None = None  # set per forward by `rows`

    def write(self, slot: int, weights: LoraWeights) -> None:
        """Put an adapter into a slot (1..capacity), zeroing what it does not adapt."""
        if not 1 <= slot <= self.capacity:
            raise ValueError(f"slot {slot} is not one of 1..{self.capacity}")
        if weights.rank > self.max_rank:
            raise ValueError(f"adapter {weights.name} has rank {weights.rank}; this server holds up to "
                             f"{self.max_rank}")
        unknown = sorted(set(weights.layers) - set(self.a))
        if unknown:
            raise ValueError(f"adapter {weights.name} adapts {unknown[0]}, which the base model does not have")
        for key in self.a:
            self.a[key][slot].zero_()
            self.b[key][slot].zero_()
            if key in weights.layers:
                lora_a, lora_b = weights.layers[key]
                self.a[key][slot, :weights.rank].copy_(lora_a)
                self.b[key][slot, :weights.rank].copy_(lora_b.T)

    def delta(self, key: Key, x: torch.Tensor, plan: RowPlan) -> torch.Tensor | None:
        """The LoRA update of projection `key` for input x [rows, tokens, in] (None: the base model lacks it)."""
        if key not in self.a:
            return None
        return lora_delta(x, self.a[key].to(x.dtype), self.b[key].to(x.dtype), plan)

    @contextlib.contextmanager
    def rows(self, slots: torch.Tensor) -> Iterator[None]:
        """Within this block, forwards through attached layers add each row's adapter (slots[i] for row i)."""
        self.plan = plan_rows(slots, self.max_rank)  # None for base rows only: nothing to add
        try:
            yield
        finally:
            self.plan = None


class BatchedLoraLinear(torch.nn.Module):
    """A base nn.Linear plus each row's adapter from the slots (for engines that run Hugging Face modules)."""

    def __init__(self, base: torch.nn.Linear, slots: LoraSlots, key: Key) -> None:
        super().__init__()
        self.base, self.slots, self.key = base, slots, key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T (+ b), plus the rows' adapter updates while `slots.rows(...)` is active."""
        out = self.base(x)
        plan = self.slots.plan
        if plan is None:
            return out
        delta = self.slots.delta(self.key, x, plan)
        return out if delta is None else out + delta


def projections(model: torch.nn.Module) -> dict[str, tuple[Key, torch.nn.Linear]]:
    """Every q/k/v/o/gate/up/down nn.Linear of a Llama-style decoder: module path -> ((layer, name), module)."""
    found = {}
    for name, module in model.named_modules():
        match = _MODULE.search(name)
        if match and match.group(2) in PROJECTIONS and isinstance(module, torch.nn.Linear):
            found[name] = ((int(match.group(1)), match.group(2)), module)
    return found


def projection_shapes(model: torch.nn.Module) -> dict[Key, tuple[int, int]]:
    """(in, out) of every projection, by (layer, name): what LoraSlots stacks."""
    return {key: (module.in_features, module.out_features) for key, module in projections(model).values()}


def attach(model: torch.nn.Module, slots: LoraSlots) -> int:
    """Wrap the model's projections in BatchedLoraLinear, in place; returns how many."""
    found = projections(model)
    for name, (key, module) in found.items():
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        setattr(parent, key[1], BatchedLoraLinear(module, slots, key))
    return len(found)


class Slots(Protocol):
    """What AdapterCache needs of a slot store (LoraSlots, or a serving runner's joined stacks)."""

    capacity: int

    def write(self, slot: int, weights: LoraWeights) -> None:
        """Put an adapter into a slot (1..capacity)."""


class AdapterCache:
    """Resident adapters by name, LRU-evicted when a new one needs a slot; one in use is never evicted."""

    def __init__(self, slots: Slots, loader: Callable[[str], LoraWeights]) -> None:
        self.slots, self.loader = slots, loader
        self._resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self._users: dict[str, int] = {}

    def acquire(self, name: str, weights: LoraWeights | None = None) -> int:
        """The slot of adapter `name`, loading it (or installing `weights` read beforehand) if not resident."""
        if name in self._resident:
            self._resident.move_to_end(name)
        else:
            slot = self._free_slot()
            self.slots.write(slot, weights if weights is not None else self.loader(name))
            self._resident[name] = slot
        self._users[name] = self._users.get(name, 0) + 1
        return self._resident[name]

    def release(self, name: str) -> None:
        """A request using `name` has finished: it may be evicted once nobody uses it."""
        left = self._users.get(name, 0) - 1
        if left < 0:
            raise ValueError(f"adapter {name} was released more often than acquired")
        self._users[name] = left

    def __contains__(self, name: object) -> bool:
        """Whether adapter `name` holds a slot now (one dict lookup: safe to ask from another thread)."""
        return name in self._resident

    def resident(self) -> list[str]:
        """Resident adapters, least recently used first."""
        return list(self._resident)

    def _free_slot(self) -> int:
        used = set(self._resident.values())
        for slot in range(1, self.slots.capacity + 1):
            if slot not in used:
                return slot
        for name, slot in self._resident.items():  # least recently used first
            if self._users.get(name, 0) == 0:
                del self._resident[name]
                self._users.pop(name, None)
                return slot
        raise AdapterCacheFull(f"all {self.slots.capacity} adapter slots are in use by running requests")
