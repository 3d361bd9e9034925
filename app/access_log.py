"""Keep credentials out of the access log: request targets are redacted before uvicorn prints them."""

from __future__ import annotations

import logging
from typing import TypeGuard

from core.auth import KEY_PREFIX, redact_query

ACCESS_LOGGER = "uvicorn.access"


class RedactQueryCredentials(logging.Filter):
    """Rewrite every request target in a log record's arguments so no credential-looking value survives."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Redact in place; never drops a record."""
        if isinstance(record.args, tuple):
            record.args = tuple(redact_query(arg) if _suspect(arg) else arg for arg in record.args)
        elif _suspect(record.msg):  # a preformatted line: redact each word
            record.msg = " ".join(redact_query(word) if _suspect(word) else word for word in record.msg.split(" "))
        return True


def _suspect(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and ("?" in value or KEY_PREFIX in value)


def install_access_log_redaction(logger_name: str = ACCESS_LOGGER) -> None:
    """Attach the filter to uvicorn's access logger once (the app factory may run more than once)."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, RedactQueryCredentials) for f in logger.filters):
        logger.addFilter(RedactQueryCredentials())
