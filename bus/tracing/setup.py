"""Installing OpenTelemetry's SDK at process start: where spans go, how many requests are traced.

``kvbus serve ROLE`` (services/runner.py) calls :func:`setup_tracing` with its :class:`TracingConfig`
(flags ``--otlp-endpoint`` and ``--trace-sample-ratio``, or ``KVBUS_OTLP_ENDPOINT`` /
``KVBUS_TRACE_SAMPLE_RATIO``; the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` is honoured too). Without an
endpoint nothing is installed and every span is a non-recording no-op.

Sampling is parent-based: the gateway decides for a request that comes without trace context (a
share ``trace_sample_ratio`` of trace ids), and every later hop follows the decision its
``traceparent`` carries, so a trace is whole or absent. A caller's own sampled ``traceparent`` is
honoured as it is.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from opentelemetry import baggage, trace

log = logging.getLogger(__name__)
_provider = None
EXPORT_DELAY_MS = 1000
"""How long finished spans wait to be exported together (OpenTelemetry's default is 5 s; a second keeps
``kvbus trace`` current and costs one small POST a second per busy service). OTEL_BSP_SCHEDULE_DELAY wins."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TracingConfig:
    """Where a service's spans go (every role has these options)."""

    otlp_endpoint: str | None = None
    """OTLP/HTTP endpoint for traces, e.g. http://127.0.0.1:4318 (Jaeger) or the receiver of kvbus up
    --trace; default: $OTEL_EXPORTER_OTLP_ENDPOINT; none: tracing off"""
    trace_sample_ratio: float = 1.0
    """share of requests traced, 0..1, decided where a request enters (parent-based: later hops, and a
    caller that sends its own traceparent, follow the decision the trace context carries)"""

    def __post_init__(self) -> None:
        if not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise ValueError(f"--trace-sample-ratio must be in [0, 1], got {self.trace_sample_ratio}")

    @property
    def endpoint(self) -> str | None:
        """The endpoint in effect: the option (or KVBUS_OTLP_ENDPOINT), else OTEL_EXPORTER_OTLP_ENDPOINT."""
        return (self.otlp_endpoint or os.environ.get("KVBUS_OTLP_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None)


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of an endpoint (``.../v1/traces`` appended unless it is there)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


def installed_provider():
    """The SDK provider setup_tracing installed in this process (None: tracing off)."""
    return _provider


class RequestIdOnEverySpan:
    """Span processor: the request id of the context a span starts in (baggage) becomes its attribute."""

    def on_start(self, span, parent_context=None) -> None:
        from bus.tracing import REQUEST_ID

        rid = baggage.get_baggage(REQUEST_ID, parent_context)
        if rid and (span.attributes is None or REQUEST_ID not in span.attributes):
            span.set_attribute(REQUEST_ID, str(rid))

    def on_end(self, span) -> None:
        pass

    def _on_ending(self, span) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def setup_tracing(service_name: str, config: TracingConfig | None = None, *, endpoint: str | None = None,
                  instance_id: str | None = None) -> bool:
    """Install an OTLP/HTTP exporter when an endpoint is configured; returns whether spans are exported.

    ``endpoint`` overrides the configuration's."""
    global _provider
    config = config or TracingConfig()
    endpoint = endpoint or config.endpoint
    if not endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = {"service.name": service_name}
    if instance_id:
        resource["service.instance.id"] = instance_id
    provider = TracerProvider(resource=Resource.create(resource),
                              sampler=ParentBased(TraceIdRatioBased(config.trace_sample_ratio)))
    provider.add_span_processor(RequestIdOnEverySpan())
    delay = None if os.environ.get("OTEL_BSP_SCHEDULE_DELAY") else EXPORT_DELAY_MS
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint)),
                                                   schedule_delay_millis=delay))
    trace.set_tracer_provider(provider)
    _provider = provider
    log.info("exporting traces to %s as %s (sample ratio %g)", traces_url(endpoint), service_name,
             config.trace_sample_ratio)
    return True


def shutdown_tracing() -> None:
    """Export what is pending and stop (at the end of a service's life)."""
    if _provider is not None:
        try:
            _provider.shutdown()
        except Exception:  # the receiver is gone: nothing to do about it now
            log.debug("could not flush the last spans", exc_info=True)
