"""Reading docker-compose.gpu.yml and .env.example the way `docker compose` does, for the deployment tests."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.gpu.yml"
ENV_EXAMPLE = ROOT / ".env.example"
# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?message}, ${VAR?message}; $$ is a literal $.
_REF = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def read_env_file(path: Path = ENV_EXAMPLE) -> dict[str, str]:
    """KEY=VALUE lines of a compose env file (comments and blank lines skipped)."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


def references(text: str) -> set[str]:
    """Names of the variables `text` interpolates."""
    return {m.group(1) for m in _REF.finditer(text) if m.group(1)}


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution; an unset required variable raises KeyError."""

    def one(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if name is None:
            return "$"
        value = env.get(name)
        empty = value is None or (op is not None and op.startswith(":") and value == "")
        if op in (":-", "-") and empty:
            return arg or ""
        if op in (":?", "?") and empty:
            raise KeyError(f"{name}: {arg}")
        return value or ""

    return _REF.sub(one, text)


def load_compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    """The compose file with YAML merge keys applied and variables substituted from `env` (.env.example)."""
    env = read_env_file() if env is None else env
    return yaml.safe_load(interpolate(COMPOSE.read_text(), env))


def app_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Services built from this repository (the trainserve images), by name."""
    return {name: svc for name, svc in compose["services"].items() if "build" in svc}


def active(service: dict[str, Any], env: dict[str, str]) -> bool:
    """Whether `docker compose up` starts the service with the profiles COMPOSE_PROFILES enables."""
    enabled = {p.strip() for p in env.get("COMPOSE_PROFILES", "").split(",") if p.strip()}
    profiles = service.get("profiles") or []
    return not profiles or bool(enabled & set(profiles))


def environment(service: dict[str, Any], env_file: dict[str, str]) -> dict[str, str]:
    """A container's environment: its env_file entries, overridden by its `environment` block."""
    merged = dict(env_file) if service.get("env_file") else {}
    block = service.get("environment") or {}
    if isinstance(block, list):
        block = dict(item.split("=", 1) for item in block)
    merged.update({k: "" if v is None else str(v) for k, v in block.items()})
    return merged


def gpu_devices(service: dict[str, Any]) -> list[list[str]]:
    """device_ids of each GPU reservation of a service."""
    devices = (((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices")
    return [[str(d) for d in spec.get("device_ids", [])] for spec in devices or []]
