"""Spans as ``kvbus trace`` reads them: one plain record per span, whatever it came from.

Three sources give the same :class:`Span`: OTLP/HTTP protobuf payloads (what every service exports;
:func:`from_otlp`, used by the receiver of ``kvbus up --trace``), the receiver's JSON-lines file
(:func:`read_file`), and Jaeger's query API (services/traces/jaeger.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bus.tracing import REQUEST_ID

TRACE_ID = re.compile(r"^[0-9a-f]{32}$")
_KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
_STATUSES = {0: "unset", 1: "ok", 2: "error"}


@dataclasses.dataclass
class Span:
    trace_id: str
    """32 hex digits."""
    span_id: str
    """16 hex digits."""
    parent_id: str | None
    name: str
    service: str
    start_ns: int
    end_ns: int
    kind: str = "internal"
    attributes: dict[str, Any] = dataclasses.field(default_factory=dict)
    events: list[tuple[str, int, dict[str, Any]]] = dataclasses.field(default_factory=list)
    """(name, time in ns since the epoch, attributes)."""
    status: str = "unset"
    """unset, ok or error."""
    status_message: str = ""

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def request_id(self) -> str | None:
        value = self.attributes.get(REQUEST_ID)
        return value if isinstance(value, str) else None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict) -> "Span":
        d = dict(d)
        d["events"] = [tuple(e) for e in d.get("events", ())]
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


# --- OTLP protobuf ---------------------------------------------------------------------------------
def _value(v) -> Any:
    """An OTLP AnyValue as plain Python."""
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    if which == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, which)


def _attributes(kvs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def from_otlp(request) -> list[Span]:
    """Every span of an ``ExportTraceServiceRequest`` (opentelemetry-proto)."""
    out = []
    for resource_spans in request.resource_spans:
        service = str(_attributes(resource_spans.resource.attributes).get("service.name", "unknown"))
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                out.append(Span(
                    trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_id=s.parent_span_id.hex() or None, name=s.name, service=service,
                    start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano, kind=_KINDS.get(s.kind, "internal"),
                    attributes=_attributes(s.attributes),
                    events=[(e.name, e.time_unix_nano, _attributes(e.attributes)) for e in s.events],
                    status=_STATUSES.get(s.status.code, "unset"), status_message=s.status.message))
    return out


def decode_otlp(body: bytes, content_type: str = "application/x-protobuf") -> list[Span]:
    """An OTLP/HTTP traces body (protobuf, or OTLP's JSON encoding) as spans; ValueError when malformed."""
    from google.protobuf import json_format
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    try:
        if content_type.split(";")[0].strip() == "application/json":
            json_format.Parse(body, request)
        else:
            request.ParseFromString(body)
    except (DecodeError, json_format.ParseError) as exc:
        raise ValueError(f"not an OTLP ExportTraceServiceRequest: {exc}") from None
    return from_otlp(request)


# --- the receiver's file ------------------------------------------------------------------------
def read_file(path: str | Path) -> list[Span]:
    """Every span of a JSON-lines file (a line that does not parse, e.g. half written, is skipped)."""
    spans = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    spans.append(Span.from_dict(json.loads(line)))
                except (ValueError, TypeError, KeyError):
                    continue
    except FileNotFoundError:
        pass
    return spans


# --- finding a request's trace -----------------------------------------------------------------
def by_trace(spans: Iterable[Span]) -> dict[str, list[Span]]:
    out: dict[str, list[Span]] = {}
    for s in spans:
        out.setdefault(s.trace_id, []).append(s)
    return out


def roots(spans: list[Span]) -> list[Span]:
    """Spans whose parent is not among ``spans`` (a trace's root; several when a caller's own span is elsewhere)."""
    ids = {s.span_id for s in spans}
    return [s for s in spans if s.parent_id is None or s.parent_id not in ids]


def find_trace(spans: Iterable[Span], ref: str) -> list[Span]:
    """The spans of the trace ``ref`` names: a trace id, or a request id (the latest trace carrying it)."""
    traces = by_trace(spans)
    if TRACE_ID.match(ref) and ref in traces:
        return traces[ref]
    matching = [t for t in traces.values() if any(s.request_id == ref for s in t)]
    return max(matching, key=lambda t: min(s.start_ns for s in t), default=[])


def last_trace(spans: Iterable[Span]) -> list[Span]:
    """The trace of the request that started last (a trace with a request id)."""
    traces = [t for t in by_trace(spans).values() if any(s.request_id for s in t)]
    return max(traces, key=lambda t: min(s.start_ns for s in t), default=[])
