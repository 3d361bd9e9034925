# One image for the API and the workers. The base pins PyTorch and CUDA; the API process never imports torch.
FROM pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    TRAINSERVE_HOME=/data \
    HF_HOME=/data/hf-cache

# The package is installed (not run from copied source trees): the wheel carries its package data
# (core/assets: the bundled GPT-2 tokenizer) and the migrations; the sources are removed afterwards.
COPY pyproject.toml README.md /tmp/src/
COPY core /tmp/src/core
COPY app /tmp/src/app
COPY worker /tmp/src/worker
COPY trainserve /tmp/src/trainserve
COPY migrations /tmp/src/migrations
# torch comes from the base image; the range in pyproject.toml admits it, so pip keeps it.
RUN pip install /tmp/src && rm -rf /tmp/src \
    && python -c "from core.paths import GPT2_TOKENIZER_DIR as d; assert (d / 'vocab.json').is_file(), d" \
    && useradd --create-home --uid 1000 trainserve && mkdir -p /data && chown trainserve /data

WORKDIR /srv/trainserve
COPY examples ./examples
USER trainserve
VOLUME ["/data"]
EXPOSE 8000
CMD ["trainserve", "api", "--host", "0.0.0.0", "--port", "8000"]
