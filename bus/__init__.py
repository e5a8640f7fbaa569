"""The message bus: NATS (or in-memory) transport, codec, errors, streams, traces.

Actors talk to a :class:`bus.core.Bus`; they never import nats.
"""

from bus.core import Bus, RequestContext, Subscription
from bus.errors import (
    BusError,
    Cancelled,
    ErrorCode,
    Internal,
    InvalidArgument,
    NotFound,
    Overloaded,
    Timeout,
    Unavailable,
)

__all__ = [
    "Bus",
    "BusError",
    "Cancelled",
    "ErrorCode",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "Overloaded",
    "RequestContext",
    "Subscription",
    "Timeout",
    "Unavailable",
]
