"""vLLM's CPU build under the settings trainserve chooses for it: how its engine threads are bound and whether LoRA
is enabled, measured as tokens/s of greedy completions at 16 concurrent streams.

Each configuration starts its own vLLM server (`make vllm`'s environment, eager, fp32, `--max-num-seqs 16`) on
SmolLM2-135M-Instruct, answers one warm-up request, then runs `--repeats` rounds of 32 completions of 64 tokens
(`ignore_eos`, so every round generates the same number of tokens), the configurations interleaved round by round
so a change in the machine's load reaches every one alike. Configurations:
- `auto`: vLLM's own binding (`VLLM_CPU_OMP_THREADS_BIND=auto`: one core kept for its API server);
- `auto-lora`: the same with `--enable-lora --max-loras 8 --max-lora-rank 64`;
- `all-cores`: one engine thread bound per core, none reserved (what trainserve's worker sets);
- `all-cores-lora`: the same with LoRA enabled.

Usage: HF_HUB_OFFLINE=1 .venv/bin/python bench/vllm_cpu_settings.py [--repeats 3]
       [--json bench/results/vllm-cpu-settings.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.generate import free_port  # noqa: E402
from bench.machine import describe, provenance  # noqa: E402
from trainserve.real_models import SMOLLM2_DIR, build_smollm2  # noqa: E402
from worker.engines.vllm.server import INSTALL_HINT, cpu_list, find_python  # noqa: E402

LORA = ["--enable-lora", "--max-loras", "8", "--max-lora-rank", "64"]
ALL_CORES = {"VLLM_CPU_OMP_THREADS_BIND": cpu_list(os.cpu_count() or 1), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
CONFIGS: dict[str, tuple[dict[str, str], list[str]]] = {
    "auto": ({"VLLM_CPU_OMP_THREADS_BIND": "auto"}, []),
    "auto-lora": ({"VLLM_CPU_OMP_THREADS_BIND": "auto"}, LORA),
    "all-cores": (ALL_CORES, []),
    "all-cores-lora": (ALL_CORES, LORA),
}
STREAMS, REQUESTS, TOKENS = 16, 32, 64


class Server:
    """One vLLM server of one configuration, paused (SIGSTOP) while another is measured."""

    def __init__(self, python: str, folder: Path, env: dict[str, str], flags: list[str], log: Path) -> None:
        self.port = free_port()
        environment = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONPATH")}
        environment.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", **env)
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--served-model-name",
                   "m", "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
                   "--max-num-seqs", str(STREAMS), "--max-model-len", "4096", "--disable-uvicorn-access-log", *flags]
        self.proc = subprocess.Popen(command, env=environment, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}; see {log}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM did not start; see {log}")

    def complete(self, index: int) -> int:
        body = {"model": "m", "prompt": f"Story {index}: once upon a time", "max_tokens": TOKENS, "temperature": 0,
                "ignore_eos": True}
        response = httpx.post(f"http://127.0.0.1:{self.port}/v1/completions", json=body, timeout=600)
        response.raise_for_status()
        return int(response.json()["usage"]["completion_tokens"])

    def round(self) -> float:
        """Tokens/s of REQUESTS completions at STREAMS at once."""
        started = time.perf_counter()
        with ThreadPoolExecutor(STREAMS) as pool:
            tokens = sum(pool.map(self.complete, range(REQUESTS)))
        return tokens / (time.perf_counter() - started)

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        self.proc.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    python = find_python()
    if python is None:
        raise SystemExit(INSTALL_HINT)
    folder = build_smollm2(SMOLLM2_DIR)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    servers: dict[str, Server] = {}
    rates: dict[str, list[float]] = {name: [] for name in names}
    loads = []
    try:
        for name in names:  # each started alone, then paused: one server computes at a time
            servers[name] = Server(python, folder, *CONFIGS[name], Path(f"/tmp/vllm-cpu-settings-{name}.log"))
            servers[name].complete(0)
            servers[name].signal(signal.SIGSTOP)
        for repeat in range(args.repeats):
            order = names[repeat % len(names):] + names[:repeat % len(names)]
            for name in order:
                servers[name].signal(signal.SIGCONT)
                servers[name].complete(0)
                rates[name].append(servers[name].round())
                servers[name].signal(signal.SIGSTOP)
                loads.append(os.getloadavg()[0])
                print(f"repeat {repeat} {name}: {rates[name][-1]:.1f} tokens/s", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    lines = [f"{name} {statistics.median(r):.1f} [{min(r):.1f}-{max(r):.1f}] tokens/s" for name, r in rates.items()]
    print("\n".join(lines))
    if args.json:
        base = statistics.median(rates["auto"]) if "auto" in rates else None
        ratios = [f"{name} {statistics.median(r) / base:.2f}x auto" for name, r in rates.items() if base]
        args.json.write_text(json.dumps({
            "benchmark": "bench/vllm_cpu_settings.py",
            "what": f"vLLM's CPU build (eager, fp32, --max-num-seqs {STREAMS}) on SmolLM2-135M-Instruct: tokens/s of "
                    f"{REQUESTS} greedy completions of {TOKENS} tokens at {STREAMS} streams, per thread binding and "
                    f"LoRA setting, medians [min-max] of {args.repeats} interleaved rounds",
            "command": "python bench/vllm_cpu_settings.py " + " ".join(sys.argv[1:]),
            "date": datetime.now(UTC).strftime("%Y-%m-%d"), "machine": describe(),
            **provenance("bench/vllm_cpu_settings.py"),
            "load": f"{min(loads):.1f}-{max(loads):.1f}", "result": "; ".join(lines + ratios)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
