"""How tests/unit/data/jaeger_trace.json was made: one of our own traces (the JSON-lines file ``kvbus up
--trace`` writes), turned into what Jaeger's query API answers for it (``GET /api/traces/{id}``), the way
Jaeger (v1 data model) stores an OTLP span: times in microseconds; attributes as typed tags (arrays as JSON
strings); the kind in ``span.kind`` (none for internal spans); the status in ``otel.status_code`` /
``otel.status_description`` plus ``error: true``; the instrumentation scope in ``otel.scope.name``; span
events as logs whose ``event`` field is the name; the parent as a ``CHILD_OF`` reference; the service in
the span's process.

    python tests/unit/data/make_jaeger_fixture.py TRACES.jsonl TRACE_ID > tests/unit/data/jaeger_trace.json

It was made from the trace of test_traces_up.py's first request (1P2D, HiCache, speculation).
"""

from __future__ import annotations

import json
import sys

from services.traces.spans import find_trace, read_file


def tag(key: str, value) -> dict:
    if isinstance(value, bool):
        return {"key": key, "type": "bool", "value": value}
    if isinstance(value, int):
        return {"key": key, "type": "int64", "value": value}
    if isinstance(value, float):
        return {"key": key, "type": "float64", "value": value}
    if isinstance(value, (list, dict)):
        return {"key": key, "type": "string", "value": json.dumps(value)}
    return {"key": key, "type": "string", "value": str(value)}


def to_jaeger(spans) -> dict:
    services = sorted({s.service for s in spans})
    process_ids = {name: f"p{i + 1}" for i, name in enumerate(services)}
    out = []
    for s in sorted(spans, key=lambda s: s.start_ns):
        tags = [tag(k, v) for k, v in s.attributes.items()]
        tags.append(tag("otel.scope.name", "kvbus.bus"))
        if s.kind not in ("internal", "unspecified"):
            tags.append(tag("span.kind", s.kind))
        if s.status == "error":
            tags += [tag("otel.status_code", "ERROR"), tag("error", True)]
            if s.status_message:
                tags.append(tag("otel.status_description", s.status_message))
        elif s.status == "ok":
            tags.append(tag("otel.status_code", "OK"))
        out.append({
            "traceID": s.trace_id, "spanID": s.span_id, "operationName": s.name, "flags": 1,
            "references": [{"refType": "CHILD_OF", "traceID": s.trace_id, "spanID": s.parent_id}]
            if s.parent_id else [],
            "startTime": s.start_ns // 1000, "duration": (s.end_ns - s.start_ns) // 1000, "tags": tags,
            "logs": [{"timestamp": at // 1000, "fields": [tag("event", name)] + [tag(k, v) for k, v in attrs.items()]}
                     for name, at, attrs in s.events],
            "processID": process_ids[s.service], "warnings": None})
    processes = {pid: {"serviceName": name, "tags": [tag("telemetry.sdk.language", "python"),
                                                       tag("telemetry.sdk.name", "opentelemetry")]}
                 for name, pid in process_ids.items()}
    return {"data": [{"traceID": spans[0].trace_id, "spans": out, "processes": processes, "warnings": None}],
            "total": 0, "limit": 0, "offset": 0, "errors": None}


if __name__ == "__main__":
    print(json.dumps(to_jaeger(find_trace(read_file(sys.argv[1]), sys.argv[2])), indent=1))
