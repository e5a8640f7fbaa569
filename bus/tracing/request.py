"""A request's story on one service, told without OpenTelemetry in the service's code.

A :class:`RequestTrace` wraps the span a request hangs under on this service (the bus's server span
for the handled message, or the gateway's HTTP root) and hands out children:

- ``with trace.stage("route", {...}) as route:`` a child span around a block, current inside it
  (messages sent there are its children); an exception sets its status (a kvbus error: its code);
- ``trace.open("worker", {...})``: a child span started now and ended by ``.end()`` later, for a
  stage that outlives one block (a stream read across yields); ``with stage.activated():`` makes it
  current around the calls that should hang under it;
- ``trace.record("decode", start, end, {...}, events=[...])``: a child span after the fact, with
  explicit times (``time.monotonic()`` seconds), so code that must not call OpenTelemetry as it goes
  (the engine thread, per token) keeps a timeline and the asyncio side turns it into spans;
- ``trace.set({...})``, ``trace.event(...)``, ``trace.error(code, message)``.

Every method of a trace that does not record (tracing off, or a request not sampled) returns at
once, and its children are that same no-op (:data:`NO_TRACE`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import context, propagate, trace
from opentelemetry.trace import INVALID_SPAN, SpanKind, Status, StatusCode

import bus.tracing as _tracing

Attributes = Mapping[str, Any]
Event = tuple[str, float, Attributes]
"""A span event recorded after the fact: (name, time.monotonic() seconds, attributes)."""

_MONOTONIC_TO_EPOCH_NS = time.time_ns() - time.monotonic_ns()


def to_epoch_ns(t: float) -> int:
    """``time.monotonic()`` seconds as OpenTelemetry's nanoseconds since the epoch (this process's clock)."""
    return int(t * 1e9) + _MONOTONIC_TO_EPOCH_NS


def _clean(attributes: Attributes | None) -> dict[str, Any]:
    """OpenTelemetry takes no None values: drop them; tuples become lists."""
    if not attributes:
        return {}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in attributes.items() if v is not None}


class RequestTrace:
    """One request's span on this service, and the children it hands out (see the module's doc)."""

    __slots__ = ("span", "_context")

    def __init__(self, span: trace.Span, ctx: context.Context | None = None):
        self.span = span
        self._context = trace.set_span_in_context(span, ctx if ctx is not None else context.get_current())

    # --- where a request's trace comes from -------------------------------------------------
    @classmethod
    def current(cls) -> "RequestTrace":
        """The span the current message is handled in (the bus's server span), or NO_TRACE."""
        span = trace.get_current_span()
        return cls(span) if span.is_recording() else NO_TRACE

    @classmethod
    def start(cls, name: str, headers: Mapping[str, str] | None, *, request_id: str,
              attributes: Attributes | None = None) -> "RequestTrace":
        """An entry's root span (the gateway's HTTP request), child of the caller's ``traceparent``
        if it sent one; not made current: end it with :meth:`end` when the last byte left."""
        parent = _tracing.with_request_id(request_id, propagate.extract(dict(headers or {})))
        attrs = {**_clean(attributes), _tracing.REQUEST_ID: request_id}
        span = _tracing.tracer().start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attrs,
                                            record_exception=False, set_status_on_exception=False)
        return cls(span, parent) if span.is_recording() else _NoTrace(span, parent)

    # --- what it holds ------------------------------------------------------------------------
    @property
    def is_recording(self) -> bool:
        return self.span.is_recording()

    @property
    def trace_id(self) -> str:
        """32 hex digits (empty when not recording)."""
        ctx = self.span.get_span_context()
        return trace.format_trace_id(ctx.trace_id) if ctx.is_valid else ""

    @contextlib.contextmanager
    def activated(self) -> Iterator["RequestTrace"]:
        """This span current for the block (messages sent there are its children); the block must
        not yield to another task."""
        with _tracing.attached(self._context):
            yield self

    # --- children -----------------------------------------------------------------------------
    def open(self, name: str, attributes: Attributes | None = None, *, at: float | None = None) -> "RequestTrace":
        """A child started now (or at ``at``, monotonic seconds) and ended by its :meth:`end`."""
        span = _tracing.tracer().start_span(name, context=self._context, attributes=_clean(attributes),
                                            start_time=None if at is None else to_epoch_ns(at),
                                            record_exception=False, set_status_on_exception=False)
        return RequestTrace(span, self._context)

    @contextlib.contextmanager
    def stage(self, name: str, attributes: Attributes | None = None) -> Iterator["RequestTrace"]:
        """A child span around the block, current inside it; an exception marks it failed."""
        child = self.open(name, attributes)
        try:
            with child.activated():
                yield child
        except BaseException as exc:
            child.fail(exc)
            raise
        finally:
            child.end()

    def record(self, name: str, start: float, end: float, attributes: Attributes | None = None, *,
               events: Sequence[Event] = (), error: tuple[str, str] | None = None) -> "RequestTrace":
        """A child span after the fact, from ``start`` to ``end`` (monotonic seconds); returns it so
        that children can be recorded under it."""
        child = self.open(name, attributes, at=start)
        for event_name, at, event_attributes in events:
            child.event(event_name, event_attributes, at=at)
        if error is not None:
            child.error(*error)
        child.end(at=max(end, start))
        return child

    # --- the span itself -------------------------------------------------------------------------
    def set(self, attributes: Attributes) -> None:
        self.span.set_attributes(_clean(attributes))

    def event(self, name: str, attributes: Attributes | None = None, *, at: float | None = None) -> None:
        self.span.add_event(name, _clean(attributes), timestamp=None if at is None else to_epoch_ns(at))

    def error(self, code: str, message: str) -> None:
        """Failed with kvbus error ``code``."""
        _tracing.mark_error(self.span, code, message)

    def fail(self, exc: BaseException) -> None:
        """Failed with ``exc``: a kvbus error's code, ``cancelled`` for a cancellation, else ``internal``."""
        from bus.errors import BusError

        if isinstance(exc, BusError):
            self.error(exc.code.value, exc.message)
        elif isinstance(exc, (GeneratorExit, _cancelled_types())):
            self.span.set_attribute("kvbus.cancelled", True)
        else:
            self.error("internal", type(exc).__name__)

    def end(self, *, at: float | None = None) -> None:
        self.span.end(end_time=None if at is None else to_epoch_ns(at))


