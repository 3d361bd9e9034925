"""The `trainserve` command: up, api, worker, migrate, keys, health; and, against a running service,
upload, train, follow, jobs and chat (trainserve/client)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from core.tasks import QUEUE_GENERATE, QUEUE_INFERENCE, QUEUE_TRAIN, train_queues


def _api(args: argparse.Namespace) -> int:
    import uvicorn

    from core.logs import configure_logging
    from core.settings import get_settings

    # JSON lines replace uvicorn's own log config (its loggers then go through the root handler).
    json_logs = get_settings().log_format == "json"
    if json_logs:
        configure_logging("json")
    uvicorn.run("app.main:create_app", factory=True, host=args.host, port=args.port, log_level="info",
                proxy_headers=False, **({"log_config": None} if json_logs else {}))
    return 0


QUEUES = (QUEUE_TRAIN, QUEUE_INFERENCE, QUEUE_GENERATE)


def device_arg(value: str) -> str:
    """`--device`: cpu, auto, cuda, cuda:N or a list cuda:N,cuda:M (argparse type: a bad value fails at parse time)."""
    names = [name.strip() for name in value.split(",")]
    single = len(names) == 1 and (names[0] in ("cpu", "auto", "cuda") or _is_cuda_index(names[0]))
    if single or all(_is_cuda_index(name) for name in names):
        return ",".join(names)
    raise argparse.ArgumentTypeError(f"must be cpu, auto, cuda:N or a list cuda:N,cuda:M, not {value!r}")


def devices_arg(value: str) -> int:
    """`--devices`: a count of at least one."""
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {value!r}")
    return int(value)


def queues_arg(value: str) -> str:
    """`--queues`: known queue names, comma-separated; generation runs alone (it needs the thread pool)."""
    names = [q.strip() for q in value.split(",")]
    unknown = [q for q in names if q not in QUEUES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown queue {unknown[0]!r}; choose from {', '.join(QUEUES)}")
    if QUEUE_GENERATE in names and len(names) > 1:
        raise argparse.ArgumentTypeError("generation cannot share a worker with other queues")
    return ",".join(names)


def worker_devices(device: str, devices: int | None) -> tuple[str, int, str | None]:
    """(TRAINSERVE_WORKER_DEVICE, device count, CUDA_VISIBLE_DEVICES or None) from --device and --devices.

    `--device cuda:0,cuda:1` owns those two GPUs; `--device cpu --devices 2` runs two gloo processes per job;
    `--devices N` with cuda or auto owns the first N GPUs. ValueError when the two disagree.
    """
    try:
        names = device_arg(device).split(",")
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"--device {exc}") from None
    if devices is not None and devices < 1:
        raise ValueError(f"--devices must be at least 1, not {devices}")
    if len(names) > 1 or _is_cuda_index(names[0]):
        if devices is not None and devices != len(names):
            raise ValueError(f"--device {device} names {len(names)} device(s) but --devices is {devices}")
        return "cuda:0", len(names), ",".join(n.split(":", 1)[1] for n in names)
    count = devices or 1
    if names[0] == "cpu":
        return "cpu", count, ""
    if names[0] == "cuda" or devices is not None:
        return "cuda:0" if names[0] == "cuda" else "auto", count, ",".join(str(i) for i in range(count))
    return "auto", 1, None


def pin_device(device: str, devices: int | None = None) -> int:
    """Pin this process to its device(s) before anything can initialise CUDA (inside it, they are cuda:0..N-1).

    Returns how many devices the worker owns.
    """
    name, count, visible = worker_devices(device, devices)
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    os.environ["TRAINSERVE_WORKER_DEVICE"] = name
    os.environ["TRAINSERVE_WORKER_DEVICES"] = str(count)
    return count


def _is_cuda_index(name: str) -> bool:
    return name.startswith("cuda:") and name[5:].isdigit()


def _worker(args: argparse.Namespace) -> int:
    try:
        owned = pin_device(args.device, args.devices)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    from core.settings import reload_settings

    reload_settings()  # the parser read settings before the devices were pinned (TRAINSERVE_WORKER_DEVICES)
    queues = args.queues.split(",")
    if QUEUE_TRAIN in queues:  # a worker owning N devices takes jobs of every size up to N
        args.queues = ",".join([q for q in queues if q != QUEUE_TRAIN] + train_queues(owned))
    os.environ["TRAINSERVE_WORKER_QUEUES"] = args.queues
    from worker.app import celery

    name = f"{args.queues.replace(',', '+')}-{args.device.replace(':', '').replace(',', '+')}-{os.getpid()}" \
           f"@{socket.gethostname()}"
    # Solo pool: the task runs in the worker's main process, so a shutdown signal reaches the training loop,
    # which checkpoints and requeues its job instead of losing it.
    if args.queues in (QUEUE_GENERATE, QUEUE_INFERENCE):
        # Generation tasks mostly wait on the engine's batch: many threads keep many requests in flight. Inference
        # tasks take turns at the model batch by batch, round robin over tenants (worker/servers/fair_turns.py), so a
        # long request of one tenant cannot hold the model while another tenant's short one waits.
        from core.settings import get_settings

        settings = get_settings()
        threads = settings.generation_threads if args.queues == QUEUE_GENERATE else settings.inference_threads
        pool = ["--pool=threads", f"--concurrency={threads}"]
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
    worker = sub.add_parser("worker", help="run a Celery worker pinned to its device(s)")
    worker.add_argument("--device", default="auto", type=device_arg,
                        help="cpu, cuda:N, auto, or the GPUs of multi-device jobs: cuda:0,cuda:1")
    worker.add_argument("--devices", type=devices_arg, default=None,
                        help="devices this worker owns for multi-device jobs (with cpu: gloo processes)")
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
    from trainserve.client.commands import register

    register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `trainserve` script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
