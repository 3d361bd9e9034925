"""Benchmark: N concurrent HTTP clients against `trainserve up` vs batched and sequential `model.generate`.

All sides use the same model (GPT-2-small shape by default, or with `--arch llama` a Llama of about the same
size: 12 layers, hidden 768, 12 query / 4 kv heads, SwiGLU 2048, rotary, tied head; random weights from a
fixed seed, the GPT-2 BPE as tokenizer for both), the same
prompts and the same number of new tokens per prompt, greedy, in one invocation, interleaved round by round
(`--repeats` rounds; medians and spread printed). Baselines, in this process:
- "hf-batched fp32" and "hf-batched bf16" (the headline baselines, SDPA attention; the same with " eager" loaded
  with `attn_implementation="eager"`, and the headline ratio divides by the faster of the two): one
  `model.generate` per `--concurrency`
  prompts, left padded, with the model loaded in fp32 and in bf16 (`dtype=torch.bfloat16`): the precision a
  user would pick for the same comparison is the service's, so both are printed, with a ratio against each;
- "hf-sequential": fp32 `model.generate` one prompt at a time, over the first `--sequential` prompts only (it
  is slow; tokens/s does not depend on how many prompts it runs).
Candidate: the full service (API, Celery over Redis, the generation worker's continuous batcher), streaming,
at `--precision` (default auto: the worker's own calibration decides; the resolved one is printed).
Also printed: time to first token and inter-token latency percentiles of the service, how many of its
greedy outputs equal `generate`'s at the same dtype, and the generation worker's resident memory against
the fp32 checkpoint's size and against the weight bytes the worker holds.

    python bench/generate.py                      # GPT-2 small, 32 prompts x 64 tokens, 16 clients, 3 rounds
    python bench/generate.py --layers 2 --requests 8 --max-new-tokens 16 --repeats 1   # quick smoke run
    python bench/generate.py --arch llama         # the Llama-shaped model through the llama-family runner
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from core.paths import GPT2_TOKENIZER_DIR  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "examples" / "data" / "tinyshakespeare_sample.txt"


def prompts(count: int) -> list[str]:
    """Distinct Shakespeare lines of different lengths, the same for both sides."""
    lines = [line.strip() for line in CORPUS.read_text().splitlines() if len(line.strip()) > 20]
    return [lines[(i * 37) % len(lines)] for i in range(count)]


def build_model(folder: Path, layers: int, arch: str = "gpt2") -> None:
    """GPT-2-small shape or a Llama of that size (or fewer layers), random weights, safetensors, GPT-2 tokenizer."""
    torch.manual_seed(0)
    if arch == "llama":  # ~115M parameters (GPT-2 small: 124M): GQA 3:1, SwiGLU, rotary, the embedding tied
        config = LlamaConfig(vocab_size=50257, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
                             num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024,
                             tie_word_embeddings=True, bos_token_id=50256, eos_token_id=50256)
        model = AutoModelForCausalLM.from_config(config)
    else:
        model = GPT2LMHeadModel(GPT2Config(n_layer=layers))
    # The eos id never wins under random weights in practice; suppress it anyway so both sides always
    # generate exactly max_new_tokens and the token counts are equal.
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder, safe_serialization=True)
    GPT2TokenizerFast.from_pretrained(GPT2_TOKENIZER_DIR).save_pretrained(folder)


class HfSide:
    """The Hugging Face baselines over one loaded model, in the given dtype."""

    def __init__(self, folder: Path, max_new_tokens: int, dtype: torch.dtype = torch.float32,
                 attention: str = "sdpa") -> None:
        self.tokenizer = GPT2TokenizerFast.from_pretrained(folder)
        self.tokenizer.pad_token = self.tokenizer.eos_token  # any id: padded positions are masked out
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attention).eval()
        self.max_new_tokens = max_new_tokens
        with torch.inference_mode():  # warm-up, not timed
            self.model.generate(**self.tokenizer(["warm up"], return_tensors="pt"), do_sample=False,
                                max_new_tokens=4, pad_token_id=self.tokenizer.pad_token_id)

    def _generate(self, texts: list[str]) -> list[list[int]]:
        self.tokenizer.padding_side = "left"  # decoder-only models pad on the left for generation
        batch = self.tokenizer(texts, return_tensors="pt", padding=True)
        out = self.model.generate(**batch, do_sample=False, max_new_tokens=self.max_new_tokens,
                                  min_new_tokens=self.max_new_tokens, pad_token_id=self.tokenizer.pad_token_id)
        return out[:, batch.input_ids.shape[1]:].tolist()

    def run(self, texts: list[str], batch_size: int) -> tuple[float, list[list[int]]]:
        """generate over `batch_size` prompts at a time; returns (seconds, new token ids per prompt)."""
        outputs: list[list[int]] = []
        start = time.perf_counter()
        with torch.inference_mode():
            for at in range(0, len(texts), batch_size):
                outputs += self._generate(texts[at: at + batch_size])
        return time.perf_counter() - start, outputs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_service(home: Path, port: int, precision: str, **settings: str) -> subprocess.Popen[bytes]:
    """`trainserve up` on `home` with these TRAINSERVE_* settings only; returns once /health answers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINSERVE_")}
    env.update(HF_HUB_OFFLINE="1", TRAINSERVE_DEVICES="cpu", TRAINSERVE_GENERATION_PRECISION=precision, **settings)
    log = open(home / "up.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "trainserve.cli", "up", "--port", str(port), "--home", str(home)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    return wait_healthy(proc, port, 90, home / "up.log")


def wait_healthy(proc: subprocess.Popen[bytes], port: int, seconds: float, log: Path) -> subprocess.Popen[bytes]:
    """`proc` once its /health answers 200 on `port`; killed, and an error naming its log, after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"the server on port {port} did not start; see {log}")


def one_request(client: httpx.Client, model: str, text: str, max_new_tokens: int) -> dict:
    """Stream one completion; returns its token event times (from the request's start), text and token count."""
    start = time.perf_counter()
    times: list[float] = []
    parts: list[str] = []
    tokens = 0
    body = {"model": model, "prompt": text, "max_new_tokens": max_new_tokens, "temperature": 0, "stream": True}
    with client.stream("POST", "/generate", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "text" in event and "usage" not in event:
                times.append(time.perf_counter() - start)
                parts.append(event["text"])
            if "usage" in event:
                tokens = event["usage"]["completion_tokens"]
    return {"times": times, "text": "".join(parts), "tokens": tokens}


def service(client: httpx.Client, model: str, texts: list[str], max_new_tokens: int, clients: int
            ) -> tuple[float, list[dict]]:
    """N concurrent streaming clients; returns (seconds, one_request's result per prompt)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        results = list(pool.map(lambda t: one_request(client, model, t, max_new_tokens), texts))
    return time.perf_counter() - start, results


def generation_kv_bytes(up_log: Path) -> dict[str, int]:
    """The generation worker's KV cache bytes by part (pool, used, prefix), scraped from its metrics port as
    `trainserve up` logged it; empty when it serves none."""
    found = re.search(rb"worker\[generation\] metrics on (http://\S+)", up_log.read_bytes())
    if found is None:
        return {}
    try:
        text = httpx.get(found.group(1).decode(), timeout=10).text
    except httpx.HTTPError:
        return {}
    parts: dict[str, int] = {}
    for part, value in re.findall(r'^trainserve_generation_kv_cache_bytes\{[^}]*part="(\w+)"[^}]*\} (\S+)$', text,
                                  flags=re.M):
        parts[part] = parts.get(part, 0) + int(float(value))
    return parts


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def children() -> dict[int, list[int]]:
    """Every process's children, by parent pid, from /proc."""
    found: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        found.setdefault(ppid, []).append(int(entry.name))
    return found


def generation_worker_rss(up: int, field: str = "VmRSS") -> int:
    """Resident bytes of `trainserve up`'s generation worker from /proc (VmRSS now, VmHWM peak, RssAnon, RssFile)."""
    for pid in children().get(up, []):
        entry = Path("/proc") / str(pid)
        try:
            if b"generation" not in (entry / "cmdline").read_bytes().split(b"\0"):
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            continue
    return 0


def served_precision(home: Path) -> str:
    """The precision the generation worker resolved, from its log line when it loaded the model."""
    log = (home / "up.log").read_text(errors="replace")
    found = re.findall(r"generation engine loaded: .* in (fp32|bf16|fp16)", log)
    return found[-1] if found else "unknown"


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--arch", default="gpt2", choices=("gpt2", "llama"), help="the model's architecture")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of every side")
    parser.add_argument("--sequential", type=int, default=4, help="prompts the slow hf-sequential side runs")
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"),
                        help="the service's generation precision (TRAINSERVE_GENERATION_PRECISION)")
    parser.add_argument("--baseline-attention", default="sdpa,eager",
                        help="attention implementations of the hf-batched sides (the faster one is the headline)")
    args = parser.parse_args()
    texts = prompts(args.requests)
    attentions = [a.strip() for a in args.baseline_attention.split(",") if a.strip()]
    # One hf-batched side per (dtype, attention); "hf-batched bf16" is SDPA, "hf-batched bf16 eager" eager.
    batched_sides = {(dtype, attention): f"hf-batched {dtype}" + ("" if attention == "sdpa" else f" {attention}")
                     for dtype in ("fp32", "bf16") for attention in attentions}
    sides = ["hf-sequential", *batched_sides.values(), "trainserve"]
    runs: dict[str, list[tuple[float, int, float]]] = {side: [] for side in sides}
    outputs: dict[str, list[list[int]]] = {}
    latencies: dict[str, list[float]] = {"ttft": [], "itl": []}
    with tempfile.TemporaryDirectory(prefix="trainserve-bench-") as tmp:
        home = Path(tmp)
        name = f"{args.arch}-bench"
        folder = home / "models" / name
        build_model(folder, args.layers, args.arch)
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
        hf = {key: HfSide(folder, args.max_new_tokens, dtypes[key[0]], key[1]) for key in batched_sides}
        sequential = hf[("fp32", attentions[0])]
        parameters = sum(p.numel() for p in sequential.model.parameters())  # tied embedding once
        port = free_port()
        # Worker metrics from a free port up (the generation worker's is logged): its KV cache at idle.
        proc = start_service(home, port, args.precision, TRAINSERVE_WORKER_METRICS_PORT=str(free_port()))
        try:
            key = (home / "admin.key").read_text().strip()
            headers = {"Authorization": f"Bearer {key}"}
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers) as client:
                idle_rss = generation_worker_rss(proc.pid)
                for attempt in range(5):  # loads the model into the generation worker (slow on a busy machine)
                    try:
                        one_request(client, name, "warm up", 4)
                        break
                    except httpx.HTTPStatusError:
                        if attempt == 4:
                            raise
                precision = served_precision(home)
                for _ in range(args.repeats):
                    load = os.getloadavg()[0]
                    seconds, outputs["hf-sequential"] = sequential.run(texts[: args.sequential], 1)
                    runs["hf-sequential"].append((seconds, sum(map(len, outputs["hf-sequential"])), load))
                    for key, side in batched_sides.items():
                        load = os.getloadavg()[0]
                        seconds, outputs[side] = hf[key].run(texts, args.concurrency)
                        runs[side].append((seconds, sum(map(len, outputs[side])), load))
                    load = os.getloadavg()[0]
                    seconds, served = service(client, name, texts, args.max_new_tokens, args.concurrency)
                    runs["trainserve"].append((seconds, sum(r["tokens"] for r in served), load))
                    print("round " + str(len(runs["trainserve"])) + ": " + ", ".join(
                        f"{side} {runs[side][-1][1] / runs[side][-1][0]:.1f}" for side in sides) + " tokens/s, load "
                        f"{os.getloadavg()[0]:.1f}", flush=True)  # a run cut short still shows its rounds
                    for result in served:
                        latencies["ttft"].append(result["times"][0] if result["times"] else 0.0)
                        latencies["itl"] += [b - a for a, b in zip(result["times"], result["times"][1:], strict=False)]
            time.sleep(1.0)  # the engine releases its cache once idle
            rss, peak = generation_worker_rss(proc.pid), generation_worker_rss(proc.pid, "VmHWM")
            anon, mapped = generation_worker_rss(proc.pid, "RssAnon"), generation_worker_rss(proc.pid, "RssFile")
            kv = generation_kv_bytes(home / "up.log")
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(120)
    decode = sequential.tokenizer.decode
    shape = "GPT-2" if args.arch == "gpt2" else "Llama (GQA 12/4, SwiGLU 2048, rotary, tied)"
    print(f"model: {shape} shape, {parameters / 1e6:.0f}M parameters, {args.layers} layers, random weights; "
          f"{args.requests} prompts x "
          f"{args.max_new_tokens} new tokens, greedy; {args.repeats} interleaved rounds; torch threads "
          f"{torch.get_num_threads()}; hf-sequential (fp32) over the first {args.sequential} prompts")
    print(f"service precision: {args.precision} -> {precision} (as the generation worker resolved it)")
    print(f"{'side':<34}{'tokens':>8}{'seconds':>20}{'tokens/s med [min-max]':>26}{'load':>7}")
    tps = {}
    for side in sides:
        label = {"trainserve": f"trainserve up {precision}, {args.concurrency} clients"}.get(
            side, side + (f" (x{args.concurrency})" if side.startswith("hf-batched") else ""))
        rates = [tokens / seconds for seconds, tokens, _ in runs[side]]
        tps[side] = statistics.median(rates)
        print(f"{label:<34}{runs[side][0][1]:>8}{spread([s for s, _, _ in runs[side]]):>20}{spread(rates):>26}"
              f"{statistics.median([load for _, _, load in runs[side]]):>7.2f}")
    print("ratio trainserve / " + "; trainserve / ".join(
        f"{side}: {tps['trainserve'] / tps[side]:.2f}x" for side in sides[:-1]) + " (median tokens/s)")
    for dtype in ("fp32", "bf16"):
        best = max((side for (d, _), side in batched_sides.items() if d == dtype), key=lambda side: tps[side])
        print(f"headline {dtype}: trainserve / {best} (the faster attention of {', '.join(attentions)}): "
              f"{tps['trainserve'] / tps[best]:.2f}x")
    for name, values in latencies.items():
        ms = [v * 1000 for v in values]
        label = "time to first token" if name == "ttft" else "inter-token latency"
        print(f"{label}: p50 {percentile(ms, 0.5):.0f} ms, "
              f"p90 {percentile(ms, 0.9):.0f} ms, p99 {percentile(ms, 0.99):.0f} ms ({len(ms)} samples)")
    same = {side: sum(r["text"] == decode(ids) for r, ids in zip(served, outputs[side], strict=False))
            for side in sides[:-1]}
    same_dtype = batched_sides.get((precision, attentions[0]), batched_sides[("fp32", attentions[0])])
    others = "; ".join(f"{same[side]}/{len(outputs[side])} vs {side}" for side in sides[:-1] if side != same_dtype)
    print(f"greedy output equal to generate's at the service's dtype: {same[same_dtype]}/{len(served)} vs "
          f"{same_dtype}; for reference {others}")
    checkpoint = parameters * 4  # the fp32 safetensors file, tied embedding once
    held = parameters * {"bf16": 2, "fp16": 2}.get(precision, 4)  # packed projections and LM head, small ones
    print(f"generation worker RSS after the rounds (idle) {rss / MB:.0f} MiB, peak {peak / MB:.0f} MiB; fp32 "
          f"checkpoint {checkpoint / MB:.0f} MiB: {rss / checkpoint:.2f}x idle, {peak / checkpoint:.2f}x peak; "
          f"weights the worker holds ({precision}, packed) {held / MB:.0f} MiB: {rss / held:.2f}x idle, "
          f"{peak / held:.2f}x peak (before its first request, no torch imported yet: {idle_rss / MB:.0f} MiB); "
          f"idle RSS is {anon / MB:.0f} MiB anonymous + {mapped / MB:.0f} MiB file-backed (shared libraries, "
          f"mapped checkpoint pages)")
    if kv:
        print(f"of which the idle KV cache: {kv.get('pool', 0) / MB:.0f} MiB pool, {kv.get('prefix', 0) / MB:.0f} MiB "
              f"of it the prefix cache's blocks (kept while idle, within TRAINSERVE_PREFIX_CACHE_MB)")


MB = 1024 * 1024


if __name__ == "__main__":
    main()
