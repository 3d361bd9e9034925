"""A LoRA adapter folder (PEFT's files, the tokenizer, the manifest) read back: its base, its size, the adapted
model, and the one writer of a merged copy (the base with the adapter folded in, W + B A alpha / r).

How an adapter reaches inference, by engine: the encoder engines fold it into their model in memory when they load
it (`load_merged`); the generation engine applies it per row over llama-family bases and otherwise loads the merged
copy whole (core.served_models.adapter_served_per_row decides, worker.model_store fetches or writes the copy).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.vocab import TaskKind
from worker.engines.models import manifest as manifests

if TYPE_CHECKING:
    from peft import PeftModel

# PEFT and transformers' model classes are imported by the functions that load or merge: telling an adapter folder
# from a full model (what the generation worker asks of every job model) loads neither.

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def is_adapter(folder: Path) -> bool:
    """Whether a model folder is a LoRA adapter (PEFT's config) rather than a full model."""
    return (Path(folder) / ADAPTER_FILES[0]).is_file()


def adapter_bytes(folder: Path) -> int:
    """Size of an adapter folder's weights, for the dashboard and the manifest."""
    return (Path(folder) / ADAPTER_FILES[1]).stat().st_size


def load_adapted(folder: Path, *, trainable: bool = False) -> PeftModel:
    """The base model named in an adapter folder's config with that adapter on top (eval mode unless trainable)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    manifest = manifests.read_manifest(folder) or {}
    classifier = manifest.get("task", TaskKind.CAUSAL_LM) == TaskKind.TEXT_CLASSIFICATION
    auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    base_source = base_model_of(folder)
    kwargs: dict[str, Any] = {}
    if classifier and manifest.get("labels") is not None:
        kwargs["num_labels"] = len(manifest["labels"])
    base = auto.from_pretrained(base_source, trust_remote_code=False, use_safetensors=True, **kwargs)
    return PeftModel.from_pretrained(base, str(folder), is_trainable=trainable)


def load_merged(folder: Path) -> Any:
    """The adapted model with the adapter folded into its base's weights (a plain transformers model, eval mode)."""
    return load_adapted(folder).merge_and_unload().eval()


def base_model_of(folder: Path) -> str:
    """The base model an adapter folder was trained on (adapter_config.json's base_model_name_or_path)."""
    from peft import PeftConfig

    base = PeftConfig.from_pretrained(str(folder)).base_model_name_or_path
    if not base:
        raise ValueError(f"{folder} names no base model in adapter_config.json")
    return str(base)


def write_merged(model: PeftModel, tokenizer: Any, output_dir: Path, manifest: dict[str, Any]) -> Path:
    """Write the base with the adapter folded in as a full model folder (the one merge writer). PEFT's
    merge_and_unload consumes the wrapper, so this is the last use of `model`."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model.merge_and_unload().save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    merged = dict(manifest)
    merged["merged_from_adapter"] = merged.pop("adapter", None)
    merged.pop("merged", None)  # the adapter artifact's pointer to its merged/ copy: this folder is that copy
    manifests.write_manifest(output_dir, merged)
    return output_dir


def export_merged(folder: Path, output_dir: Path) -> Path:
    """A full model from an adapter folder: its base with the adapter folded into the weights, tokenizer and
    manifest."""
    from worker.engines.models.tokenizers import load_tokenizer_files

    manifest = manifests.read_manifest(folder) or {}
    return write_merged(load_adapted(folder), load_tokenizer_files(str(folder)), output_dir, manifest)
