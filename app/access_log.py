"""Keep credentials out of the access log: query strings are redacted before uvicorn prints them."""

from __future__ import annotations

import logging

from core.auth import redact_query

ACCESS_LOGGER = "uvicorn.access"


class RedactQueryCredentials(logging.Filter):
    """Rewrite every request target in a log record's arguments so no credential-looking value survives."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Redact in place; never drops a record."""
        if isinstance(record.args, tuple):
            record.args = tuple(redact_query(arg) if isinstance(arg, str) and "?" in arg else arg
                                for arg in record.args)
        elif isinstance(record.msg, str) and "?" in record.msg:  # a preformatted line: redact each word
            record.msg = " ".join(redact_query(word) if "?" in word else word for word in record.msg.split(" "))
        return True


def install_access_log_redaction(logger_name: str = ACCESS_LOGGER) -> None:
    """Attach the filter to uvicorn's access logger once (the app factory may run more than once)."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, RedactQueryCredentials) for f in logger.filters):
        logger.addFilter(RedactQueryCredentials())
