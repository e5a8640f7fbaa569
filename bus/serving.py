"""The serving side of a :class:`bus.core.Bus`: handlers, streamed replies, probes, deadlines, cancels.

Each delivered request runs in its own task. A task can end early for one of three reasons, kept
in one mapping (:class:`Ended`), the first one recorded wins and the task is cancelled once:
- ``cancelled``: the caller published a ``CancelEvent`` for its request id (nobody is told);
- ``expired``: the caller's ``Kvbus-Timeout`` passed (the caller is told ``timeout``);
- ``abandoned``: an interest probe found the caller of a stream gone (a last ``unavailable``); only
  a caller that opted in (``Kvbus-Probe: accept``) is ever probed.
A task cancelled for no recorded reason is a shutdown (the caller is told ``unavailable``).

Wire protocol: see :mod:`bus.core`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import inspect
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from bus import tracing
from bus.codec import CONTENT_TYPE_HEADER, Encoding, decode, encode
from bus.errors import BusError, Internal, NoResponders, Timeout, Unavailable
from bus.subjects import CANCEL, Subject
from bus.transport import (
    CHUNK,
    END,
    PROBE,
    PROBE_ACCEPT,
    PROBE_GONE,
    PROBE_HEADER,
    REQUEST_ID_HEADER,
    SEQ_HEADER,
    STREAM_HEADER,
    TIMEOUT_HEADER,
    RawMsg,
    RawSubscription,
    header,
)
from schemas.common import CancelEvent

if TYPE_CHECKING:
    from bus.core import Bus

log = logging.getLogger("bus.core")  # one logger for the bus: operators filter on it

PROBE_TIMEOUT = 0.5
"""Seconds a probe waits for its answer; silence means alive (a client that ignores probes)."""


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


class Ended(enum.Enum):
    """Why a handler task was cancelled before it finished (absent: a shutdown)."""

    CANCELLED = "cancelled"
    """Its caller published a CancelEvent."""
    EXPIRED = "expired"
    """Its caller's deadline (``Kvbus-Timeout``) passed."""
    ABANDONED = "abandoned"
    """An interest probe found its stream's caller gone."""


