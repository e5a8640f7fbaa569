"""The request id on every log line: a logging filter that reads it from the current context.

``install_log_context()`` (services/runner.py and ``kvbus serve``'s logging set-up) adds the filter to
the root logger's handlers and the id to their format: a line logged while a request is handled reads
``12:00:01 WARNING services.workers.decode [chatcmpl-3f2a...]: ...`` on every service the request
crossed (the id travels in baggage, bus/tracing/__init__.py); lines outside a request are unchanged.
"""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s%(kvbus_request)s: %(message)s"
LOG_DATE_FORMAT = "%H:%M:%S"


class RequestIdFilter(logging.Filter):
    """Sets ``record.request_id`` (or None) and ``record.kvbus_request`` (`` [id]`` or empty)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from bus.tracing import request_id

        rid = getattr(record, "request_id", None) or request_id()
        record.request_id = rid
        record.kvbus_request = f" [{rid}]" if rid else ""
        return True


def install_log_context(logger: logging.Logger | None = None) -> None:
    """Every handler of ``logger`` (default: the root) gets the filter and the format with the id
    (idempotent; handlers added later are not touched)."""
    logger = logger or logging.getLogger()
    for handler in logger.handlers:
        if not any(isinstance(f, RequestIdFilter) for f in handler.filters):
            handler.addFilter(RequestIdFilter())
            handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt=LOG_DATE_FORMAT))
