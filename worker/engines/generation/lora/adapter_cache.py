"""Resident LoRA adapters of a serving base: an adapter's folder read into tensors, and the slots they occupy.

Every resident adapter has a slot in the runner's stacked LoRA tensors (runner_lora.RunnerLora: per adapted
projection one [slots, max_rank, in] A stack and one [slots, max_rank, out] B stack, slot 0 all zeros for the
base's rows). `AdapterCache` keeps up to capacity (TRAINSERVE_MAX_LORAS) adapters resident, least recently used
out first, never one that a running request holds. Reading an adapter folder (`load_lora_weights`) touches no slot,
so a worker reads it off the decode loop and `acquire` only copies the tensors into a free slot.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from collections.abc import Callable
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


class Slots(Protocol):
    """What AdapterCache needs of a slot store (a serving runner's joined stacks)."""

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
