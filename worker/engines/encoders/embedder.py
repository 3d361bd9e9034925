"""Serve sentence embeddings: a transformer encoder, its pooling and normalisation as the model's files say.

A sentence-transformers folder lists its modules in `modules.json` (Transformer, Pooling, Normalize); the pooling
modes come from the Pooling module's `config.json`, the token limit from `sentence_bert_config.json`. They are
computed here with torch, as sentence-transformers computes them, so serving needs no sentence-transformers.
A fine-tuned classifier's folder has no `modules.json`: its encoder (the model without the classification head)
is mean-pooled and L2-normalised, so dot products are cosines as with OpenAI's embeddings.

Matryoshka: a model may declare the widths it was trained to be cut to with `matryoshka_dimensions` in its
`config_sentence_transformers.json`; only such models accept a smaller `dimensions` (cut, then renormalised).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from worker.engines.device import DevicePlan, resolve_device
from worker.engines.encoders.layer_pauses import LayerPauses
from worker.engines.models import adapters
from worker.engines.models import encoder_batches as batching

# sentence-transformers' Pooling modes; older configs set one flag per mode (`pooling_mode_<legacy name>`), read
# in this order (the one they are concatenated in), newer ones name them in `pooling_mode` (a name or a list).
LEGACY_MODES = {"cls_token": "cls", "max_tokens": "max", "mean_tokens": "mean",
                "mean_sqrt_len_tokens": "mean_sqrt_len_tokens", "weightedmean_tokens": "weightedmean",
                "lasttoken": "lasttoken"}
POOLING_MODES = frozenset(LEGACY_MODES.values())
DEFAULT_MAX_LENGTH = 512


class EmbeddingRefused(ValueError):
    """A request the model cannot serve; `field` names the request field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class EmbeddingSpec:
    """How a folder's model turns hidden states into one vector."""

    transformer_dir: Path
    modes: tuple[str, ...] = ("mean",)
    normalize: bool = True
    max_length: int | None = None  # None: the model's position limit
    matryoshka: tuple[int, ...] = ()  # declared widths; empty: not trained to be cut


def special_wrapping(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The special ids the tokenizer puts before and after one sequence's tokens ([CLS] and [SEP] for BERT), read
    from its own post-processor around a probe token."""
    probe = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    wrapped = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    size = len(probe)
    at = next((i for i in range(len(wrapped) - size + 1) if size and wrapped[i:i + size] == probe), None)
    return ([], []) if at is None else (wrapped[:at], wrapped[at + size:])


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def read_spec(model_dir: Path) -> EmbeddingSpec:
    """The folder's embedding recipe: its modules.json if any, else mean pooling and normalisation."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return EmbeddingSpec(transformer_dir=model_dir)
    transformer_dir, normalize = model_dir, False
    modes: tuple[str, ...] = ("mean",)
    for module in json.loads(modules_file.read_text()):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = model_dir / str(module.get("path", ""))
        if kind == "Transformer":
            transformer_dir = path
        elif kind == "Pooling":
            modes = pooling_modes(_json(path / "config.json"))
        elif kind == "Normalize":
            normalize = True
        else:
            raise EmbeddingRefused("model", f"sentence-transformers module {module.get('type')!r} is not supported "
                                   "(Transformer, Pooling and Normalize are)")
    max_length = _json(transformer_dir / "sentence_bert_config.json").get("max_seq_length")
    declared = _json(model_dir / "config_sentence_transformers.json").get("matryoshka_dimensions") or ()
    return EmbeddingSpec(transformer_dir=transformer_dir, modes=modes, normalize=normalize,
                         max_length=int(max_length) if max_length else None,
                         matryoshka=tuple(sorted({int(d) for d in declared}, reverse=True)))


def pooling_modes(config: dict[str, Any]) -> tuple[str, ...]:
    """The modes of a Pooling module's config.json, in either format (mean when it names none)."""
    named = config.get("pooling_mode")
    if named is not None:
        modes = (named,) if isinstance(named, str) else tuple(named)
    else:
        modes = tuple(mode for legacy, mode in LEGACY_MODES.items() if config.get(f"pooling_mode_{legacy}"))
    if unknown := [m for m in modes if m not in POOLING_MODES]:
        raise EmbeddingRefused("model", f"pooling mode {unknown} is not one sentence-transformers defines")
    return modes or ("mean",)


def pool(hidden: torch.Tensor, mask: torch.Tensor, modes: tuple[str, ...]) -> torch.Tensor:
    """[batch, length, width] hidden states and [batch, length] mask -> [batch, width * len(modes)], in fp32."""
    hidden = hidden.float()
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    counts = weights.sum(dim=1).clamp(min=1e-9)
    pooled = []
    for mode in modes:
        if mode == "cls":  # right padding: the first token is real
            pooled.append(hidden[:, 0])
        elif mode == "max":
            pooled.append(hidden.masked_fill(weights == 0, float("-inf")).max(dim=1).values)
        elif mode == "mean":
            pooled.append((hidden * weights).sum(dim=1) / counts)
        elif mode == "mean_sqrt_len_tokens":
            pooled.append((hidden * weights).sum(dim=1) / counts.sqrt())
        elif mode == "weightedmean":  # position i (from 1) weighs i
            positions = torch.arange(1, hidden.shape[1] + 1, device=hidden.device, dtype=hidden.dtype)
            ramp = weights * positions.view(1, -1, 1)
            pooled.append((hidden * ramp).sum(dim=1) / ramp.sum(dim=1).clamp(min=1e-9))
        else:  # lasttoken: right padding, so the last real token is at length - 1
            last = mask.sum(dim=1).long() - 1
            pooled.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])
    return torch.cat(pooled, dim=-1)


