"""Shared fixtures: a fresh PostgreSQL database migrated with Alembic, settings, an app with a fake queue."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from core.migrate import upgrade
from core.rows import Base
from core.settings import Settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PG_ADMIN_URL = os.environ.get("TRAINSERVE_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
# Under pytest-xdist each worker process (gw0, gw1, ...) runs its share of the tests; outside it there is one.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
WORKER_INDEX = int(XDIST_WORKER[2:]) if XDIST_WORKER.startswith("gw") else 0
WORKER_COUNT = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKER_COUNT > 1:  # each worker, and every process it starts, gets its share of the cores: no oversubscription
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // WORKER_COUNT)))


def _worker_redis_urls(unit: str, integration: str) -> tuple[str, str]:
    """Both test Redis URLs moved on to this worker's own databases: number + worker index.

    Worker n uses databases 0+n (API and worker-level tests) and 7+n (real worker processes, emptied by each
    test) by default, so parallel tests never see each other's keys, task messages or flushes.
    """
    (unit_server, unit_db), (int_server, int_db) = (u.rsplit("/", 1) for u in (unit, integration))
    first_unit, first_int = int(unit_db or 0), int(int_db or 0)
    blocks = [range(first_unit, first_unit + WORKER_COUNT), range(first_int, first_int + WORKER_COUNT)]
    if max(blocks[0][-1], blocks[1][-1]) > 15 or (unit_server == int_server and set(blocks[0]) & set(blocks[1])):
        raise pytest.UsageError(f"{WORKER_COUNT} xdist workers need Redis databases {first_unit}+ and {first_int}+ "
                                f"of 16 without overlap: run fewer workers (-n) or move TRAINSERVE_TEST_*REDIS_URL")
    return f"{unit_server}/{first_unit + WORKER_INDEX}", f"{int_server}/{first_int + WORKER_INDEX}"


REDIS_URL, INTEGRATION_REDIS = _worker_redis_urls(
    (unit := os.environ.get("TRAINSERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")),
    os.environ.get("TRAINSERVE_TEST_INTEGRATION_REDIS_URL", unit.rsplit("/", 1)[0] + "/7"))
ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "data"


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A throwaway PostgreSQL database for this test session, migrated to head with Alembic."""
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"trainserve_test_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:  # an unreachable server fails the run: never a silent skip
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    upgrade(url)
    yield url
    admin.dispose()  # pooled connections may predate a PostgreSQL restart made by a fault test
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture()
def clean_db(pg_url: str) -> Iterator[str]:
    """Each test starts with empty tables."""
    yield pg_url
    engine = create_engine(pg_url)
    with engine.begin() as conn:
        tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
        conn.execute(text(f"TRUNCATE {tables} CASCADE"))
    engine.dispose()


# Tests send refused requests in bulk on purpose (every route without a key, fuzzing, edge after edge) from one
# client; the refusal budget's own tests (tests/api/test_refusal_budget.py) and the load test set theirs.
REFUSALS_UNBOUNDED = 1_000_000


@pytest.fixture()
def settings(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, clean_db: str) -> Settings:
    """Settings on the test database with a temporary home; tiny models under pytest's tmp root are allowed."""
    # Generation in fp32: served output is compared token for token with HF generate in fp32; "auto" would pick
    # bf16 weights on CPUs where a bf16 decode step is faster (tests of bf16 and of auto ask for them explicitly).
    return Settings(home=tmp_path / "home", database_url=clean_db, redis_url=REDIS_URL, checkpoint_steps=2,
                    model_roots=str(tmp_path_factory.getbasetemp()), generation_precision="fp32",
                    refusal_burst=REFUSALS_UNBOUNDED)


