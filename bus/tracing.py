"""W3C trace context on every message, one span per handled message.

Publishing injects ``traceparent`` into the headers; receiving extracts it and
opens a span as its child. Without an SDK tracer provider (no exporter
configured) OpenTelemetry's API hands out non-recording spans: a few dict
look-ups per message and nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("kvbus.bus")


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Add the current trace context (traceparent, tracestate) to ``headers``."""
    propagate.inject(headers)
    return headers


@contextlib.contextmanager
def client_span(name: str, headers: dict[str, str], **attributes) -> Iterator[trace.Span]:
    """A span around an outgoing message; its context goes into ``headers``."""
    with _tracer.start_as_current_span(name, kind=SpanKind.CLIENT, attributes=attributes) as span:
        propagate.inject(headers)
        yield span


@contextlib.contextmanager
def server_span(name: str, headers: Mapping[str, str] | None, **attributes) -> Iterator[trace.Span]:
    """A span for one handled message, child of the sender's context."""
    parent = propagate.extract(headers or {})
    with _tracer.start_as_current_span(
        name, context=parent, kind=SpanKind.SERVER, attributes=attributes,
        record_exception=False, set_status_on_exception=False,
    ) as span:
        yield span


def mark_error(span: trace.Span, code: str, message: str) -> None:
    span.set_attribute("kvbus.error_code", code)
    span.set_status(Status(StatusCode.ERROR, message))


def setup_tracing(service_name: str, endpoint: str | None = None) -> bool:
    """Install an OTLP/HTTP exporter when an endpoint is configured.

    The endpoint comes from the argument, ``KVBUS_OTLP_ENDPOINT`` or the standard
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` (e.g. ``http://jaeger:4318``). Returns
    whether tracing is now exported.
    """
    endpoint = endpoint or os.environ.get("KVBUS_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")))
    trace.set_tracer_provider(provider)
    log.info("exporting traces to %s as %s", endpoint, service_name)
    return True
