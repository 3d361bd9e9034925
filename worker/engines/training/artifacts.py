"""Checkpoints (atomic, resumable) and the final model folder (its manifest: worker.engines.models.manifest)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import safetensors.torch
import torch

from worker.engines.device import DevicePlan
from worker.engines.models.adapters import load_adapted, write_merged
from worker.engines.models.manifest import MERGED_DIR, write_manifest
from worker.engines.training.quantized import is_quantized

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
ADAPTER_WEIGHTS = "adapter.safetensors"  # an adapter run's checkpoint: its trainable tensors only
MODEL_WEIGHTS = "model.safetensors"  # a full fine-tune's checkpoint: the whole model, tied duplicates left out
OPTIMIZER = "optimizer.pt"
STATE = "state.json"  # written last inside a checkpoint: its presence marks a complete one


def checkpoint_path(checkpoint_dir: Path, step: int) -> Path:
    """Folder of the checkpoint taken after optimizer step `step`."""
    return Path(checkpoint_dir) / f"checkpoint-{step}"


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint folder's name (checkpoint-<step>), or None for any other name."""
    match = _CHECKPOINT.match(name)
    return int(match.group(1)) if match else None


def list_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Complete checkpoints under checkpoint_dir, oldest step first."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = checkpoint_step(child.name)
        if step is not None and (child / STATE).is_file():
            found.append((step, child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(checkpoint_dir: Path) -> Path | None:
    """The most recent complete checkpoint, or None."""
    checkpoints = list_checkpoints(checkpoint_dir)
    return checkpoints[-1] if checkpoints else None


def trainable_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors an adapted model's checkpoint holds: those that train (the adapter, a new head)."""
    return {name: param.detach().contiguous() for name, param in model.named_parameters() if param.requires_grad}


def load_trainable(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Put a checkpoint's trainable tensors back; refuse one that does not hold exactly this model's."""
    expected = set(trainable_tensors(model))
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ValueError(f"the checkpoint's adapter does not match this run's (missing {missing[:3]}, "
                         f"unexpected {extra[:3]}); use an empty checkpoint_dir to start over")
    model.load_state_dict(tensors, strict=False)


@dataclass(frozen=True)
class FullState:
    """A sharded model's checkpoint tensors gathered onto rank 0: the weights a checkpoint holds (its trainable ones
    for an adapter run, else the whole model's without tied duplicates) and the optimizer's state dict."""

    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]


def weights_file(model: torch.nn.Module) -> str:
    """The name of a checkpoint's weights file for this model."""
    return ADAPTER_WEIGHTS if hasattr(model, "peft_config") else MODEL_WEIGHTS


def read_weights(path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A checkpoint's weight tensors as written, on the CPU."""
    return safetensors.torch.load_file(str(Path(path) / weights_file(model)))


def read_optimizer(path: Path) -> dict[str, Any]:
    """A checkpoint's optimizer state dict, on the CPU."""
    return torch.load(Path(path) / OPTIMIZER, map_location="cpu", weights_only=True)


def save_checkpoint(checkpoint_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler, plan: DevicePlan, state: dict[str, Any],
                    keep_steps: set[int] | frozenset[int] = frozenset(), full: FullState | None = None) -> Path:
    """Write weights, optimizer/scaler/RNG state and loop state atomically; prune all but it and `keep_steps`.

    `full`: the tensors to write in place of the model's and optimizer's own (a sharded model holds a part).
    """
    root = Path(checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(root, step)
    for stale in root.glob(".tmp-checkpoint-*"):  # left by a process that died mid-write
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    tmp.mkdir()
    if full is not None:
        safetensors.torch.save_file(full.weights, str(tmp / weights_file(model)), metadata={"format": "pt"})
    elif hasattr(model, "peft_config"):  # an adapter run: the frozen base is the base model's own file
        safetensors.torch.save_file(trainable_tensors(model), str(tmp / ADAPTER_WEIGHTS))
    else:  # save_model/load_model handle shared tensors, so any architecture round-trips exactly.
        safetensors.torch.save_model(model, str(tmp / MODEL_WEIGHTS))
    torch.save(optimizer.state_dict() if full is None else full.optimizer, tmp / OPTIMIZER)
    torch.save(scaler.state_dict(), tmp / "scaler.pt")
    torch.save(_rng_state(plan), tmp / "rng.pt")
    (tmp / STATE).write_text(json.dumps(dict(state, step=step), indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)  # a rename within one folder: readers see all of it or none
    # The new one is complete before anything goes: a crash mid-prune leaves extra folders, never none.
    for old in list_checkpoints(root):
        if old != final and checkpoint_step(old.name) not in keep_steps:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_weights(path: Path, model: torch.nn.Module, plan: DevicePlan) -> None:
    """Load only a checkpoint's model weights (the best evaluation's, to be saved as the final model)."""
    if hasattr(model, "peft_config"):
        load_trainable(model, safetensors.torch.load_file(str(Path(path) / ADAPTER_WEIGHTS), device=plan.device))
        return
    safetensors.torch.load_model(model, str(Path(path) / MODEL_WEIGHTS), strict=True, device=plan.device)


# Puts a checkpoint folder's weights and optimizer state back in a sharded run (every rank takes part).
Restore = Callable[[Path], None]


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler, plan: DevicePlan, restore: Restore | None = None) -> dict[str, Any]:
    """Restore a checkpoint into model/optimizer/scaler and the RNGs (weights and optimizer by `restore` when
    given); return the loop state."""
    path = Path(path)
    if restore is None:
        load_weights(path, model, plan)
        optimizer.load_state_dict(torch.load(path / OPTIMIZER, map_location=plan.device, weights_only=True))
    else:
        restore(path)
    scaler_state = torch.load(path / "scaler.pt", weights_only=True)
    if scaler_state:
        scaler.load_state_dict(scaler_state)
    _set_rng_state(torch.load(path / "rng.pt", weights_only=True), plan)
    return json.loads((path / STATE).read_text())


def _rng_state(plan: DevicePlan) -> dict[str, Any]:
    # Plain tensors, lists and numbers only, so torch.load(weights_only=True) can read it back.
    py_version, py_internal, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": [py_version, list(py_internal), py_gauss],
        "numpy": [np_name, torch.from_numpy(np.asarray(np_keys, dtype=np.int64)), np_pos, np_has_gauss, np_gauss],
        "torch": torch.get_rng_state(),
    }
    if plan.is_cuda:
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any], plan: DevicePlan) -> None:
    py_version, py_internal, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_internal), py_gauss))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state((np_name, np_keys.numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    torch.set_rng_state(state["torch"])
    if plan.is_cuda and "cuda" in state and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


class Savable(Protocol):
    """A model that writes its own folder: a transformers model, or a PEFT model (its adapter only)."""

    def save_pretrained(self, save_directory: str, **kwargs: Any) -> Any: ...


# Models save_final writes in another's place, by the id of the one a recipe passes: a sharded model holds a part
# of its weights on each rank, so rank 0 saves a plain copy gathered from all of them (see standing_in).
_stand_ins: dict[int, Any] = {}


@contextlib.contextmanager
def standing_in(model: torch.nn.Module, full: torch.nn.Module | None) -> Iterator[None]:
    """While it lasts, save_final given `model` writes `full` instead (nothing changes when `full` is None)."""
    if full is None:
        yield
        return
    _stand_ins[id(model)] = full
    try:
        yield
    finally:
        del _stand_ins[id(model)]


def save_final(output_dir: Path, model: Savable, tokenizer: Any,
               manifest: dict[str, Any], *, merged: bool = False) -> Path:
    """Save model and tokenizer with save_pretrained, then the manifest last as the completion mark.

    `merged` (an adapted model whose adapter asks for it): also the base with the adapter folded in, a full
    model, in merged/ (PEFT's merge_and_unload, which consumes the wrapper: call it last), folded into the
    full-precision base where the run's base was 4-bit.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model = _stand_ins.get(id(model), model)
    model.save_pretrained(str(output_dir), safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    if merged:
        from peft import PeftModel  # only an adapter run asks for a merged copy

        if not isinstance(model, PeftModel):
            raise TypeError("only an adapted model has a merged copy to save")
        manifest["merged"] = MERGED_DIR  # in place: the caller returns (and may rewrite) this manifest
        # Over a 4-bit base (QLoRA) the adapter folds into the base's original weights, loaded again from its folder
        # (on the CPU), never into weights dequantized from 4 bits: the export is the full-precision base plus B A.
        source = load_adapted(output_dir) if is_quantized(model) else model
        write_merged(source, tokenizer, output_dir / MERGED_DIR, manifest)
    write_manifest(output_dir, manifest)
    return output_dir


def resume_state(checkpoint: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler, plan: DevicePlan, identity: dict[str, Any],
                 restore: Restore | None = None) -> dict[str, Any]:
    """Load a checkpoint into the run and return its saved state, refusing one written by a different run."""
    state = load_checkpoint(checkpoint, model, optimizer, scaler, plan, restore)
    for key, expected in identity.items():
        if state.get(key) != expected:
            raise ValueError(f"{checkpoint} was written with {key}={state.get(key)!r}, this run has "
                             f"{expected!r}; use an empty checkpoint_dir to start over")
    return state
