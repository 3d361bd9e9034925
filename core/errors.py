"""Domain errors: raised by services and data access, mapped to HTTP status codes in one table in app/."""

from __future__ import annotations

from typing import Any

from core.protocol import ErrorCode, error_body


class DomainError(Exception):
    """Base class: a stable machine-readable code, a human message and the offending field."""

    code: str = ErrorCode.ERROR

    def __init__(self, message: str, *, field: str | None = None, code: str | None = None,
                 details: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.details = details
        if code is not None:
            self.code = code

    def envelope(self) -> dict[str, Any]:
        """`{"error": {...}}` for this error."""
        return error_body(self.code, self.message, self.field, self.details)


class ValidationFailed(DomainError):
    """Input is well-formed JSON/multipart but its content is unacceptable."""

    code: str = ErrorCode.VALIDATION_ERROR

    def __init__(self, field: str | None, message: str, *, code: str | None = None,
                 details: Any = None) -> None:
        super().__init__(message, field=field, code=code, details=details)


class NotFound(DomainError):
    """The resource does not exist (or is not visible to the caller)."""

    code: str = ErrorCode.NOT_FOUND


class Conflict(DomainError):
    """The request conflicts with the resource's current state."""

    code: str = ErrorCode.CONFLICT


class IllegalTransition(Conflict):
    """A job was asked to move between two statuses the state machine does not connect."""

    code: str = ErrorCode.ILLEGAL_TRANSITION


class StaleAttempt(Conflict):
    """A write from an attempt that no longer holds the job (the reaper requeued it, or it finished)."""

    code: str = ErrorCode.STALE_ATTEMPT


class PayloadTooLarge(DomainError):
    """An upload or body exceeds a configured limit."""

    code: str = ErrorCode.PAYLOAD_TOO_LARGE


class BrokerUnavailable(DomainError):
    """The task broker refused or could not be reached; the job row records it."""

    code: str = ErrorCode.BROKER_UNAVAILABLE


class StorageUnavailable(DomainError):
    """The artifact store (the storage folder or S3) refused or could not be reached."""

    code: str = ErrorCode.STORAGE_UNAVAILABLE


class WorkerTimeout(DomainError):
    """A worker did not answer a synchronous request in time."""

    code: str = ErrorCode.WORKER_TIMEOUT


class ClientGone(DomainError):
    """The client closed the connection before the answer was ready; nobody reads this error."""

    code: str = ErrorCode.CLIENT_DISCONNECTED


class UpstreamFailed(DomainError):
    """A worker answered with an error for a synchronous request."""

    code: str = ErrorCode.WORKER_ERROR


class TooManyRequests(DomainError):
    """A quota, rate limit or queue bound was hit; retry after `retry_after` seconds."""

    code: str = ErrorCode.RATE_LIMITED

    def __init__(self, message: str, *, retry_after: float = 1.0, field: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message, field=field, code=code)
        self.retry_after = retry_after


class QueueTimeout(DomainError):
    """A request waited longer than allowed for a worker and was dropped before reaching the model."""

    code: str = ErrorCode.QUEUE_TIMEOUT


# What each code means to a client: (HTTP status, or where it appears; meaning). The reference page of the docs
# site is generated from this table (trainserve/docs_reference.py); a test checks every code has an entry.
ERROR_CODE_MEANINGS: dict[ErrorCode, tuple[str, str]] = {
    ErrorCode.ERROR: ("400", "A domain error without a more specific code."),
    ErrorCode.VALIDATION_ERROR: ("422 (400 for an unparseable body)", "The input is well-formed but unacceptable; "
                                 "`field` names the part at fault (dotted, e.g. `hyperparameters.batch_size`)."),
    ErrorCode.NOT_FOUND: ("404", "No such id, route or model, or one that belongs to another tenant."),
    ErrorCode.METHOD_NOT_ALLOWED: ("405", "The route exists but not with this method."),
    ErrorCode.HTTP_ERROR: ("the framework's status", "Any other HTTP-level refusal by the framework."),
    ErrorCode.CONFLICT: ("409", "The resource is in a state that forbids the request (cancel of a finished job, "
                         "delete of a dataset an unfinished job uses)."),
    ErrorCode.ILLEGAL_TRANSITION: ("409", "A job status change the state machine does not allow."),
    ErrorCode.STALE_ATTEMPT: ("409 (internal)", "A worker wrote for an attempt that no longer holds the job; "
                              "the write is refused."),
    ErrorCode.PAYLOAD_TOO_LARGE: ("413", "A body, upload, dataset row count or column count over its limit."),
    ErrorCode.UNAUTHORIZED: ("401", "Missing, malformed, unknown or revoked API key."),
    ErrorCode.KEY_IN_QUERY: ("401", "A credential was sent in the query string; `field` names the parameter. "
                             "Keys are accepted only in the `Authorization` header."),
    ErrorCode.RATE_LIMITED: ("429", "Generation requests per key per minute exceeded."),
    ErrorCode.QUOTA_EXCEEDED: ("429", "A tenant quota is reached (active jobs, webhook endpoints)."),
    ErrorCode.TOO_MANY_UPLOADS: ("429", "The API process is already receiving its maximum of uploads."),
    ErrorCode.TOO_MANY_STREAMS: ("429", "The tenant holds its maximum of job event streams on this API process."),
    ErrorCode.TOO_MANY_DOWNLOADS: ("429", "The tenant streams its maximum of artifact downloads on this API "
                                   "process."),
    ErrorCode.OVERLOADED: ("429", "The model's generation queue is full; nothing was queued."),
    ErrorCode.IDEMPOTENCY_KEY_REUSED: ("409", "An `Idempotency-Key` was reused with a different body."),
    ErrorCode.BROKER_UNAVAILABLE: ("503", "Redis (the broker) refused; a created job still runs once it is back."),
    ErrorCode.DATABASE_UNAVAILABLE: ("503", "The database is down or every pooled connection stayed busy."),
    ErrorCode.QUEUE_TIMEOUT: ("503", "A generation request was not started by a worker in time and was dropped "
                              "before reaching the model."),
    ErrorCode.WORKER_TIMEOUT: ("504", "No inference worker answered `/classify` or `/v1/embeddings` in time."),
    ErrorCode.WORKER_ERROR: ("502", "A worker failed while answering the request."),
    ErrorCode.INTERNAL_ERROR: ("500", "An unexpected server error (a bug: please report it)."),
    ErrorCode.CLIENT_DISCONNECTED: ("(internal)", "The client went away; its request's work was dropped."),
    ErrorCode.TRAINING_ERROR: ("job `error`", "Training raised an error; the message says which."),
    ErrorCode.OOM: ("job `error`", "Out of device memory even at a micro-batch of one example."),
    ErrorCode.WORKER_LOST: ("job `error`", "The job's worker was lost more times than `TRAINSERVE_MAX_ATTEMPTS`."),
    ErrorCode.DATASET_MISSING: ("job `error`", "A dataset the job needs was deleted or cannot be read."),
    ErrorCode.DOES_NOT_FIT: ("422, or job `error`", "The job's estimated memory or device count fits no live "
                             "worker (at submit), or the device of the worker that took it (then the job fails)."),
    ErrorCode.STORAGE_UNAVAILABLE: ("503, or job `error`", "The artifact store could not be reached."),
}
