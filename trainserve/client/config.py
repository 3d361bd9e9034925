"""Where the client finds the service and its key: flags, then the environment, then a config file.

    TRAINSERVE_URL / TRAINSERVE_API_KEY        (the environment)
    ~/.config/trainserve/config.toml           (or $XDG_CONFIG_HOME/trainserve/config.toml, or $TRAINSERVE_CONFIG)
        url = "http://127.0.0.1:8000"
        api_key = "ts_..."
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

DEFAULT_URL = "http://127.0.0.1:8000"


class ConfigError(Exception):
    """The config file cannot be read, or no key was found anywhere."""


@dataclass(frozen=True)
class ClientConfig:
    """The service's base URL and the API key sent as a bearer token."""

    url: str
    api_key: str | None


def config_path() -> Path:
    """The config file this process reads (it need not exist)."""
    if explicit := os.environ.get("TRAINSERVE_CONFIG"):
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "trainserve" / "config.toml"


def _file_values(path: Path) -> dict[str, object]:
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc


def load_config(url: str | None = None, api_key: str | None = None) -> ClientConfig:
    """Flags win over the environment, which wins over the config file."""
    values = _file_values(config_path())
    found_url = url or os.environ.get("TRAINSERVE_URL") or values.get("url") or DEFAULT_URL
    found_key = api_key or os.environ.get("TRAINSERVE_API_KEY") or values.get("api_key")
    if not isinstance(found_url, str) or (found_key is not None and not isinstance(found_key, str)):
        raise ConfigError(f"{config_path()}: url and api_key must be strings")
    return ClientConfig(url=found_url.rstrip("/"), api_key=found_key or None)
