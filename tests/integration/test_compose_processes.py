"""docker-compose.gpu.yml run as local processes: each service's own command and environment (devices mapped to
the CPU, the stores to the test PostgreSQL and Redis), the migration one-shot first, then train, classify and
generate through the API. No container engine runs here; this proves the compose file's commands and settings."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import make_url

from tests.compose_file import active, app_services, environment, load_compose, read_env_file
from tests.conftest import PG_ADMIN_URL
from tests.factories import sentiment_rows, tsv_bytes
from tests.integration.conftest import stop_all, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture()
def empty_database() -> Iterator[str]:
    """A database with no schema at all: the compose `migrate` service has to create it."""
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"trainserve_compose_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    yield make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def local_command(command: list[str], port: int) -> list[str]:
    """The container's `trainserve ...` as a local process: devices on the CPU, the API on a free local port."""
    assert command[0] == "trainserve"
    args = list(command[1:])
    for i, arg in enumerate(args[:-1]):
        if arg == "--device" and args[i + 1].startswith("cuda:"):
            args[i + 1] = "cpu"
        elif arg == "--port":
            args[i + 1] = str(port)
        elif arg == "--host":
            args[i + 1] = "127.0.0.1"
    args = [a.replace("http://127.0.0.1:8000/", f"http://127.0.0.1:{port}/") for a in args]
    return [sys.executable, "-m", "trainserve.cli", *args]


def test_compose_services_as_processes_migrate_train_classify_generate(tmp_path, empty_database, redis_url,
                                                                       tiny_bert_dir):
    from tests.tiny_lm import build_tiny_gpt2

    env_file = read_env_file()
    compose = load_compose(env_file)
    services = {name: svc for name, svc in app_services(compose).items() if active(svc, env_file)}
    home = tmp_path / "home"
    port = _free_port()
    local = {"TRAINSERVE_DATABASE_URL": empty_database, "TRAINSERVE_REDIS_URL": redis_url,
             "TRAINSERVE_HOME": str(home), "TRAINSERVE_MODEL_ROOTS": str(tiny_bert_dir.parent),
             "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRAINSERVE_")}

    def env_of(name: str) -> dict[str, str]:
        service_env = environment(services[name], env_file)
        assert service_env["TRAINSERVE_DATABASE_URL"].startswith("postgresql+psycopg://trainserve:")
        assert service_env["TRAINSERVE_REDIS_URL"] == "redis://redis:6379/0"
        return {**base, **service_env, **local}

    # 1. the one-shot migration, on an empty database, as every other service waits for it to succeed
    migrate = subprocess.run(local_command(services["migrate"]["command"], port), env=env_of("migrate"),
                             capture_output=True, text=True, timeout=120)
    assert migrate.returncode == 0, migrate.stderr
    engine = create_engine(empty_database)
    assert {"jobs", "datasets", "api_keys", "outbox"} <= set(inspect(engine).get_table_names())
    engine.dispose()

    # 2. the long-running services: the API and every worker `docker compose up` starts with .env.example
    long_running = [n for n in services if n != "migrate"]
    assert {"api", "train-gpu0", "generate-gpu0", "inference"} == set(long_running)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name in long_running:
            log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115
            procs[name] = subprocess.Popen(local_command(services[name]["command"], port), env=env_of(name),
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        key = subprocess.run([sys.executable, "-m", "trainserve.cli", "keys", "create", "--name", "admin", "--admin"],
                             env=env_of("api"), capture_output=True, text=True, timeout=60, check=True).stdout.strip()
        base_url = f"http://127.0.0.1:{port}"

        def api_up() -> bool:
            for name, proc in procs.items():
                assert proc.poll() is None, f"{name} exited: {(tmp_path / f'{name}.log').read_text()[-3000:]}"
            try:
                return httpx.get(f"{base_url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(api_up, 60, "the api service to answer /health")
        # each service's own health check command passes against the running service
        for name in long_running:
            check = services[name]["healthcheck"]["test"][1:]
            result = subprocess.run(local_command(check, port), env=env_of(name), capture_output=True, text=True,
                                    timeout=60)
            assert result.returncode == 0, f"{name} health check: {result.stderr}"

        api = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        ds = api.post("/datasets", files={"file": ("train.tsv", tsv_bytes(sentiment_rows(4)))})
        assert ds.status_code == 201, ds.text
        body = {"base_model": str(tiny_bert_dir), "train_dataset": ds.json()["id"], "text_column": "sentence",
                "label_column": "label",
                "hyperparameters": {"epochs": 6, "batch_size": 8, "learning_rate": 5e-3, "warmup_ratio": 0.1,
                                    "max_length": 32}}
        job = api.post("/jobs", json=body)
        assert job.status_code == 201, job.text
        job_id = job.json()["id"]
        done = wait_for(lambda: (j := api.get(f"/jobs/{job_id}").json())["status"] in ("succeeded", "failed") and j,
                        180, "the training job to finish")
        assert done["status"] == "succeeded", done["error"]
        result = api.post("/classify", json={"model": job_id, "texts": ["superb and touching", "dull and lifeless"]})
        assert result.status_code == 200, result.text
        assert [p["label"] for p in result.json()["predictions"]] == [1, 0]

        # a causal LM under <home>/models is served by the generation worker the compose file starts
        build_tiny_gpt2(home / "models" / "tiny-gpt2")
        assert "tiny-gpt2" in [m["id"] for m in api.get("/v1/models").json()["data"]]
        generated = api.post("/generate", json={"model": "tiny-gpt2", "prompt": "ROMEO:", "max_new_tokens": 8,
                                                "temperature": 0})
        assert generated.status_code == 200, generated.text
        assert generated.json()["usage"]["completion_tokens"] > 0
    finally:
        stop_all(list(procs.values()))
