"""One streamed reply, as the caller sees it: ordered chunks, stall timeout, cancel on leaving early."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from bus import tracing
from bus.codec import CONTENT_TYPE_HEADER, Encoding, decode
from bus.errors import BusError, Timeout, Unavailable
from bus.subjects import Subject
from bus.transport import (
    END,
    PROBE_ACCEPT,
    PROBE_HEADER,
    REQUEST_ID_HEADER,
    SEQ_HEADER,
    STREAM_HEADER,
    RawMsg,
    header,
    raise_for_reply,
)

if TYPE_CHECKING:
    from bus.core import Bus


class StreamBroken(Unavailable):
    """A stream lost messages (e.g. across a NATS reconnect): the server may be fine, the stream is not."""


class ReplyStream:
    """Async iterator over one streamed reply; also an async context manager.

    It asks for interest probes (``Kvbus-Probe: accept``): the bus answers them for it (``alive`` while
    the stream is read, ``gone`` once it was dropped), so a caller gone without a word stops the work.
    """

    def __init__(self, bus: "Bus", subject: Subject, message: Any, timeout: float,
                 headers: dict[str, str], name: str):
        headers.setdefault(PROBE_HEADER, PROBE_ACCEPT)
        self._bus = bus
        self._subject = subject
        self._message = message
        self._timeout = timeout
        self._headers = headers
        self._name = name
        self._queue: asyncio.Queue[RawMsg] = asyncio.Queue()
        self._token: str | None = None
        self._forget: weakref.finalize | None = None
        """Drops the token from the bus's pending replies: on finishing, or when the stream is garbage."""
        self._next_seq = 0
        self._is_done = False
        self.request_id = headers[REQUEST_ID_HEADER]
        # The request goes out at the first read, maybe in another task: it joins the trace it was opened in.
        self._trace_context = tracing.current_context()

    async def _start(self) -> None:
        token, inbox = await self._bus._open_reply()
        self._token = token
        self._bus._pending[token] = self._queue
        # NOTE: a stream dropped without aclose() must not stay pending forever: its token then
        # answers the server's interest probe "gone", which cancels the generation (bus/core.py).
        self._forget = weakref.finalize(self, self._bus._pending.pop, token, None)
        with tracing.attached(self._trace_context), tracing.client_span(
                f"{self._subject.template} stream", self._headers, **{"messaging.destination": self._name}):
            data = self._bus._encode_within_limit(self._message, self._subject, self._name, self._headers)
            await self._bus.transport.publish(self._name, data, self._headers, reply=inbox)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        if self._is_done:
            raise StopAsyncIteration
        if self._token is None:
            await self._start()
        try:
            # NOTE: not asyncio.wait_for: on Python 3.11 it returns the result when a cancel lands in
            # the tick the result does, and the cancel is lost (a handler told to stop streams on).
            async with asyncio.timeout(self._timeout):
                raw = await self._queue.get()
        except TimeoutError:
            await self.aclose()
            raise Timeout(f"stream on {self._name} stalled: nothing for {self._timeout:g}s",
                          request_id=self.request_id) from None
        if isinstance(raw, BusError):  # abort(): the caller learnt the stream cannot go on
            await self.aclose()
            raise raw
        try:
            raise_for_reply(raw, self._name)
        except BusError:
            self._finish()
            raise
        kind = header(raw, STREAM_HEADER)
        seq = int(header(raw, SEQ_HEADER) or -1)
        if seq != self._next_seq:
            await self.aclose()
            raise StreamBroken(f"stream on {self._name} lost messages: got #{seq}, expected #{self._next_seq}",
                               request_id=self.request_id)
        if kind == END:
            self._finish()
            raise StopAsyncIteration
        self._next_seq += 1
        enc = Encoding.from_header(header(raw, CONTENT_TYPE_HEADER), self._subject.encoding)
        return decode(raw.data, self._subject.reply, enc)

    def _finish(self) -> None:
        self._is_done = True
        if self._forget is not None:
            self._forget()

    def abort(self, error: BusError) -> None:
        """Make the pending (or next) ``__anext__`` raise ``error``, e.g. when the server is known dead."""
        if not self._is_done:
            self._queue.put_nowait(error)

    async def aclose(self) -> None:
        """Stop listening; if the stream had not ended, ask the server to cancel it."""
        was_open = not self._is_done and self._token is not None
        self._finish()
        if was_open:
            self._bus._send_cancel(self.request_id)

    async def __aenter__(self) -> "ReplyStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
