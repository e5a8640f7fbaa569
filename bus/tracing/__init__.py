"""Traces: W3C trace context on every message, one span per handled message, and each request's story.

The bus wires this module in (``bus/core.py``, ``bus/serving.py``, ``bus/stream.py``): publishing
injects ``traceparent`` into the headers, receiving extracts it and opens a span as its child.
Services never import OpenTelemetry: they tell a request's story through :class:`RequestTrace`
(``bus/tracing/request.py``: stages as context managers, spans recorded after the fact with explicit
times, attributes, span events), and ``setup_tracing`` (``bus/tracing/setup.py``) installs the SDK at
process start.

Three rules keep one trace per request and nothing else:
- A trace starts only at an entry: the gateway's ``kvbus.v1.generate(.once)`` and its HTTP API
  (:meth:`RequestTrace.start`), or any message whose caller sent a ``traceparent`` (a client's own
  trace continues into ours). Background traffic (heartbeats, KV events, draft proposals, kv_store
  leases) opens no span: :func:`client_span` and :func:`server_span` make one only inside a trace.
- The request id (the gateway's, else the first hop's ``Kvbus-Request-Id``) travels to every service
  in W3C baggage (``kvbus.request_id``; only that entry, whatever baggage a client sent), lands on
  every span (a span processor, setup.py) and on every log line (``bus/tracing/logs.py``).
- Without an SDK tracer provider (no exporter configured) OpenTelemetry's API hands out non-recording
  spans: a few dict look-ups per message and nothing else; a request's recorder is then a no-op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from opentelemetry import baggage, context, propagate, trace
from opentelemetry.trace import INVALID_SPAN, SpanKind, Status, StatusCode

from bus.subjects import GENERATE, GENERATE_ONCE
from bus.transport import REQUEST_ID_HEADER

_tracer = trace.get_tracer("kvbus.bus")
"""Every kvbus span comes from this tracer (tests swap it for one of a local provider)."""

REQUEST_ID = "kvbus.request_id"
"""Baggage key and span attribute: the request's id (the gateway's, else the first hop's)."""
HOP_REQUEST_ID = "kvbus.hop_request_id"
"""Span attribute: the handled message's own ``Kvbus-Request-Id`` where it differs (a worker attempt)."""
ERROR_CODE = "kvbus.error_code"
ENTRY_SUBJECTS = frozenset({GENERATE.template, GENERATE_ONCE.template})
"""Subjects whose requests start a trace when the caller sent none."""


def tracer() -> trace.Tracer:
    return _tracer


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Add the current trace context (traceparent, tracestate, the request id's baggage) to ``headers``."""
    propagate.inject(headers)
    return headers


def request_id(ctx: context.Context | None = None) -> str | None:
    """The request id of the current context (None outside a request)."""
    value = baggage.get_baggage(REQUEST_ID, ctx)
    return value if isinstance(value, str) else None


def current_context() -> context.Context:
    return context.get_current()


def in_trace() -> bool:
    """Whether the current context belongs to a trace (sampled or not)."""
    return trace.get_current_span().get_span_context().is_valid


def is_enabled() -> bool:
    """Whether this process records spans at all (an SDK provider is installed: setup_tracing)."""
    from bus.tracing import setup

    return setup.installed_provider() is not None


def with_request_id(rid: str | None, ctx: context.Context | None = None) -> context.Context:
    """``ctx`` (default: the current one) carrying ``rid`` as its only baggage entry."""
    ctx = baggage.clear(ctx if ctx is not None else context.get_current())
    return baggage.set_baggage(REQUEST_ID, rid, ctx) if rid else ctx


@contextlib.contextmanager
def attached(ctx: context.Context) -> Iterator[None]:
    """Make ``ctx`` current for the block (which must not span a yield to another task)."""
    token = context.attach(ctx)
    try:
        yield
    finally:
        context.detach(token)


@contextlib.contextmanager
def client_span(name: str, headers: dict[str, str], **attributes) -> Iterator[trace.Span]:
    """A span around an outgoing message; its context goes into ``headers``. Outside a trace no span
    is made (the headers still carry the request id)."""
    if not in_trace():
        propagate.inject(headers)
        yield INVALID_SPAN
        return
    with _tracer.start_as_current_span(name, kind=SpanKind.CLIENT, attributes=attributes) as span:
        propagate.inject(headers)
        yield span


@contextlib.contextmanager
def server_span(name: str, headers: Mapping[str, str] | None, **attributes) -> Iterator[trace.Span]:
    """A span for one handled message, child of the sender's context; the request id (from the
    sender's baggage, else the message's own id) is current for the block (logs, later hops).

    A message outside any trace makes no span unless ``name`` is an entry subject (ENTRY_SUBJECTS).
    """
    headers = headers or {}
    parent = propagate.extract(headers)
    hop_id = attributes.get(REQUEST_ID) or headers.get(REQUEST_ID_HEADER)
    rid = request_id(parent) or hop_id
    with attached(with_request_id(rid, parent)):
        if not (trace.get_current_span().get_span_context().is_valid or name in ENTRY_SUBJECTS):
            yield INVALID_SPAN
            return
        if rid:
            attributes[REQUEST_ID] = rid
            if hop_id and hop_id != rid:
                attributes[HOP_REQUEST_ID] = hop_id
        with _tracer.start_as_current_span(
            name, kind=SpanKind.SERVER, attributes=attributes,
            record_exception=False, set_status_on_exception=False,
        ) as span:
            yield span


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """Messages sent in the block carry no trace context (bulk sends: KV chunks would each open a
    span on the receiver); the request id still travels."""
    with attached(trace.set_span_in_context(INVALID_SPAN)):
        yield


def mark_error(span: trace.Span, code: str, message: str) -> None:
    """The span failed with kvbus error ``code`` (its status, ``kvbus.error_code`` and ``error.type``)."""
    if not span.is_recording():
        return
    span.set_attribute(ERROR_CODE, code)
    span.set_attribute("error.type", code)
    span.set_status(Status(StatusCode.ERROR, message))


from bus.tracing.logs import install_log_context  # noqa: E402  (they use the names above)
from bus.tracing.request import NO_TRACE, RequestTrace, to_epoch_ns  # noqa: E402
from bus.tracing.setup import TracingConfig, setup_tracing, shutdown_tracing  # noqa: E402

__all__ = [
    "ENTRY_SUBJECTS", "ERROR_CODE", "HOP_REQUEST_ID", "NO_TRACE", "REQUEST_ID", "RequestTrace", "TracingConfig",
    "attached", "client_span", "current_context", "in_trace", "inject", "install_log_context", "is_enabled", "mark_error",
    "request_id", "server_span", "setup_tracing", "shutdown_tracing", "to_epoch_ns", "tracer", "untraced",
    "with_request_id",
]
