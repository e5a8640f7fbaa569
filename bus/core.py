"""The Bus: typed request/reply, streamed replies, events, errors and traces.

One implementation over a tiny raw transport (:mod:`bus.transport`: publish,
subscribe, inbox), so the NATS bus (:mod:`bus.nats_transport`) and the
in-memory bus (:mod:`bus.memory`) behave the same down to headers and error
codes. The caller's side of a streamed reply is :mod:`bus.stream`.

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
- Interest probes: while a streamed reply runs, the server sends at most every
  ``probe_interval`` seconds a request with ``Kvbus-Stream: probe`` and an empty
  body to the stream's reply subject. "No responders" (the caller's connection is
  gone) or an answer ``Kvbus-Stream: gone`` (the caller dropped the stream)
  cancels the handler as a CancelEvent would; silence or any other answer means
  alive. A caller ignores probes (it may answer them): our Bus answers ``alive``
  for a stream it still reads and ``gone`` for one it does not know.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from bus import tracing
from bus.codec import CONTENT_TYPE_HEADER, Encoding, decode, encode
from bus.errors import BusError, Internal, NoResponders, PayloadTooLarge, Timeout, Unavailable
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

PROBE_TIMEOUT = 0.5
"""Seconds a probe waits for its answer; silence means alive (a client that ignores probes)."""

__all__ = [  # the transport's and the stream's names stay importable from here
    "NO_RESPONDERS", "REQUEST_ID_HEADER", "SEQ_HEADER", "STATUS_HEADER", "STREAM_HEADER", "TIMEOUT_HEADER",
    "Bus", "RawHandler", "RawMsg", "RawSubscription", "ReplyStream", "RequestContext", "StreamBroken",
    "Subscription", "Transport",
]


@dataclasses.dataclass(slots=True)
class RequestContext:
    """What a handler may want to know beyond the request body."""

    request_id: str
    subject: str
    headers: dict[str, str]
    received_at: float
    deadline: float | None = None
    """time.monotonic() past which the caller no longer waits (from ``Kvbus-Timeout``); None: unbounded."""

    @property
    def time_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()


class Subscription:
    """A bound subject; ``unsubscribe`` stops deliveries (in-flight handlers go on)."""

    def __init__(self, raw: RawSubscription, subject: str):
        self._raw = raw
        self.subject = subject
        self.is_active = True

    async def unsubscribe(self) -> None:
        if self.is_active:
            self.is_active = False
            await self._raw.unsubscribe()


def _wants_context(handler: Callable) -> bool:
    params = [
        p for p in inspect.signature(handler).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    return len(params) >= 2


class Bus:
    """Typed messaging over a :class:`Transport`.

    ``request`` and ``stream`` call; ``serve`` binds a handler to a subject;
    ``publish``/``subscribe`` carry events. Handlers take a request Struct (and
    optionally a :class:`RequestContext`) and return the reply Struct, or, on a
    streamed subject, are async generators of chunk Structs.
    """

    def __init__(self, transport: Transport, *, default_timeout: float = 10.0, probe_interval: float = 1.0):
        if not probe_interval >= 0:
            raise ValueError(f"probe_interval must be >= 0 (0: never probe), got {probe_interval}")
        self.transport = transport
        self.default_timeout = default_timeout
        self.probe_interval = probe_interval
        """Seconds between interest probes of each streamed reply's caller (0: never probe)."""
        self._reply_prefix: str | None = None
        self._reply_sub: RawSubscription | None = None
        self._reply_lock = asyncio.Lock()
        self._pending: dict[str, asyncio.Future | asyncio.Queue] = {}
        self._subscriptions: list[Subscription] = []
        self._inflight: set[asyncio.Task] = set()
        self._tasks_by_request: dict[str, set[asyncio.Task]] = {}
        self._cancelled: set[asyncio.Task] = set()
        """Handler tasks cancelled by their caller (a CancelEvent), not by a shutdown."""
        self._expired: set[asyncio.Task] = set()
        """Handler tasks cancelled because their caller's deadline (``Kvbus-Timeout``) passed."""
        self._abandoned: set[asyncio.Task] = set()
        """Streamed handler tasks cancelled because a probe found their caller gone (also in ``_cancelled``)."""
        self._cancel_sub: Subscription | None = None
        self._background: set[asyncio.Task] = set()
        self._closed = False

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
                    raw = await asyncio.wait_for(future, timeout)
                except asyncio.TimeoutError:
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
        if subject.reply is None:
            raise TypeError(f"{subject.template} is an event subject: use Bus.subscribe()")
        name = subject.format(**params) if params or subject.fields else subject.template
        group = subject.queue if queue is True else (queue or None)
        wants_ctx = _wants_context(handler)
        slots = asyncio.Semaphore(max_concurrency)
        await self._listen_for_cancels()

        async def on_message(raw: RawMsg) -> None:
            await slots.acquire()
            task = asyncio.create_task(self._handle(subject, handler, wants_ctx, raw))
            self._inflight.add(task)
            task.add_done_callback(lambda t: (self._inflight.discard(t), slots.release()))

        sub = Subscription(await self.transport.subscribe(name, on_message, group), name)
        self._subscriptions.append(sub)
        return sub

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
        return len(self._inflight)

    async def drain(self, timeout: float = 30.0) -> None:
        """Stop taking messages, let in-flight handlers finish, then close."""
        for sub in self._subscriptions:
            await sub.unsubscribe()
        if self._inflight:
            done, pending = await asyncio.wait(set(self._inflight), timeout=timeout)
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

    async def _listen_for_cancels(self) -> None:
        if self._cancel_sub is None:
            async def on_cancel(event: CancelEvent) -> None:
                for task in list(self._tasks_by_request.get(event.request_id, ())):
                    self._cancelled.add(task)
                    task.cancel()

            self._cancel_sub = await self.subscribe(CANCEL, on_cancel)

    def _send_cancel(self, request_id: str) -> None:
        """Tell servers to drop ``request_id`` (best effort, never blocks the caller)."""
        if self._closed:
            return

        async def send() -> None:
            try:
                await self.publish(CANCEL, CancelEvent(request_id=request_id))
            except Exception:
                log.debug("could not publish cancel for %s", request_id, exc_info=True)

        task = asyncio.get_running_loop().create_task(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _reply(self, raw: RawMsg, data: bytes, headers: dict[str, str]) -> None:
        if raw.reply:
            await self.transport.publish(raw.reply, data, headers)

    async def _handle(self, subject: Subject, handler: Callable, wants_ctx: bool, raw: RawMsg) -> None:
        in_headers = raw.headers or {}
        request_id = in_headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        base = {REQUEST_ID_HEADER: request_id}
        expiry: asyncio.TimerHandle | None = None
        with tracing.server_span(subject.template, in_headers, **{"kvbus.request_id": request_id}) as span:
            try:
                enc = Encoding.from_header(in_headers.get(CONTENT_TYPE_HEADER), subject.encoding)
                base[CONTENT_TYPE_HEADER] = enc.value
                message = decode(raw.data, subject.request, enc, raw.subject)
                received_at = time.monotonic()
                deadline = _deadline(in_headers, received_at)
                if deadline is not None:
                    expiry = self._expire_at(deadline, asyncio.current_task())
                args = (message, RequestContext(request_id, raw.subject, in_headers, received_at, deadline)) \
                    if wants_ctx else (message,)
                self._tasks_by_request.setdefault(request_id, set()).add(asyncio.current_task())
                if subject.streamed:
                    await self._handle_stream(handler, args, raw, enc, base)
                else:
                    reply = await handler(*args)
                    await self._reply(raw, encode(reply, enc), base)
            except asyncio.CancelledError:
                # The caller gave up (CancelEvent): nobody is listening. Otherwise the service is
                # shutting down: say so, so the caller retries elsewhere instead of timing out.
                span.set_attribute("kvbus.cancelled", True)
                task = asyncio.current_task()
                if task in self._expired:  # our own deadline timer: answer, and end normally
                    task.uncancel()
                    error = Timeout(f"{subject.template}: the caller's deadline passed (request id {request_id})")
                    tracing.mark_error(span, error.code.value, error.message)
                    await self._reply(raw, b"", {**base, **error.to_headers()})
                elif task not in self._cancelled:
                    if not self._closed:
                        error = Unavailable(f"{subject.template} is shutting down (request id {request_id})")
                        await asyncio.shield(self._reply(raw, b"", {**base, **error.to_headers()}))
                    raise
                elif task in self._abandoned:
                    # Nobody should hear this; but a caller whose connection was only re-establishing
                    # (a NATS reconnect) learns at once that its stream ended, instead of stalling.
                    task.uncancel()
                    error = Unavailable(f"{subject.template}: stream cancelled, its caller looked gone "
                                        f"(request id {request_id})")
                    try:
                        await self._reply(raw, b"", {**base, **error.to_headers()})
                    except Exception:  # our own connection going too: there was nobody to tell
                        log.debug("could not send the last word of %s", request_id, exc_info=True)
            except BusError as exc:
                tracing.mark_error(span, exc.code.value, exc.message)
                await self._reply(raw, b"", {**base, **exc.to_headers()})
            except Exception:
                log.exception("handler for %s failed (request id %s)", raw.subject, request_id)
                error = Internal(f"internal error handling {subject.template} (request id {request_id})")
                tracing.mark_error(span, error.code.value, error.message)
                await self._reply(raw, b"", {**base, **error.to_headers()})
            finally:
                if expiry is not None:
                    expiry.cancel()
                task = asyncio.current_task()
                tasks = self._tasks_by_request.get(request_id)
                if tasks is not None:
                    tasks.discard(task)
                    if not tasks:
                        del self._tasks_by_request[request_id]
                self._cancelled.discard(task)
                self._expired.discard(task)
                self._abandoned.discard(task)

    def _expire_at(self, deadline: float, task: asyncio.Task) -> asyncio.TimerHandle:
        """Cancel ``task`` at ``deadline`` (time.monotonic(), which is the event loop's clock too)."""
        def expire() -> None:
            if not task.done():
                self._expired.add(task)
                task.cancel()

        return asyncio.get_running_loop().call_at(deadline, expire)

    async def _handle_stream(self, handler: Callable, args: tuple, raw: RawMsg, enc: Encoding,
                             base: dict[str, str]) -> None:
        seq = 0
        agen = handler(*args)
        probe = None
        if raw.reply and self.probe_interval > 0:
            probe = asyncio.create_task(self._probe_caller(raw.reply, base[REQUEST_ID_HEADER],
                                                           asyncio.current_task()))
            self._background.add(probe)
            probe.add_done_callback(self._background.discard)
        try:
            async for chunk in agen:
                await self._reply(raw, encode(chunk, enc), {**base, STREAM_HEADER: "chunk", SEQ_HEADER: str(seq)})
                seq += 1
        finally:
            if probe is not None:
                probe.cancel()  # before the end message: a finished stream is never probed
            await agen.aclose()
        await self._reply(raw, b"", {**base, STREAM_HEADER: "end", SEQ_HEADER: str(seq)})

    async def _probe_caller(self, reply: str, request_id: str, task: asyncio.Task) -> None:
        """Cancel ``task``, a streamed reply's handler, once its caller is gone (runs beside it, never delays a chunk).

        Gone: nobody subscribes to ``reply`` (the caller's connection closed), or the caller answers
        ``gone`` (it dropped the stream without closing it). A timeout, any other answer or a
        failure of our own connection count as alive: a client that ignores probes is never cancelled.
        """
        headers = {REQUEST_ID_HEADER: request_id, STREAM_HEADER: PROBE}
        while True:
            await asyncio.sleep(self.probe_interval)
            try:
                answer = await self.transport.request(reply, b"", headers, PROBE_TIMEOUT)
            except NoResponders:
                why = "nobody subscribes to its reply subject"
            except Exception:
                continue
            else:
                if header(answer, STREAM_HEADER) != PROBE_GONE:
                    continue
                why = "it answered that it no longer reads the stream"
            if task.done():
                return
            log.info("cancelling stream %s: its caller is gone (%s)", request_id, why)
            self._abandoned.add(task)
            self._cancelled.add(task)
            task.cancel()
            return


def _deadline(headers: dict[str, str], received_at: float) -> float | None:
    """The caller's deadline on our clock, from ``Kvbus-Timeout`` (ignored when malformed)."""
    value = headers.get(TIMEOUT_HEADER)
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    if seconds != seconds or seconds < 0 or seconds == float("inf"):
        return None
    return received_at + seconds
