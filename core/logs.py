"""Logs that follow a request: a request id and a job id in context, and one JSON object per line.

The API binds the request id (from `X-Request-ID`, or a new one) for the life of a request; it travels to the
workers in the task message's headers (`REQUEST_ID_HEADER`), where the task binds it again with the job id, so
`grep <request id>` finds the API's and the worker's lines of one job.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime

REQUEST_ID_HEADER = "trainserve_request_id"  # the Celery message header that carries it to a worker
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")  # what a client-given id may be: it is written into logs

request_id_var: ContextVar[str | None] = ContextVar("request_id", default=None)
job_id_var: ContextVar[str | None] = ContextVar("job_id", default=None)


def new_request_id() -> str:
    """A fresh request id."""
    return f"req-{uuid.uuid4().hex}"


def accept_request_id(given: str | None) -> str:
    """The client's id when it is short and plain (it ends up in log lines), else a fresh one."""
    return given if given and _SAFE_ID.match(given) else new_request_id()


def task_headers() -> dict[str, str] | None:
    """Headers for a task message sent now: the current request id, so the worker logs under it."""
    request_id = request_id_var.get()
    return {REQUEST_ID_HEADER: request_id} if request_id else None


@contextmanager
def bound(*, request_id: str | None = None, job_id: str | None = None) -> Iterator[None]:
    """Bind ids for the lines logged inside the block (those given; the others keep their values)."""
    tokens = []
    if request_id is not None:
        tokens.append((request_id_var, request_id_var.set(request_id)))
    if job_id is not None:
        tokens.append((job_id_var, job_id_var.set(job_id)))
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


class ContextFilter(logging.Filter):
    """Copies the bound ids onto every record, so any formatter can print them."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Never drops a record; ids given with `extra=` win over the bound ones."""
        record.request_id = getattr(record, "request_id", None) or request_id_var.get()
        record.job_id = getattr(record, "job_id", None) or job_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the bound ids, and the exception if any."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as a JSON line (ids read from the record, else from the context)."""
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
            "process": record.process}
        for key, var in (("request_id", request_id_var), ("job_id", job_id_var)):
            value = getattr(record, key, None) or var.get()
            if value:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(log_format: str, level: str | int = "INFO") -> None:
    """Send the root logger to stderr as text or JSON lines; the filter adds the ids either way."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("[%(asctime)s %(levelname)s %(name)s] %(message)s"))
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)
    # uvicorn's loggers bring their own handlers; through the root they get the same format.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers = []
        logging.getLogger(name).propagate = True
