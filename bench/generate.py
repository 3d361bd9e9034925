"""Benchmark: N concurrent HTTP clients against `trainserve up` vs one-at-a-time `model.generate`.

Both sides use the same GPT-2 (GPT-2-small shape by default, random weights from a fixed seed), the same
prompts and the same number of new tokens per prompt, in one invocation. Baseline "sequential-hf-generate":
Hugging Face `model.generate`, greedy, one prompt at a time, in this process. Candidate: the full service
(API, Celery over Redis, the generation worker's continuous batcher), streaming, greedy.

    python bench/generate.py                      # GPT-2 small, 32 prompts x 64 tokens, 16 clients
    python bench/generate.py --layers 2 --requests 8 --max-new-tokens 16   # quick smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "assets" / "gpt2-tokenizer"
CORPUS = ROOT / "examples" / "data" / "tinyshakespeare_sample.txt"


def prompts(count: int) -> list[str]:
    """Distinct Shakespeare lines of different lengths, the same for both sides."""
    lines = [line.strip() for line in CORPUS.read_text().splitlines() if len(line.strip()) > 20]
    return [lines[(i * 37) % len(lines)] for i in range(count)]


def build_model(folder: Path, layers: int) -> None:
    """GPT-2-small shape (or fewer layers), random weights, saved as safetensors with the GPT-2 tokenizer."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers))
    # The eos id never wins under random weights in practice; suppress it anyway so both sides always
    # generate exactly max_new_tokens and the token counts are equal.
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder, safe_serialization=True)
    GPT2TokenizerFast.from_pretrained(TOKENIZER).save_pretrained(folder)


def baseline(folder: Path, texts: list[str], max_new_tokens: int) -> tuple[float, int]:
    """Sequential greedy model.generate; returns (seconds, new tokens)."""
    tokenizer = GPT2TokenizerFast.from_pretrained(folder)
    model = GPT2LMHeadModel.from_pretrained(folder).eval()
    with torch.inference_mode():
        ids = tokenizer("warm up", return_tensors="pt").input_ids
        model.generate(ids, do_sample=False, max_new_tokens=4, pad_token_id=0)
        tokens, start = 0, time.perf_counter()
        for text in texts:
            ids = tokenizer(text, return_tensors="pt").input_ids
            out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, pad_token_id=0)
            tokens += out.shape[1] - ids.shape[1]
    return time.perf_counter() - start, tokens


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_service(home: Path, port: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINSERVE_")}
    env.update(HF_HUB_OFFLINE="1", TRAINSERVE_DEVICES="cpu")
    log = open(home / "up.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "trainserve.cli", "up", "--port", str(port), "--home", str(home)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"trainserve up did not start; see {home / 'up.log'}")


def one_request(client: httpx.Client, model: str, text: str, max_new_tokens: int) -> tuple[float, float, int]:
    """Stream one completion; returns (time to first token, total time, completion tokens)."""
    start = time.perf_counter()
    first = None
    body = {"model": model, "prompt": text, "max_new_tokens": max_new_tokens, "temperature": 0, "stream": True}
    with client.stream("POST", "/generate", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "text" in event and first is None:
                first = time.perf_counter() - start
            if "usage" in event:
                tokens = event["usage"]["completion_tokens"]
    return first or 0.0, time.perf_counter() - start, tokens


def service(port: int, key: str, model: str, texts: list[str], max_new_tokens: int, clients: int
            ) -> tuple[float, int, list[float]]:
    """N concurrent streaming clients; returns (seconds, new tokens, TTFTs)."""
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers) as client:
        one_request(client, model, "warm up", 4)  # loads the model into the generation worker
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=clients) as pool:
            results = list(pool.map(lambda t: one_request(client, model, t, max_new_tokens), texts))
        elapsed = time.perf_counter() - start
    return elapsed, sum(r[2] for r in results), [r[0] for r in results]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    texts = prompts(args.requests)
    with tempfile.TemporaryDirectory(prefix="trainserve-bench-") as tmp:
        home = Path(tmp)
        folder = home / "models" / "gpt2-bench"
        build_model(folder, args.layers)
        base_s, base_tokens = baseline(folder, texts, args.max_new_tokens)
        port = free_port()
        proc = start_service(home, port)
        try:
            key = (home / "admin.key").read_text().strip()
            svc_s, svc_tokens, ttft = service(port, key, "gpt2-bench", texts, args.max_new_tokens, args.concurrency)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(120)
    base_tps, svc_tps = base_tokens / base_s, svc_tokens / svc_s
    print(f"model: GPT-2 shape, {args.layers} layers, random weights; {args.requests} prompts x "
          f"{args.max_new_tokens} new tokens, greedy; torch threads {torch.get_num_threads()}")
    print(f"{'side':<40}{'tokens':>8}{'seconds':>10}{'tokens/s':>10}")
    print(f"{'sequential-hf-generate (baseline)':<40}{base_tokens:>8}{base_s:>10.1f}{base_tps:>10.1f}")
    print(f"{f'trainserve up, {args.concurrency} HTTP clients':<40}{svc_tokens:>8}{svc_s:>10.1f}{svc_tps:>10.1f}")
    print(f"ratio (trainserve / sequential-hf-generate): {svc_tps / base_tps:.2f}x")
    print(f"time to first token: p50 {percentile(ttft, 0.5) * 1000:.0f} ms, p99 {percentile(ttft, 0.99) * 1000:.0f} ms"
          f" (mean {statistics.mean(ttft) * 1000:.0f} ms)")


if __name__ == "__main__":
    main()
