"""The Bus: typed request/reply, streamed replies, events, errors and traces.

One implementation over a tiny raw transport (:mod:`bus.transport`: publish,
subscribe, inbox), so the NATS bus (:mod:`bus.nats_transport`) and the
in-memory bus (:mod:`bus.memory`) behave the same down to headers and error
codes. The caller's side of a streamed reply is :mod:`bus.stream`; the serving side
(handler tasks, streamed replies, probes, deadlines, cancels) is :mod:`bus.serving`.

Wire protocol, in headers:
- ``Content-Type``: ``application/json`` or ``application/msgpack``.
- ``Kvbus-Request-Id``: set by the caller (or the server when missing).
- Streamed replies: every chunk carries ``Kvbus-Stream: chunk`` and
  ``Kvbus-Seq: n`` (0, 1, ...); the stream ends with an empty
  ``Kvbus-Stream: end`` message, or with an error message.
- Errors: empty body plus ``Kvbus-Error-Code`` / ``Kvbus-Error-Message``.
- A caller that abandons a stream publishes a ``CancelEvent`` on
  ``kvbus.v1.cancel``; the server cancels the handler task for that request id.
- ``Kvbus-Timeout``: seconds the caller will wait, counted from when it sent
  the request (relative, so clocks need not agree). ``Bus.request`` always
  sends it; the server cancels the handler when it passes (and answers
  ``timeout``), so work nobody waits for stops even when no CancelEvent comes
  (a caller that died, a plain NATS client that gave up).
- Interest probes, only for a caller that asks (``Kvbus-Probe: accept`` on its streamed request;
  ``ReplyStream`` does): while the stream runs, the server sends at most every
  ``probe_interval`` seconds a request with ``Kvbus-Stream: probe`` and an empty
  body to the stream's reply subject. "No responders" (the caller's connection is
  gone) or an answer ``Kvbus-Stream: gone`` (the caller dropped the stream)
  cancels the handler as a CancelEvent would; silence or any other answer means
  alive. Our Bus answers ``alive`` for a stream it still reads and ``gone`` for one
  it does not know. A caller that did not ask gets no probe; its deadline
  (``Kvbus-Timeout``), its CancelEvent and the service's own limits end its work.
- The whole contract, machine-readable: ``kvbus schemas export`` (an AsyncAPI document, bus/contract.py).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from bus import tracing
from bus.codec import CONTENT_TYPE_HEADER, Encoding, decode, encode
from bus.errors import PayloadTooLarge, Timeout, Unavailable
from bus.serving import PROBE_TIMEOUT, RequestContext, Serving, Subscription
from bus.stream import ReplyStream, StreamBroken
from bus.subjects import CANCEL, Subject
from bus.transport import (
    NO_RESPONDERS,
    PROBE,
    PROBE_ALIVE,
    PROBE_GONE,
    REQUEST_ID_HEADER,
    SEQ_HEADER,
    STATUS_HEADER,
    STREAM_HEADER,
    TIMEOUT_HEADER,
    RawHandler,
    RawMsg,
    RawSubscription,
    Transport,
    header,
    raise_for_reply,
)
from schemas.common import CancelEvent

log = logging.getLogger(__name__)

__all__ = [  # the transport's, the stream's and the serving side's names stay importable from here
    "NO_RESPONDERS", "PROBE_TIMEOUT", "REQUEST_ID_HEADER", "SEQ_HEADER", "STATUS_HEADER", "STREAM_HEADER",
    "TIMEOUT_HEADER", "Bus", "RawHandler", "RawMsg", "RawSubscription", "ReplyStream", "RequestContext",
    "StreamBroken", "Subscription", "Transport",
]


class Bus:
    """Typed messaging over a :class:`Transport`.

    ``request`` and ``stream`` call; ``serve`` binds a handler to a subject;
    ``publish``/``subscribe`` carry events. Handlers take a request Struct (and
    optionally a :class:`RequestContext`) and return the reply Struct, or, on a
    streamed subject, are async generators of chunk Structs.
    """

    def __init__(self, transport: Transport, *, default_timeout: float = 10.0, probe_interval: float = 1.0):
        self.transport = transport
        self.default_timeout = default_timeout
        self.serving = Serving(self, probe_interval)
        """The serving side: handler tasks, streamed replies, probes, deadlines, cancels (bus/serving.py)."""
        self._reply_prefix: str | None = None
        self._reply_sub: RawSubscription | None = None
        self._reply_lock = asyncio.Lock()
        self._pending: dict[str, asyncio.Future | asyncio.Queue] = {}
        self._subscriptions: list[Subscription] = []
        self._background: set[asyncio.Task] = set()
        self._closed = False

    @property
    def probe_interval(self) -> float:
        """Seconds between interest probes of each streamed reply's caller (0: never probe)."""
        return self.serving.probe_interval

    @property
    def is_closed(self) -> bool:
        return self._closed

    # --- calling ----------------------------------------------------------------------
    async def request(self, subject: Subject, message: Any, *, timeout: float | None = None,
                      headers: dict[str, str] | None = None, **params: str) -> Any:
        """Send ``message`` and return the typed reply; raises a BusError subclass."""
        if subject.streamed:
            raise TypeError(f"{subject.template} is streamed: use Bus.stream()")
        name = subject.format(**params)
        timeout = self.default_timeout if timeout is None else timeout
        out_headers = self._headers(subject, headers)
        out_headers.setdefault(TIMEOUT_HEADER, f"{timeout:.3f}")
        token, inbox = await self._open_reply()
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending[token] = future
        try:
            with tracing.client_span(f"{subject.template} request", out_headers, **{"messaging.destination": name}):
                data = self._encode_within_limit(message, subject, name, out_headers)
                await self.transport.publish(name, data, out_headers, reply=inbox)
                try:
                    async with asyncio.timeout(timeout):  # never wait_for: see bus/stream.py
                        raw = await future
                except TimeoutError:
                    self._send_cancel(out_headers[REQUEST_ID_HEADER])
                    raise Timeout(f"no reply on {name} within {timeout:g}s",
                                  request_id=out_headers[REQUEST_ID_HEADER]) from None
                except asyncio.CancelledError:
                    self._send_cancel(out_headers[REQUEST_ID_HEADER])
                    raise
        finally:
            self._pending.pop(token, None)
        self._raise_for_reply(raw, name)
        return decode(raw.data, subject.reply, Encoding.from_header(header(raw, CONTENT_TYPE_HEADER), subject.encoding))

    def stream(self, subject: Subject, message: Any, *, timeout: float | None = None,
               headers: dict[str, str] | None = None, deadline: float | None = None,
               **params: str) -> "ReplyStream":
        """Send ``message`` and iterate over the streamed chunks.

        ``timeout`` bounds the wait for each next message (a stalled stream
        raises Timeout); ``deadline`` (seconds) bounds the whole stream on the
        server's side. Use ``async with`` (or ``aclose()``) so that leaving
        early cancels the work on the server.
        """
        if not subject.streamed:
            raise TypeError(f"{subject.template} is not streamed: use Bus.request()")
        out_headers = self._headers(subject, headers)
        if deadline is not None:
            out_headers[TIMEOUT_HEADER] = f"{max(deadline, 0.0):.3f}"
        return ReplyStream(self, subject, message, self.default_timeout if timeout is None else timeout,
                           out_headers, subject.format(**params))

    async def publish(self, subject: Subject, message: Any, *, headers: dict[str, str] | None = None,
                      **params: str) -> None:
        """Fire-and-forget event."""
        out_headers = self._headers(subject, headers)
        tracing.inject(out_headers)
        name = subject.format(**params)
        await self.transport.publish(name, self._encode_within_limit(message, subject, name, out_headers),
                                     out_headers)

    # --- serving ----------------------------------------------------------------------
    async def serve(self, subject: Subject, handler: Callable, *, queue: str | None | bool = True,
                    max_concurrency: int = 1024, **params: str) -> Subscription:
        """Bind ``handler`` to ``subject``.

        Each message runs in its own task (at most ``max_concurrency`` at once),
        so a slow handler never holds up the subscription. ``queue=True`` uses
        the subject's queue group, ``None``/``False`` none, a string that group.
        """
        return await self.serving.serve(subject, handler, queue=queue, max_concurrency=max_concurrency, **params)

    async def subscribe(self, subject: Subject, handler: Callable[[Any], Awaitable[None]], *,
                        queue: str | None = None, **params: str) -> Subscription:
        """Receive events in order; a failing handler is logged, never fatal.

        Fields missing from ``params`` are wildcards (``*``).
        """
        name = subject.format(**params) if params.keys() >= set(subject.fields) else subject.wildcard(**params)

        async def on_message(raw: RawMsg) -> None:
            try:
                enc = Encoding.from_header(header(raw, CONTENT_TYPE_HEADER), subject.encoding)
                event = decode(raw.data, subject.request, enc, raw.subject)
                with tracing.server_span(f"{subject.template} event", raw.headers):
                    await handler(event)
            except Exception:
                log.exception("event handler for %s failed", raw.subject)

        return await self._bind(name, on_message, queue)

    async def _bind(self, name: str, on_message: RawHandler, queue: str | None) -> Subscription:
        sub = Subscription(await self.transport.subscribe(name, on_message, queue), name)
        self._subscriptions.append(sub)
        return sub

    async def flush(self) -> None:
        """Wait until the server has taken everything published so far (backpressure for bulk sends)."""
        await self.transport.flush()

    @property
    def max_payload(self) -> int | None:
        """Largest message body the server accepts (None: no limit)."""
        return self.transport.max_payload

    @property
    def num_inflight(self) -> int:
        return len(self.serving.inflight)

    async def drain(self, timeout: float = 30.0) -> None:
        """Stop taking messages, let in-flight handlers finish, then close."""
        for sub in self._subscriptions:
            await sub.unsubscribe()
        if self.serving.inflight:
            done, pending = await asyncio.wait(set(self.serving.inflight), timeout=timeout)
            for task in pending:
                task.cancel()  # each answers its caller "unavailable" before the connection closes
            if pending:
                await asyncio.wait(pending, timeout=2.0)
        await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fut in list(self._pending.values()):  # a dropped ReplyStream's finalizer may pop meanwhile
            if isinstance(fut, asyncio.Future) and not fut.done():
                fut.set_exception(Unavailable("bus closed"))
        await self.transport.close()

    # --- internals --------------------------------------------------------------------
    def _encode_within_limit(self, message: Any, subject: Subject, name: str, headers: dict[str, str]) -> bytes:
        """The encoded message; one over the server's max_payload raises PayloadTooLarge before any send.

        NOTE: nats-server counts headers plus body against max_payload and drops the whole
        connection on a violation, so both are counted here.
        """
        data = encode(message, subject.encoding)
        limit = self.transport.max_payload
        if limit:
            size = len(data) + 12 + sum(len(k) + len(v) + 4 for k, v in headers.items())  # "NATS/1.0\r\n...\r\n"
            if size > limit:
                raise PayloadTooLarge(f"a {type(message).__name__} of {size} bytes for {name} exceeds the "
                                      f"NATS max_payload of {limit} bytes")
        return data

    def _headers(self, subject: Subject, extra: dict[str, str] | None) -> dict[str, str]:
        headers = {CONTENT_TYPE_HEADER: subject.encoding.value}
        if extra:
            headers.update(extra)
        headers.setdefault(REQUEST_ID_HEADER, uuid.uuid4().hex)
        return headers

    async def _open_reply(self) -> tuple[str, str]:
        """A token and its inbox on the one wildcard reply subscription of this bus."""
        if self._reply_prefix is None:
            async with self._reply_lock:
                if self._reply_prefix is None:
                    prefix = self.transport.new_inbox()
                    self._reply_sub = await self.transport.subscribe(prefix + ".*", self._on_reply)
                    self._reply_prefix = prefix
        token = uuid.uuid4().hex[:16]
        return token, f"{self._reply_prefix}.{token}"

    async def _on_reply(self, raw: RawMsg) -> None:
        token = raw.subject.rsplit(".", 1)[-1]
        waiter = self._pending.get(token)
        if header(raw, STREAM_HEADER) == PROBE:  # never a chunk: answer whether we still read the stream
            if raw.reply:
                await self._answer_probe(raw.reply, PROBE_GONE if waiter is None else PROBE_ALIVE)
            return
        if waiter is None:
            return  # late reply after a timeout, or a stream already closed
        if isinstance(waiter, asyncio.Queue):
            waiter.put_nowait(raw)
        elif not waiter.done():
            waiter.set_result(raw)

    async def _answer_probe(self, reply: str, answer: str) -> None:
        try:
            await self.transport.publish(reply, b"", {STREAM_HEADER: answer})
        except Exception:  # best effort: an unanswered probe means alive
            log.debug("could not answer a stream probe on %s", reply, exc_info=True)

    _raise_for_reply = staticmethod(raise_for_reply)

    def _send_cancel(self, request_id: str) -> None:
        """Tell servers to drop ``request_id`` (best effort, never blocks the caller)."""
        if self._closed:
            return

        async def send() -> None:
            try:
                with tracing.untraced():  # broadcast to every service: no span on each of them
                    await self.publish(CANCEL, CancelEvent(request_id=request_id))
            except Exception:
                log.debug("could not publish cancel for %s", request_id, exc_info=True)

        task = asyncio.get_running_loop().create_task(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
