"""The raw transport under :class:`bus.core.Bus`: messages, subscriptions, and the wire's header names.

A transport offers the least a message system must (publish, subscribe, an inbox);
the NATS one is :mod:`bus.nats_transport`, the in-memory one :mod:`bus.memory`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Awaitable, Callable

import asyncio

from bus.errors import NoResponders, Timeout, error_from_headers

REQUEST_ID_HEADER = "Kvbus-Request-Id"
STREAM_HEADER = "Kvbus-Stream"
SEQ_HEADER = "Kvbus-Seq"
TIMEOUT_HEADER = "Kvbus-Timeout"
STATUS_HEADER = "Status"  # set by nats-server on "no responders"
NO_RESPONDERS = "503"
CHUNK = "chunk"
END = "end"
"""``Kvbus-Stream`` of a streamed reply's chunks and of its last, empty message."""
PROBE = "probe"
"""``Kvbus-Stream`` of the interest probe a streaming server sends its caller's inbox (bus/serving.py)."""
PROBE_ALIVE = "alive"
PROBE_GONE = "gone"
"""``Kvbus-Stream`` of the caller's answer to a probe: the stream is still read, or nobody wants it any more."""
PROBE_HEADER = "Kvbus-Probe"
PROBE_ACCEPT = "accept"
"""A streamed request's ``Kvbus-Probe: accept``: its caller skips or answers probes, so the server may probe it.
Nothing is ever sent to a caller that did not ask for it: without this header, no probe."""


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

    async def request(self, subject: str, data: bytes, headers: dict[str, str] | None,
                      timeout: float) -> RawMsg:
        """One reply to ``data`` on ``subject``; raises NoResponders when nobody subscribes, Timeout after ``timeout``.

        Built from subscribe/publish (the server answers "no responders" on the inbox); a
        transport with a cheaper request of its own overrides it.
        """
        reply: asyncio.Future[RawMsg] = asyncio.get_running_loop().create_future()

        async def on_reply(msg: RawMsg) -> None:
            if not reply.done():
                reply.set_result(msg)

        inbox = self.new_inbox()
        sub = await self.subscribe(inbox, on_reply)
        try:
            await self.publish(subject, data, headers, reply=inbox)
            try:
                async with asyncio.timeout(timeout):  # never wait_for: see bus/stream.py
                    msg = await reply
            except TimeoutError:
                raise Timeout(f"no reply on {subject} within {timeout:g}s") from None
        finally:
            await sub.unsubscribe()
        if header(msg, STATUS_HEADER) == NO_RESPONDERS:
            raise NoResponders(f"nobody is listening on {subject}")
        return msg

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
        raise NoResponders(f"no service is listening on {name}")