@pytest.fixture()
def factory(settings: Settings) -> Iterator[Any]:
    """A session factory on the test database (for data-access calls made directly)."""
    from core.db import make_engine, make_sessionmaker

    engine = make_engine(settings.resolved_database_url)
    yield make_sessionmaker(engine)
    engine.dispose()


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny BERT (seed 0) with its tokenizer, built once per session: treat it as read-only."""
    from tests.tiny_models import build_tiny_bert

    return build_tiny_bert(tmp_path_factory.mktemp("tiny-bert") / "bert")


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GPT-2 (seed 0, 128 positions) with the GPT-2 tokenizer, built once per session: read-only."""
    from tests.tiny_lm import build_tiny_gpt2

    return build_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2") / "gpt2")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One moto S3 server for the session (a real HTTP S3 API in its own process)."""
    from tests.s3_server import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3") / "moto.log")
    yield server
    server.stop()


@pytest.fixture()
def s3_url(s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """A TRAINSERVE_STORAGE_URL on a fresh bucket; this process's AWS_* variables point at the test server."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return f"s3://{s3_server.new_bucket()}/trainserve"


def make_key(url: str, *, name: str = "test", tenant: str | None = None, admin: bool = False) -> str:
    """Create an API key directly in the database and return the raw key."""
    from core.auth import create_key
    from core.db import make_engine, make_sessionmaker, session_scope

    engine = make_engine(url)
    with session_scope(make_sessionmaker(engine)) as session:
        _, raw = create_key(session, name=name, tenant_id=tenant, is_admin=admin)
    engine.dispose()
    return raw


class RecordingQueue:
    """A TaskQueue that records what would be sent; `refuse` simulates a broker outage.

    `handlers[name]` (a worker function) runs each sent task of that name in a thread.
    """

    def __init__(self) -> None:
        self.sent: list[tuple[str, list[Any], str]] = []
        self.revoked: list[str] = []
        self.headers: list[dict[str, str] | None] = []
        self.refuse = False
        self.handlers: dict[str, Any] = {}

    def send(self, name: str, args: list[Any], *, queue: str, headers: dict[str, str] | None = None) -> str:
        from core.errors import BrokerUnavailable

        if self.refuse:
            raise BrokerUnavailable("task broker unavailable: ConnectionError")
        self.sent.append((name, args, queue))
        self.headers.append(headers)
        handler = self.handlers.get(name)
        if handler is not None:  # a worker's task function, run as a worker would: in the background
            threading.Thread(target=handler, args=args, daemon=True).start()
        return f"task-{len(self.sent)}"

    def revoke(self, task_id: str) -> None:
        self.revoked.append(task_id)


@pytest.fixture()
def queue() -> RecordingQueue:
    return RecordingQueue()


@pytest.fixture()
def client(settings: Settings, queue: RecordingQueue) -> Iterator[Any]:
    """A TestClient on an app built with the test settings and the recording queue."""
    from fastapi.testclient import TestClient

    from app.main import create_app

    with TestClient(create_app(settings=settings, task_queue=queue)) as test_client:
        test_client.headers["Authorization"] = f"Bearer {make_key(settings.resolved_database_url, tenant='tenant-a')}"
        yield test_client


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked gpu need CUDA; on a machine without it they are reported as skipped, by marker."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marker gpu)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama chat model (tests/tiny_chat.py), built once per session under the allowed model root."""
    from tests.tiny_chat import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "llama", seed=1)


@pytest.fixture(autouse=True)
def _poisoned_kv_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every KV cache pool the engine allocates in this process starts as NaN, not as whatever memory held: a
    position read unmasked before it was written (or zeroed when its block was first handed out) turns the output
    into NaN and fails the equality tests, instead of passing by luck on fresh zero pages."""
    import sys

    if "torch" not in sys.modules:  # a test that never loads torch allocates no cache
        return
    import torch

    from worker.engines.generation.caches.paged_cache import PagedCache

    allocate = PagedCache._allocate

    def poisoned(self: PagedCache, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = allocate(self, blocks)
        return keys.fill_(float("nan")), values.fill_(float("nan"))

    monkeypatch.setattr(PagedCache, "_allocate", poisoned)