def _cancelled_types() -> tuple[type, ...]:
    import asyncio

    return (asyncio.CancelledError,)


class _NoTrace(RequestTrace):
    """A trace that records nothing: every call returns at once (tracing off, a request not sampled).

    It still carries its context, so messages sent while it is activated continue the caller's
    trace (an unsampled ``traceparent`` passes through)."""

    __slots__ = ()

    def __init__(self, span: trace.Span, ctx: context.Context | None = None):
        self.span = span
        self._context = None if ctx is None else trace.set_span_in_context(span, ctx)

    @contextlib.contextmanager
    def activated(self):
        if self._context is None:  # NO_TRACE: the current context goes on as it is
            yield self
            return
        with _tracing.attached(self._context):
            yield self

    def open(self, name, attributes=None, *, at=None):
        return self

    @contextlib.contextmanager
    def stage(self, name, attributes=None):
        yield self

    def record(self, name, start, end, attributes=None, *, events=(), error=None):
        return self

    def set(self, attributes):
        pass

    def event(self, name, attributes=None, *, at=None):
        pass

    def error(self, code, message):
        pass

    def fail(self, exc):
        pass

    def end(self, *, at=None):
        if self.span is not INVALID_SPAN:
            self.span.end()


NO_TRACE: RequestTrace = _NoTrace(INVALID_SPAN)
"""The trace of a request that is not recorded."""

__all__ = ["Attributes", "Event", "NO_TRACE", "RequestTrace", "Status", "StatusCode", "to_epoch_ns"]