# Texts tokenized per turn at the model (a few milliseconds of a fast tokenizer).
TOKENIZE_CHUNK = 64


class Embedder:
    """An encoder and its tokenizer, loaded once and kept in eval mode."""

    def __init__(self, model_dir: Path, device: str = "auto") -> None:
        self.model_dir = Path(model_dir)
        self.plan: DevicePlan = resolve_device(device)
        self.spec = read_spec(self.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.spec.transformer_dir)
        self.special_wrapping = special_wrapping(self.tokenizer)  # what token-id inputs are wrapped in
        if adapters.is_adapter(self.model_dir):  # a LoRA classifier: base + adapter, folded
            encoder = adapters.load_merged(self.model_dir).base_model
        else:  # a classifier's folder loads as its encoder alone (the head's weights are left out)
            encoder = AutoModel.from_pretrained(self.spec.transformer_dir, use_safetensors=True,
                                                trust_remote_code=False)
        self.model = encoder.to(self.plan.device).eval()
        self.pauses = LayerPauses(self.model)  # another tenant's batch may run between layers
        positions = int(getattr(self.model.config, "max_position_embeddings", 0) or DEFAULT_MAX_LENGTH)
        self.max_length = min(self.spec.max_length or positions, positions,
                              int(min(self.tokenizer.model_max_length, 10**6)))
        self.width = int(self.model.config.hidden_size) * len(self.spec.modes)

    def tokenize(self, texts: list[str] | None = None, token_ids: list[list[int]] | None = None,
                 turn: Callable[[], AbstractContextManager[Any]] = nullcontext,
                 chunk: int = TOKENIZE_CHUNK) -> list[list[int]]:
        """Model input ids of each input (special tokens added); EmbeddingRefused naming an input past the limit.
        Texts are tokenized `chunk` at a time, each inside `turn()`: a request's tokenizing is part of its tenant's
        share of the worker, not a burst beside it."""
        if texts is not None:
            ids = []
            for start in range(0, len(texts), chunk):
                with turn():
                    part = self.tokenizer(list(texts[start:start + chunk]), truncation=False, verbose=False)
                ids += part["input_ids"]
        else:
            vocab = len(self.tokenizer)
            for index, row in enumerate(token_ids or []):
                if max(row) >= vocab:
                    raise EmbeddingRefused(_field(index, len(token_ids or [])),
                                           f"token id {max(row)} is outside the model's vocabulary of {vocab}")
            prefix, suffix = self.special_wrapping
            ids = [prefix + list(row) + suffix for row in token_ids or []]
        for index, row in enumerate(ids):
            if len(row) > self.max_length:
                raise EmbeddingRefused(_field(index, len(ids)), f"input is {len(row)} tokens; this model takes at "
                                       f"most {self.max_length}")
        return ids

    def check_dimensions(self, dimensions: int | None) -> int:
        """The output width for `dimensions`; EmbeddingRefused naming `dimensions` where the model cannot cut."""
        if dimensions is None or dimensions == self.width:
            return self.width
        if not self.spec.matryoshka:
            raise EmbeddingRefused("dimensions", f"this model's embeddings have {self.width} dimensions and it "
                                   "declares no Matryoshka training, so they cannot be shortened")
        if dimensions > self.width:
            raise EmbeddingRefused("dimensions", f"at most {self.width} for this model")
        return dimensions

    def embed(self, ids: list[list[int]], dimensions: int | None = None, batch_size: int = 32,
              turn_tokens: int | None = None,
              turn: Callable[[], AbstractContextManager[Any]] = nullcontext) -> np.ndarray:
        """[inputs, width] float32 vectors in input order, in length-sorted batches (at most `batch_size` inputs and
        `turn_tokens` padded tokens), each run inside `turn()` (the worker's share of the model among tenants; it
        may raise to drop the rest)."""
        width = self.check_dimensions(dimensions)
        encoded = batching.pack(ids, [0] * len(ids), self.tokenizer.pad_token_id)
        out = np.zeros((len(ids), width), dtype=np.float32)
        for indices in batching.sorted_batches(encoded, batch_size, turn_tokens):
            with turn() as pause, self.pauses.around(pause), torch.inference_mode(), self.plan.autocast():
                batch = batching.collate(encoded, indices)
                mask = batch["attention_mask"].to(self.plan.device)
                hidden = self.model(input_ids=batch["input_ids"].to(self.plan.device), attention_mask=mask)[0]
                vectors = pool(hidden, mask, self.spec.modes)
                if width != self.width:  # Matryoshka: cut, then renormalise
                    vectors = F.normalize(vectors[:, :width], p=2, dim=1)
                elif self.spec.normalize:
                    vectors = F.normalize(vectors, p=2, dim=1)
                out[indices] = vectors.float().cpu().numpy()
        return out


def _field(index: int, count: int) -> str:
    return "input" if count == 1 else f"input.{index}"
