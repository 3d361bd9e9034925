"""A started service for a whole module or session: the API and a training and a generation worker as processes.

Starting them costs tens of seconds on a loaded 2-core machine (each imports torch, transformers, FastAPI), so
tests that only need a running service share one (`scope="module"`) and keep to their own tenants and jobs;
`make test` runs xdist with `--dist loadscope`, so one worker runs the whole module and starts it once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import redis as redis_lib
from sqlalchemy import create_engine, text

from core.rows import Base
from tests.conftest import REFUSALS_UNBOUNDED, ROOT
from tests.integration.conftest import _free_port, stop_all, wait_for

ROLES = (("training", ["worker", "--device", "cpu", "--queues", "training,inference"]),
         ("generation", ["worker", "--device", "cpu", "--queues", "generation"]))


@contextmanager
def started_service(pg_url: str, redis_url: str, home: Path, logs: Path, *,
                    roles: tuple[tuple[str, list[str]], ...] = ROLES, **env: str) -> Iterator[str]:
    """Run `trainserve api` and the workers (`roles`: the two of ROLES) on `pg_url`, `redis_url` and `home`; yields
    the API's base URL.

    Redis's database is emptied first (an unreachable Redis fails the test: never a silent skip); on exit the
    processes stop and the test database's tables are emptied for the tests after this module.
    """
    client = redis_lib.Redis.from_url(redis_url)
    client.flushdb()
    client.close()
    port = _free_port()
    env = dict(os.environ, TRAINSERVE_HOME=str(home), TRAINSERVE_DATABASE_URL=pg_url, TRAINSERVE_REDIS_URL=redis_url,
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **{"TRAINSERVE_GENERATION_PRECISION": "fp32",
                                                            "TRAINSERVE_REFUSAL_BURST": str(REFUSALS_UNBOUNDED), **env})
    procs: list[subprocess.Popen[bytes]] = []
    for name, args in (("api", ["api", "--port", str(port)]), *roles):
        log = open(logs / f"{name}.log", "wb")  # noqa: SIM115
        procs.append(subprocess.Popen([sys.executable, "-m", "trainserve.cli", *args], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, cwd=ROOT))
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert procs[0].poll() is None, (logs / "api.log").read_text()
        try:
            return httpx.get(f"{base}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(healthy, 60, "the API process to answer /health")
        yield base
    finally:
        stop_all(procs)
        engine = create_engine(pg_url)
        with engine.begin() as conn:
            conn.execute(text(f"TRUNCATE {', '.join(t.name for t in Base.metadata.sorted_tables)} CASCADE"))
        engine.dispose()
