"""`trainserve up`: one command that runs Redis, migrations, the API and the workers, and stops them all."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from core.rows import DEFAULT_TENANT
from core.settings import Settings
from trainserve.redis_server import start_redis


@dataclass
class Child:
    """A supervised process: restarted when it dies unexpectedly."""

    name: str
    args: list[str]
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    restarts: list[float] = field(default_factory=list)

    def start(self) -> None:
        # Own session: Ctrl-C reaches only the supervisor, which then stops children in order.
        self.process = subprocess.Popen(self.args, env=self.env, start_new_session=True)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


def _say(message: str) -> None:
    print(f"[trainserve] {message}", flush=True)


def worker_devices(devices: str) -> list[str]:
    """The training workers to start: one per listed device; auto means every visible GPU, else the CPU."""
    if devices != "auto":
        return [d.strip() for d in devices.split(",") if d.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=True).stdout
        gpus = [f"cuda:{line.strip()}" for line in out.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        gpus = []
    return gpus or ["cpu"]


def ensure_admin_key(settings: Settings) -> Path:
    """On first start, create an admin key and write it to <home>/admin.key, readable by the owner only."""
    from core.auth import Unauthorized, authenticate, create_key
    from core.db import make_engine, make_sessionmaker, session_scope

    path = settings.home / "admin.key"
    engine = make_engine(settings.resolved_database_url)
    factory = make_sessionmaker(engine)
    try:
        if path.is_file():
            with factory() as session:
                try:
                    authenticate(session, authorization=f"Bearer {path.read_text().strip()}")
                    return path
                except Unauthorized:
                    pass  # the database was reset or the key revoked: issue a new one
        with session_scope(factory) as session:
            _, raw = create_key(session, name="local admin", tenant_id=DEFAULT_TENANT, is_admin=True)
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(raw + "\n")
    finally:
        engine.dispose()
    return path


def make_private(home: Path) -> None:
    """Create (or tighten) `home` as 0700 and make everything this process and its children create owner-only.

    The umask is inherited by Redis, the API and the workers, so the database, datasets, artifacts and the
    append-only file are 0600 (folders 0700) however they are created.
    """
    os.umask(0o077)
    home.mkdir(parents=True, exist_ok=True)
    home.chmod(0o700)
    # A home written before this release (or by another tool) keeps no group/other bits either.
    for folder, dirs, files in os.walk(home):
        for name in (*dirs, *files):
            path = Path(folder, name)
            mode = path.lstat().st_mode
            if mode & 0o077 and not stat.S_ISLNK(mode):
                path.chmod(stat.S_IMODE(mode) & 0o700)


def run_up(*, host: str, port: int, home: Path, devices: str) -> int:
    """Start everything and supervise it until SIGINT/SIGTERM."""
    home = home.resolve()
    make_private(home)
    env = dict(os.environ, TRAINSERVE_HOME=str(home), PYTHONUNBUFFERED="1")
    redis_proc = None
    if not env.get("TRAINSERVE_REDIS_URL"):
        redis_proc = start_redis(home)
        _say(f"embedded Redis on {home / 'redis.sock'}")
    from core.migrate import upgrade

    settings = Settings(home=home, database_url=env.get("TRAINSERVE_DATABASE_URL") or None)
    upgrade(settings.resolved_database_url)
    _say(f"database ready: {settings.resolved_database_url.split('@')[-1]}")
    key_file = ensure_admin_key(settings)
    _say(f"admin API key in {key_file} (send it as 'Authorization: Bearer <key>')")

    cli = [sys.executable, "-m", "trainserve.cli"]
    children = [Child("api", [*cli, "api", "--host", host, "--port", str(port)], env)]
    workers = [(f"worker[{device}]", ["--device", device]) for device in worker_devices(devices)]
    workers += [("worker[inference]", ["--device", "auto", "--queues", "inference"]),
                ("worker[generation]", ["--device", "auto", "--queues", "generation"])]
    metrics_base = int(env.get("TRAINSERVE_WORKER_METRICS_PORT") or 0)
    for index, (name, worker_args) in enumerate(workers):
        # One host, several workers: each serves its metrics on the next port up from the configured one.
        worker_env = dict(env, TRAINSERVE_WORKER_METRICS_PORT=str(metrics_base + index)) if metrics_base else env
        children.append(Child(name, [*cli, "worker", *worker_args], worker_env))
        if metrics_base:
            _say(f"{name} metrics on http://{host}:{metrics_base + index}/metrics")

    stop = False

    def _stop(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    for child in children:
        child.start()
    _say(f"API on http://{host}:{port} (docs at /docs); home {home}; Ctrl-C stops everything")
    try:
        while not stop:
            time.sleep(0.5)
            for child in children:
                if not child.alive() and not stop:
                    _restart(child)
    finally:
        _shutdown(children, redis_proc)
    return 0


def _restart(child: Child) -> None:
    now = time.monotonic()
    child.restarts = [t for t in child.restarts if now - t < 60] + [now]
    code = child.process.returncode if child.process else None
    if len(child.restarts) > 5:
        _say(f"{child.name} exited (code {code}) 5 times within a minute; waiting before restarting")
        time.sleep(10)
    _say(f"{child.name} exited (code {code}); restarting")
    child.start()


def _shutdown(children: list[Child], redis_proc: subprocess.Popen[bytes] | None) -> None:
    _say("stopping: workers checkpoint their running jobs and requeue them")
    for child in children:
        if child.alive():
            assert child.process is not None
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 60
    for child in children:
        if child.process is None:
            continue
        try:
            child.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            _say(f"{child.name} did not stop in time; killing it")
            child.process.kill()
            child.process.wait()
    if redis_proc is not None:
        redis_proc.terminate()
        try:
            redis_proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            redis_proc.kill()
    _say("stopped")
