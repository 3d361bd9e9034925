"""Serve a trained classifier: load once, predict in length-sorted batches, keep a few warm."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from worker.engines.device import DevicePlan, release_memory, resolve_device
from worker.engines.encoders.layer_pauses import LayerPauses
from worker.engines.models import adapters
from worker.engines.models import encoder_batches as batching
from worker.engines.models import manifest as manifests

DEFAULT_MAX_LENGTH = 512


class Classifier:
    """A fine-tuned model and its tokenizer, loaded once and kept in eval mode."""

    def __init__(self, model_dir: Path, device: str = "auto") -> None:
        self.model_dir = Path(model_dir)
        self.plan: DevicePlan = resolve_device(device)
        manifest = manifests.read_manifest(self.model_dir) or {}
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        if adapters.is_adapter(self.model_dir):  # a LoRA job's artifact: its base with the adapter folded in
            self.model = adapters.load_merged(self.model_dir).to(self.plan.device)
        else:
            self.model = AutoModelForSequenceClassification.from_pretrained(
                self.model_dir, use_safetensors=True, trust_remote_code=False,
            ).to(self.plan.device)
        self.model.eval()
        self.pauses = LayerPauses(self.model)  # another tenant's batch may run between layers
        id2label = self.model.config.id2label
        # The manifest keeps the labels' original types (ints stay ints); config.json only has strings.
        self.labels: list[Any] = manifest.get("labels") or [id2label[i] for i in range(len(id2label))]
        if len(self.labels) != self.model.config.num_labels:
            raise ValueError(f"{self.model_dir}: manifest lists {len(self.labels)} labels, "
                             f"the model has {self.model.config.num_labels}")
        self.max_length = int(manifest.get("hyperparameters", {}).get("max_length") or
                              min(self.tokenizer.model_max_length, DEFAULT_MAX_LENGTH))

    def predict(self, texts: list[str], batch_size: int = 32, turn_tokens: int | None = None,
                turn: Callable[[], AbstractContextManager[Any]] = nullcontext) -> list[dict[str, Any]]:
        """Label and probability for each text, in input order; each batch runs inside `turn()` (see Embedder.embed)."""
        if not texts:
            return []
        # A live request is small: tokenize directly rather than through a datasets.Dataset.
        token_ids = self.tokenizer(list(texts), truncation=True, max_length=self.max_length)["input_ids"]
        encoded = batching.pack(token_ids, [0] * len(texts), self.tokenizer.pad_token_id)
        results: list[dict[str, Any]] = [{} for _ in texts]
        for indices in batching.sorted_batches(encoded, batch_size, turn_tokens):
            with turn() as pause, self.pauses.around(pause), torch.inference_mode(), self.plan.autocast():
                batch = batching.collate(encoded, indices)
                batch.pop("labels")
                logits = self.model(**{k: v.to(self.plan.device) for k, v in batch.items()}).logits
                scores, label_ids = torch.softmax(logits.float(), dim=-1).max(dim=-1)
                for index, label_id, score in zip(indices, label_ids.tolist(), scores.tolist(), strict=True):
                    results[index] = {"label": self.labels[label_id], "score": float(score)}
        return results


class ClassifierCache:
    """A small LRU of warm models keyed by model folder: Classifiers, or what `load` builds (an Embedder)."""

    def __init__(self, max_entries: int = 2, device: str = "auto",
                 load: Callable[..., Any] = Classifier) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self.device = device
        self.load = load
        self._entries: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, model_dir: Path) -> Any:
        """The model for model_dir, loading it (and evicting the least recent) on a miss."""
        key = str(Path(model_dir).resolve())
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
            classifier = self.load(Path(key), device=self.device)
            self._entries[key] = classifier
            while len(self._entries) > self.max_entries:
                _, evicted = self._entries.popitem(last=False)
                plan = evicted.plan
                del evicted
                release_memory(plan)
            return classifier

    def clear(self) -> None:
        """Drop every cached model."""
        with self._lock:
            plans = [c.plan for c in self._entries.values()]
            self._entries.clear()
        for plan in plans:
            release_memory(plan)

    def __len__(self) -> int:
        return len(self._entries)