def _wants_context(handler: Callable) -> bool:
    params = [
        p for p in inspect.signature(handler).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    return len(params) >= 2


class Serving:
    """Runs the handlers ``Bus.serve`` binds: one task per request, ended early by cancels, deadlines, probes."""

    def __init__(self, bus: "Bus", probe_interval: float):
        if not probe_interval >= 0:
            raise ValueError(f"probe_interval must be >= 0 (0: never probe), got {probe_interval}")
        self._bus = bus
        self.probe_interval = probe_interval
        self.inflight: set[asyncio.Task] = set()
        self._tasks_by_request: dict[str, set[asyncio.Task]] = {}
        self._ended: dict[asyncio.Task, Ended] = {}
        """Handler tasks cancelled on purpose, and why (a task cancelled and not in here: a shutdown)."""
        self._probes: set[asyncio.Task] = set()
        self._cancel_sub: Subscription | None = None

    @property
    def num_probing(self) -> int:
        """Streams whose caller is being probed now."""
        return len(self._probes)

    @property
    def is_idle(self) -> bool:
        """No handler runs, and nothing about one is remembered."""
        return not (self.inflight or self._tasks_by_request or self._ended or self._probes)

    async def serve(self, subject: Subject, handler: Callable, *, queue: str | None | bool,
                    max_concurrency: int, **params: str) -> Subscription:
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
            self.inflight.add(task)
            task.add_done_callback(lambda t: (self.inflight.discard(t), slots.release()))

        return await self._bus._bind(name, on_message, group)

    def _end(self, task: asyncio.Task, why: Ended) -> bool:
        """Cancel ``task`` for ``why``, unless it finished or was already ended (the first reason stands)."""
        if task.done() or task in self._ended:
            return False
        self._ended[task] = why
        task.cancel()
        return True

    async def _listen_for_cancels(self) -> None:
        if self._cancel_sub is None:
            async def on_cancel(event: CancelEvent) -> None:
                for task in list(self._tasks_by_request.get(event.request_id, ())):
                    self._end(task, Ended.CANCELLED)

            self._cancel_sub = await self._bus.subscribe(CANCEL, on_cancel)

    async def _reply(self, raw: RawMsg, data: bytes, headers: dict[str, str]) -> None:
        if raw.reply:
            await self._bus.transport.publish(raw.reply, data, headers)

    async def _handle(self, subject: Subject, handler: Callable, wants_ctx: bool, raw: RawMsg) -> None:
        in_headers = raw.headers or {}
        request_id = in_headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        base = {REQUEST_ID_HEADER: request_id}
        expiry: asyncio.TimerHandle | None = None
        task = asyncio.current_task()
        with tracing.server_span(subject.template, in_headers, **{"kvbus.request_id": request_id}) as span:
            try:
                enc = Encoding.from_header(in_headers.get(CONTENT_TYPE_HEADER), subject.encoding)
                base[CONTENT_TYPE_HEADER] = enc.value
                message = decode(raw.data, subject.request, enc, raw.subject)
                received_at = time.monotonic()
                deadline = _deadline(in_headers, received_at)
                if deadline is not None:
                    expiry = asyncio.get_running_loop().call_at(deadline, self._end, task, Ended.EXPIRED)
                args = (message, RequestContext(request_id, raw.subject, in_headers, received_at, deadline)) \
                    if wants_ctx else (message,)
                self._tasks_by_request.setdefault(request_id, set()).add(task)
                if subject.streamed:
                    await self._handle_stream(handler, args, raw, enc, base)
                else:
                    reply = await handler(*args)
                    await self._reply(raw, encode(reply, enc), base)
            except asyncio.CancelledError:
                span.set_attribute("kvbus.cancelled", True)
                why = self._ended.get(task)
                if why is None:
                    # Not ours: the service is shutting down. Say so, so the caller retries
                    # elsewhere instead of timing out.
                    if not self._bus.is_closed:
                        error = Unavailable(f"{subject.template} is shutting down (request id {request_id})")
                        await asyncio.shield(self._reply(raw, b"", {**base, **error.to_headers()}))
                    raise
                task.uncancel()  # our own doing: answer as the reason says, and end normally
                await self._answer_ended(why, subject, raw, base, span)
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
                tasks = self._tasks_by_request.get(request_id)
                if tasks is not None:
                    tasks.discard(task)
                    if not tasks:
                        del self._tasks_by_request[request_id]
                self._ended.pop(task, None)

    async def _answer_ended(self, why: Ended, subject: Subject, raw: RawMsg, base: dict[str, str], span) -> None:
        """What the caller of a handler we cancelled hears."""
        request_id = base[REQUEST_ID_HEADER]
        if why is Ended.CANCELLED:
            return  # the caller gave up: nobody is listening
        if why is Ended.EXPIRED:
            error = Timeout(f"{subject.template}: the caller's deadline passed (request id {request_id})")
            tracing.mark_error(span, error.code.value, error.message)
            await self._reply(raw, b"", {**base, **error.to_headers()})
            return
        # ABANDONED. Nobody should hear this; but a caller whose connection was only re-establishing
        # (a NATS reconnect) learns at once that its stream ended, instead of stalling.
        error = Unavailable(f"{subject.template}: stream cancelled, its caller looked gone "
                            f"(request id {request_id})")
        try:
            await self._reply(raw, b"", {**base, **error.to_headers()})
        except Exception:  # our own connection going too: there was nobody to tell
            log.debug("could not send the last word of %s", request_id, exc_info=True)

    async def _handle_stream(self, handler: Callable, args: tuple, raw: RawMsg, enc: Encoding,
                             base: dict[str, str]) -> None:
        seq = 0
        agen = handler(*args)
        probe = None
        if raw.reply and self.probe_interval > 0 and header(raw, PROBE_HEADER) == PROBE_ACCEPT:
            probe = asyncio.create_task(self._probe_caller(raw.reply, base[REQUEST_ID_HEADER],
                                                           asyncio.current_task()))
            self._probes.add(probe)
            probe.add_done_callback(self._probes.discard)
        try:
            async for chunk in agen:
                await self._reply(raw, encode(chunk, enc), {**base, STREAM_HEADER: CHUNK, SEQ_HEADER: str(seq)})
                seq += 1
        finally:
            if probe is not None:
                probe.cancel()  # before the end message: a finished stream is never probed
            await agen.aclose()
        await self._reply(raw, b"", {**base, STREAM_HEADER: END, SEQ_HEADER: str(seq)})

    async def _probe_caller(self, reply: str, request_id: str, task: asyncio.Task) -> None:
        """Cancel ``task``, a streamed reply's handler, once its caller is gone (runs beside it, never delays a chunk).

        Only for a caller that asked for probes (``Kvbus-Probe: accept``). Gone: nobody subscribes to
        ``reply`` (the caller's connection closed), or the caller answers ``gone`` (it dropped the stream
        without closing it). A timeout, any other answer or a failure of our own connection count as
        alive: a client that skips probes without answering is never cancelled.
        """
        headers = {REQUEST_ID_HEADER: request_id, STREAM_HEADER: PROBE}
        while True:
            await asyncio.sleep(self.probe_interval)
            try:
                answer = await self._bus.transport.request(reply, b"", headers, PROBE_TIMEOUT)
            except NoResponders:
                why = "nobody subscribes to its reply subject"
            except Exception:
                continue
            else:
                if header(answer, STREAM_HEADER) != PROBE_GONE:
                    continue
                why = "it answered that it no longer reads the stream"
            if self._end(task, Ended.ABANDONED):
                log.info("cancelling stream %s: its caller is gone (%s)", request_id, why)
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
