"""A worker's Prometheus metrics, served on its own port (`TRAINSERVE_WORKER_METRICS_PORT`).

A port per worker rather than prometheus-client's multiprocess mode: workers run on other hosts than the
API (one per GPU), and each is one process (solo or threads pool), so each serves its own registry and
Prometheus scrapes every worker as a target (as TGI's router does). Engines never import this module: the
training reporter (worker/jobs/prometheus.py) and the generation service report here through their callbacks.
Imports no torch, so a worker opens its port before any model loads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry(auto_describe=True)  # the process's own; nothing else registers in it

# Token-latency buckets follow vLLM's (ms to seconds); step time spans tiny CPU models to large GPU batches.
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_JOB_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 43200, 86400)

TRAIN_SAMPLES_PER_SECOND = Gauge("trainserve_training_samples_per_second", "Examples per second of the running "
                                 "job (classification: rows; causal-lm: sequences)", ["device"], registry=REGISTRY)
TRAIN_TOKENS_PER_SECOND = Gauge("trainserve_training_tokens_per_second", "Tokens per second of the running "
                                "causal-lm job", ["device"], registry=REGISTRY)
TRAIN_STEP_SECONDS = Histogram("trainserve_training_step_seconds", "Wall time of one optimizer step, as the "
                               "reporter sees it (includes data loading)", ["device"], buckets=_STEP_BUCKETS,
                               registry=REGISTRY)
TRAIN_STEPS = Counter("trainserve_training_steps", "Optimizer steps taken", ["device"], registry=REGISTRY)
TRAIN_LOSS = Gauge("trainserve_training_loss", "Latest train loss of the running job", ["device"],
                   registry=REGISTRY)
DEVICE_MEMORY = Gauge("trainserve_device_memory_bytes", "Memory this worker holds on its device: allocated "
                      "tensors on a GPU, resident memory on a CPU", ["device"], registry=REGISTRY)
JOBS_RUNNING = Gauge("trainserve_worker_jobs_running", "Jobs this worker is running", registry=REGISTRY)
JOB_DURATION = Histogram("trainserve_job_duration_seconds", "Wall time of one attempt of a job, by how it ended",
                         ["task", "status"], buckets=_JOB_BUCKETS, registry=REGISTRY)
JOB_QUEUE_WAIT = Histogram("trainserve_job_queue_wait_seconds", "From a job's creation to its first claim",
                           ["task"], buckets=_JOB_BUCKETS, registry=REGISTRY)

GEN_IN_FLIGHT = Gauge("trainserve_generation_requests_in_flight", "Generation requests this worker is serving",
                      registry=REGISTRY)
GEN_REQUESTS = Counter("trainserve_generation_requests", "Generation requests by outcome (done, or an error code)",
                       ["outcome"], registry=REGISTRY)
GEN_BATCH_SIZE = Histogram("trainserve_generation_batch_size", "Sequences decoded together, per decode step",
                           buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=REGISTRY)
GEN_TOKENS = Counter("trainserve_generation_tokens", "Tokens generated (completion tokens of finished requests)",
                     registry=REGISTRY)
GEN_PROMPT_TOKENS = Counter("trainserve_generation_prompt_tokens", "Prompt tokens of accepted requests",
                            registry=REGISTRY)
GEN_TTFT = Histogram("trainserve_generation_time_to_first_token_seconds", "From a request reaching its engine to "
                     "its first token", buckets=_TTFT_BUCKETS, registry=REGISTRY)
GEN_ITL = Histogram("trainserve_generation_inter_token_latency_seconds", "Between consecutive tokens of one "
                    "choice", buckets=_TOKEN_BUCKETS, registry=REGISTRY)


class EngineState(Collector):
    """What the warm generation engines hold now, read from their stats() at each scrape (nothing kept between
    scrapes; an engine's counters start again when it is unloaded and loaded): KV cache memory, waiting and running
    work, prompt tokens served from the prefix cache, speculative draft tokens checked and kept, per model.

    `source` yields (model, stats) of each warm engine; the generation service sets it (None: no families).
    """

    def __init__(self) -> None:
        self.source: Callable[[], list[tuple[str, dict[str, Any]]]] | None = None

    def describe(self) -> Iterator[Metric]:
        """The families without samples (the registry asks at registration, before any engine exists)."""
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        """One sample per warm engine in each family."""
        engines = self.source() if self.source is not None else []
        yield from self._families(engines)

    @staticmethod
    def _families(engines: Sequence[tuple[str, dict[str, Any]]] = ()) -> Iterator[Metric]:
        kv = GaugeMetricFamily("trainserve_generation_kv_cache_bytes", "Bytes of the paged KV cache by part: pool "
                               "(allocated blocks), used (blocks held by running rows or the prefix cache), prefix "
                               "(blocks the prefix cache holds; kept while the engine is idle)",
                               labels=["model", "part"])
        running = GaugeMetricFamily("trainserve_generation_sequences_running", "Sequences (choices) decoding now",
                                    labels=["model"])
        waiting = GaugeMetricFamily("trainserve_generation_requests_waiting", "Requests queued for a batch row",
                                    labels=["model"])
        cached = CounterMetricFamily("trainserve_generation_prompt_tokens_cached", "Prompt tokens whose keys and "
                                     "values came from the prefix cache (not prefilled)", labels=["model"])
        drafted = CounterMetricFamily("trainserve_generation_draft_tokens", "Speculative draft tokens checked",
                                      labels=["model"])
        accepted = CounterMetricFamily("trainserve_generation_draft_tokens_accepted", "Speculative draft tokens kept "
                                       "(equal to what plain decoding would have produced)", labels=["model"])
        for model, stats in engines:
            block = stats["cache_block_bytes"]
            for part, blocks in (("pool", stats["cache_blocks"]), ("used", stats["cache_blocks_used"]),
                                 ("prefix", stats["prefix_cache_blocks"])):
                kv.add_metric([model, part], blocks * block)
            running.add_metric([model], stats["running_sequences"])
            waiting.add_metric([model], stats["waiting"])
            cached.add_metric([model], stats["cached_prompt_tokens"])
            drafted.add_metric([model], stats["draft_tokens"])
            accepted.add_metric([model], stats["accepted_draft_tokens"])
        yield from (kv, running, waiting, cached, drafted, accepted)


ENGINE_STATE = EngineState()
REGISTRY.register(ENGINE_STATE)


def serve_metrics(port: int, addr: str = "0.0.0.0") -> bool:
    """Serve REGISTRY at http://<addr>:<port>/metrics from a daemon thread; False (logged) if the port is taken."""
    if port <= 0:
        return False
    try:
        start_http_server(port, addr=addr, registry=REGISTRY)
    except OSError as exc:  # taken (several workers of one host given one port): the worker still serves tasks
        log.warning("could not serve worker metrics on port %d: %s", port, exc)
        return False
    log.info("worker metrics on http://%s:%d/metrics", addr, port)
    return True


def observe_batch(rows: int) -> None:
    """The generation engine's per-step hook: how many sequences it decoded together."""
    GEN_BATCH_SIZE.observe(rows)


class TokenClock:
    """Times one request's tokens: the first against the request's arrival, later ones per choice."""

    def __init__(self) -> None:
        self.arrived = time.monotonic()
        self.last: dict[int, float] = {}

    def tick(self, index: int) -> None:
        """Record a token of choice `index` (called on the engine's scheduler thread: cheap)."""
        now = time.monotonic()
        previous = self.last.get(index)
        if previous is None:
            if not self.last:
                GEN_TTFT.observe(now - self.arrived)
        else:
            GEN_ITL.observe(now - previous)
        self.last[index] = now
