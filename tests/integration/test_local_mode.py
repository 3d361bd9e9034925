"""`trainserve up`: embedded Redis + SQLite + API + workers from one command, side by side, stopped by Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.factories import sentiment_rows, tsv_bytes
from tests.integration.conftest import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(proc, base: str, log_path: Path, what: str) -> None:
    """Wait until the process at `base` answers /health; fail with its log if it exits first."""

    def healthy():
        assert proc.poll() is None, log_path.read_text()
        try:
            return httpx.get(f"{base}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(healthy, 60, f"{what} to answer /health")


def _up(home, log_path, **extra_env):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINSERVE_")}
    env.update(HF_HUB_OFFLINE="1", TRAINSERVE_CHECKPOINT_STEPS="50", TRAINSERVE_MODEL_ROOTS=str(home.parent.parent))
    env.update(extra_env)
    log = open(log_path, "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "trainserve.cli", "up", "--port", str(port), "--home", str(home),
                             "--devices", "cpu"], env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(proc, base, log_path, "trainserve up")
    key_file = home / "admin.key"
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"
    client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key_file.read_text().strip()}"},
                          timeout=30)
    assert httpx.get(f"{base}/jobs").status_code == 401
    return proc, client


def _processes() -> list[tuple[int, int, str]]:
    """(pid, ppid, command line) of every process, read from /proc (ps truncates long command lines)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command name in (...) may contain spaces
        found.append((int(entry.name), ppid, cmdline))
    return found


def _children(pid: int) -> list[int]:
    return [child for child, parent, _ in _processes() if parent == pid]


def test_two_instances_side_by_side_train_serve_and_stop_cleanly(tmp_path, tiny_bert_dir):
    first, api = _up(tmp_path / "a", tmp_path / "a.log")
    second, other = _up(tmp_path / "b", tmp_path / "b.log")
    try:
        files = {"file": ("train.tsv", tsv_bytes(sentiment_rows(4)))}
        ds = api.post("/datasets", files=files).json()["id"]
        assert other.get(f"/datasets/{ds}").status_code == 404  # separate homes, separate stores
        body = {"base_model": str(tiny_bert_dir), "train_dataset": ds, "eval_dataset": ds,
                "text_column": "sentence", "label_column": "label",
                "hyperparameters": {"epochs": 6, "batch_size": 8, "learning_rate": 5e-3, "warmup_ratio": 0.1,
                                    "max_length": 32}}
        job = api.post("/jobs", json=body).json()
        done = wait_for(lambda: (j := api.get(f"/jobs/{job['id']}").json())["status"]
                        in ("succeeded", "failed") and j, 240, "the job to finish")
        assert done["status"] == "succeeded", done["error"]
        result = api.post("/classify", json={"model": job["id"], "texts": ["superb and touching"]}, timeout=60)
        assert result.status_code == 200 and result.json()["predictions"][0]["label"] == 1
        assert (tmp_path / "a" / "trainserve.db").is_file()
    finally:
        kids = {proc.pid: _children(proc.pid) for proc in (first, second)}
        for proc in (first, second):  # both stop at once: their shutdowns overlap
            proc.send_signal(signal.SIGINT)
        for proc in (first, second):
            assert proc.wait(90) == 0
        time.sleep(0.5)
        for proc in (first, second):
            alive = [k for k in kids[proc.pid]
                     if subprocess.run(["kill", "-0", str(k)], capture_output=True).returncode == 0]
            assert alive == [], f"children still running after Ctrl-C: {alive}"


def _training_worker(pid: int) -> int:
    for child, parent, args in _processes():
        if parent == pid and "worker --device cpu" in args and "--queues" not in args:
            return child
    raise AssertionError("no training worker found")


def _open_to_others(home: Path) -> list[str]:
    """Every path under home (home included) that its group or others may read, write or enter."""
    found = [] if home.stat().st_mode & 0o077 == 0 else [f"{home} {oct(home.stat().st_mode & 0o777)}"]
    for path in home.rglob("*"):
        mode = path.lstat().st_mode
        if not path.is_symlink() and mode & 0o077:
            found.append(f"{path.relative_to(home)} {oct(mode & 0o777)}")
    return found


def test_local_mode_files_are_private(tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    old = home / "left-from-an-older-release.txt"
    old.write_text("x")
    old.chmod(0o644)
    proc, api = _up(home, tmp_path / "up.log")
    try:
        ds = api.post("/datasets", files={"file": ("train.tsv", tsv_bytes(sentiment_rows(2)))})
        assert ds.status_code == 201, ds.text
        # Redis creates its append-only files in the background shortly after it starts.
        wait_for(lambda: any(p.is_file() for p in home.rglob("*.aof*")), 30, "Redis's append-only file")
        assert (home / "trainserve.db").is_file() and any((home / "datasets").rglob("*"))
        assert _open_to_others(home) == []
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0
    assert _open_to_others(home) == []
