"""The raw transport under :class:`bus.core.Bus`: messages, subscriptions, and the wire's header names.

A transport offers the least a message system must (publish, subscribe, an inbox);
the NATS one is :mod:`bus.nats_transport`, the in-memory one :mod:`bus.memory`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Awaitable, Callable

from bus.errors import Unavailable, error_from_headers

REQUEST_ID_HEADER = "Kvbus-Request-Id"
STREAM_HEADER = "Kvbus-Stream"
SEQ_HEADER = "Kvbus-Seq"
TIMEOUT_HEADER = "Kvbus-Timeout"
STATUS_HEADER = "Status"  # set by nats-server on "no responders"
NO_RESPONDERS = "503"


@dataclasses.dataclass(slots=True)
class RawMsg:
    subject: str
    data: bytes
    headers: dict[str, str] | None
    reply: str | None


RawHandler = Callable[[RawMsg], Awaitable[None]]


class RawSubscription(abc.ABC):
    @abc.abstractmethod
    async def unsubscribe(self) -> None: ...


class Transport(abc.ABC):
    """The least a message system must offer for :class:`Bus` to run on it."""

    @abc.abstractmethod
    async def publish(self, subject: str, data: bytes, headers: dict[str, str] | None = None,
                      reply: str | None = None) -> None: ...

    @abc.abstractmethod
    async def subscribe(self, subject: str, handler: RawHandler, queue: str | None = None) -> RawSubscription:
        """Deliver each message to ``handler``, one at a time per subscription."""

    @abc.abstractmethod
    def new_inbox(self) -> str: ...

    async def flush(self) -> None:
        return None

    @property
    def max_payload(self) -> int | None:
        """Largest message body the server accepts (None: no limit)."""
        return None

    @abc.abstractmethod
    async def close(self) -> None: ...



def header(raw: RawMsg, name: str) -> str | None:
    return raw.headers.get(name) if raw.headers else None



def raise_for_reply(raw: RawMsg, name: str) -> None:
    """Raise the error a reply carries (a BusError, or Unavailable for nats-server's "no responders")."""
    error = error_from_headers(raw.headers)
    if error is not None:
        raise error
    if header(raw, STATUS_HEADER) == NO_RESPONDERS:
        raise Unavailable(f"no service is listening on {name}")
