"""The finished spans of a test, captured in memory (import the ``exporter`` fixture where needed)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import bus.tracing as tracing
from bus.tracing.setup import RequestIdOnEverySpan


@pytest.fixture
def exporter(monkeypatch) -> InMemorySpanExporter:
    """Every span the services record in this test (the request id on each, as in production)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(RequestIdOnEverySpan())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    return exporter
