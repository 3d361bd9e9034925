"""The `trainserve` command: up, api, worker, migrate, keys, health."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from core.tasks import QUEUE_GENERATE, QUEUE_INFERENCE, QUEUE_TRAIN


def _api(args: argparse.Namespace) -> int:
    import uvicorn

    uvicorn.run("app.main:create_app", factory=True, host=args.host, port=args.port, log_level="info",
                proxy_headers=False)
    return 0


QUEUES = (QUEUE_TRAIN, QUEUE_INFERENCE, QUEUE_GENERATE)


def device_arg(value: str) -> str:
    """`--device`: cpu, auto or cuda:N (argparse type, so a bad value fails at parse time)."""
    if value in ("cpu", "auto") or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"must be cpu, auto or cuda:N, not {value!r}")


def queues_arg(value: str) -> str:
    """`--queues`: known queue names, comma-separated; generation runs alone (it needs the thread pool)."""
    names = [q.strip() for q in value.split(",")]
    unknown = [q for q in names if q not in QUEUES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown queue {unknown[0]!r}; choose from {', '.join(QUEUES)}")
    if QUEUE_GENERATE in names and len(names) > 1:
        raise argparse.ArgumentTypeError("generation cannot share a worker with other queues")
    return ",".join(names)


def pin_device(device: str) -> None:
    """Pin this process to `device` before anything can initialise CUDA; inside it, cuda:N is cuda:0."""
    if device.startswith("cuda:"):
        os.environ["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        os.environ["TRAINSERVE_WORKER_DEVICE"] = "cuda:0"
    elif device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["TRAINSERVE_WORKER_DEVICE"] = "cpu"
    else:
        os.environ["TRAINSERVE_WORKER_DEVICE"] = "auto"


def _worker(args: argparse.Namespace) -> int:
    device = args.device
    pin_device(device)
    os.environ["TRAINSERVE_WORKER_QUEUES"] = args.queues
    from worker.app import celery

    name = f"{args.queues.replace(',', '+')}-{device.replace(':', '')}-{os.getpid()}@{socket.gethostname()}"
    # Solo pool: the task runs in the worker's main process, so a shutdown signal reaches the training loop,
    # which checkpoints and requeues its job instead of losing it.
    if args.queues == QUEUE_GENERATE:
        # Generation tasks mostly wait on the engine's batch: many threads keep many requests in flight.
        from core.settings import get_settings

        pool = ["--pool=threads", f"--concurrency={get_settings().generation_threads}"]
    else:
        pool = ["--pool=solo", "--concurrency=1"]
    celery.worker_main(["worker", *pool, "-Q", args.queues, "-n", name, "--loglevel", args.loglevel,
                        "--without-gossip", "--without-mingle"])
    return 0


def _migrate(_: argparse.Namespace) -> int:
    from core.migrate import upgrade
    from core.settings import get_settings

    upgrade(get_settings().resolved_database_url)
    print("database is at the latest revision")
    return 0


def _keys(args: argparse.Namespace) -> int:
    from core.auth import create_key, list_keys, revoke_key
    from core.db import make_engine, make_sessionmaker, session_scope
    from core.settings import get_settings

    engine = make_engine(get_settings().resolved_database_url)
    with session_scope(make_sessionmaker(engine)) as session:
        if args.keys_command == "create":
            row, raw = create_key(session, name=args.name, tenant_id=args.tenant, is_admin=args.admin)
            print(f"created key {row.id} (tenant {row.tenant_id}{', admin' if row.is_admin else ''}); "
                  "it is shown only once:", file=sys.stderr)
            print(raw)
        elif args.keys_command == "revoke":
            revoke_key(session, key_id=args.key_id)
            print(f"revoked {args.key_id}")
        else:
            for row in list_keys(session):
                state = "revoked" if row.revoked_at else "active"
                print(f"{row.id}\t{row.prefix}...\t{row.name}\t{row.tenant_id}\t"
                      f"{'admin' if row.is_admin else 'user'}\t{state}")
    engine.dispose()
    return 0


def _health(args: argparse.Namespace) -> int:
    """Container health check: the API's /health (--url), else the broker and database a worker needs."""
    if args.url:
        import urllib.request

        try:
            with urllib.request.urlopen(args.url, timeout=args.timeout) as response:  # noqa: S310 - our own URL
                ok = response.status == 200
        except OSError as exc:
            print(f"unhealthy: {args.url}: {exc}", file=sys.stderr)
            return 1
        return 0 if ok else 1
    from sqlalchemy import text

    from core.db import make_engine
    from core.redis_client import redis_from_url
    from core.settings import get_settings

    settings = get_settings()
    try:
        client = redis_from_url(settings.resolved_redis_url, socket_timeout=args.timeout)
        client.ping()
        client.close()
        engine = make_engine(settings.resolved_database_url)
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
    except Exception as exc:  # noqa: BLE001 - any failure to reach either means unhealthy
        print(f"unhealthy: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def _up(args: argparse.Namespace) -> int:
    from trainserve.supervisor import run_up

    home = Path(args.home or os.environ.get("TRAINSERVE_HOME", "./var"))
    return run_up(host=args.host, port=args.port, home=home, devices=args.devices)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and --help)."""
    parser = argparse.ArgumentParser(prog="trainserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="local mode: embedded Redis, migrations, API and workers in one command")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--home", default=None, help="data folder (default $TRAINSERVE_HOME or ./var)")
    up.add_argument("--devices", default=os.environ.get("TRAINSERVE_DEVICES", "auto"),
                    help="training devices: auto, cpu, or a list like cuda:0,cuda:1")
    up.set_defaults(func=_up)
    api = sub.add_parser("api", help="run the HTTP API")
    api.add_argument("--host", default="127.0.0.1")
    api.add_argument("--port", type=int, default=8000)
    api.set_defaults(func=_api)
    worker = sub.add_parser("worker", help="run a Celery worker pinned to one device")
    worker.add_argument("--device", default="auto", type=device_arg, help="cpu, cuda:N or auto")
    worker.add_argument("--queues", default="training", type=queues_arg,
                        help="training, inference or generation (training and inference may be combined)")
    worker.add_argument("--loglevel", default="INFO")
    worker.set_defaults(func=_worker)
    keys = sub.add_parser("keys", help="manage API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="create a key and print it once")
    create.add_argument("--name", required=True)
    create.add_argument("--tenant", default=None, help="tenant to join (default: a new tenant)")
    create.add_argument("--admin", action="store_true", help="admin keys see every tenant")
    revoke = keys_sub.add_parser("revoke", help="revoke a key by id")
    revoke.add_argument("key_id")
    keys_sub.add_parser("list", help="list keys (never the keys themselves)")
    keys.set_defaults(func=_keys)
    migrate = sub.add_parser("migrate", help="apply database migrations")
    migrate.set_defaults(func=_migrate)
    health = sub.add_parser("health", help="exit 0 when healthy (container HEALTHCHECK)")
    health.add_argument("--url", default=None, help="check this /health URL (the API); default: the worker's "
                        "broker and database from TRAINSERVE_REDIS_URL and TRAINSERVE_DATABASE_URL")
    health.add_argument("--timeout", type=float, default=5.0)
    health.set_defaults(func=_health)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `trainserve` script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
