# One image for the API and the workers. The base pins PyTorch and CUDA; the API process never imports torch.
FROM pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    TRAINSERVE_HOME=/data \
    HF_HOME=/data/hf-cache

WORKDIR /srv/trainserve
COPY pyproject.toml README.md alembic.ini ./
COPY core ./core
COPY app ./app
COPY worker ./worker
COPY trainserve ./trainserve
COPY migrations ./migrations
COPY examples ./examples
# torch comes from the base image; the range in pyproject.toml admits it, so pip keeps it.
RUN pip install -e . && useradd --create-home --uid 1000 trainserve && mkdir -p /data && chown trainserve /data
USER trainserve
VOLUME ["/data"]
EXPOSE 8000
CMD ["trainserve", "api", "--host", "0.0.0.0", "--port", "8000"]
