"""The closed error taxonomy, carried in message headers.

A reply that failed has an empty body and the headers ``Kvbus-Error-Code`` and
``Kvbus-Error-Message`` (plus the NATS micro ``Nats-Service-Error*`` pair so
generic NATS tooling shows it). The caller raises the matching exception.
"""

from __future__ import annotations

import enum

ERROR_CODE_HEADER = "Kvbus-Error-Code"
ERROR_MESSAGE_HEADER = "Kvbus-Error-Message"
MICRO_ERROR_HEADER = "Nats-Service-Error"
MICRO_ERROR_CODE_HEADER = "Nats-Service-Error-Code"
RETRY_AFTER_HEADER = "Kvbus-Retry-After"
"""Seconds after which a refused request (overloaded, unavailable) may be tried again (HTTP: Retry-After)."""


class ErrorCode(str, enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    OVERLOADED = "overloaded"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"


MEANINGS = {
    ErrorCode.INVALID_ARGUMENT: "The request is malformed or a field is out of range (the message names it); "
                                "sending it again unchanged fails again.",
    ErrorCode.NOT_FOUND: "What the request names (a model, a worker, a page) does not exist here.",
    ErrorCode.OVERLOADED: "Refused at once because the service is full; try again after Kvbus-Retry-After "
                          "seconds (when given).",
    ErrorCode.CANCELLED: "The work was cancelled before it finished.",
    ErrorCode.TIMEOUT: "The caller's deadline (Kvbus-Timeout, timeout_s) or a service's own time limit passed.",
    ErrorCode.UNAVAILABLE: "No service could take the request (none running, shutting down, or a stream that "
                           "could not go on); try again, perhaps elsewhere.",
    ErrorCode.INTERNAL: "A bug or an unexpected failure in kvbus; the message carries the request id for the logs.",
}
"""What each code tells a caller (the exported AsyncAPI document carries these)."""

# HTTP-like numbers for the NATS micro header and for the gateway's status codes.
HTTP_STATUS = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.OVERLOADED: 429,
    ErrorCode.CANCELLED: 499,
    ErrorCode.TIMEOUT: 504,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.INTERNAL: 500,
}


class BusError(Exception):
    """Base of every error that crosses the wire."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str = "", *, request_id: str | None = None, retry_after: float | None = None):
        super().__init__(message or self.code.value)
        self.message = message or self.code.value
        self.request_id = request_id
        self.retry_after = retry_after

    def to_headers(self) -> dict[str, str]:
        message = self.message.replace("\r", " ").replace("\n", " ")[:1024]
        headers = {
            ERROR_CODE_HEADER: self.code.value,
            ERROR_MESSAGE_HEADER: message,
            MICRO_ERROR_HEADER: message,
            MICRO_ERROR_CODE_HEADER: str(HTTP_STATUS[self.code]),
        }
        if self.retry_after is not None:
            headers[RETRY_AFTER_HEADER] = f"{self.retry_after:.3f}"
        return headers


class InvalidArgument(BusError, ValueError):
    code = ErrorCode.INVALID_ARGUMENT


class PayloadTooLarge(InvalidArgument):
    """A message is larger than the server's max_payload (HTTP 413); refused before it is sent."""


class NotFound(BusError):
    code = ErrorCode.NOT_FOUND


class Overloaded(BusError):
    code = ErrorCode.OVERLOADED


class Cancelled(BusError):
    code = ErrorCode.CANCELLED


class Timeout(BusError, TimeoutError):
    code = ErrorCode.TIMEOUT


class Unavailable(BusError):
    code = ErrorCode.UNAVAILABLE


class NoResponders(Unavailable):
    """Nobody subscribes to the subject (nats-server's "no responders" status, or the in-memory bus's)."""


class Internal(BusError):
    code = ErrorCode.INTERNAL


_BY_CODE: dict[str, type[BusError]] = {
    cls.code.value: cls
    for cls in (InvalidArgument, NotFound, Overloaded, Cancelled, Timeout, Unavailable, Internal)
}


def error_from_headers(headers: dict[str, str] | None) -> BusError | None:
    """The error a reply carries, or None for a normal reply."""
    if not headers:
        return None
    code = headers.get(ERROR_CODE_HEADER)
    if code is None:
        return None
    cls = _BY_CODE.get(code, Internal)
    message = headers.get(ERROR_MESSAGE_HEADER, code)
    try:
        retry_after = float(headers[RETRY_AFTER_HEADER]) if RETRY_AFTER_HEADER in headers else None
    except ValueError:
        retry_after = None
    return cls(message, request_id=headers.get("Kvbus-Request-Id"), retry_after=retry_after)
