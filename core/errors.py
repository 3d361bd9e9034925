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
