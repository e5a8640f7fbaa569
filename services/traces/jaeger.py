"""Reading a trace back from Jaeger's query API (``kvbus trace --jaeger-url http://jaeger:16686``).

``GET /api/traces/{trace_id}`` answers ``{"data": [{"traceID", "spans": [...], "processes": {...}}]}``:
times in microseconds, attributes as typed ``tags``, span events as ``logs``, the parent as a
``CHILD_OF`` reference, the service in the span's process; Jaeger keeps an OTLP span's status in the
``otel.status_code`` / ``otel.status_description`` tags and its kind in ``span.kind``. A request id is
found through the search endpoint (``GET /api/traces?service=kvbus-gateway&tags={"kvbus.request_id": ID}``).
"""

from __future__ import annotations

import json
import time
from typing import Any

from bus.tracing import REQUEST_ID
from services.traces.spans import TRACE_ID, Span

GATEWAY_SERVICE = "kvbus-gateway"
SEARCH_LOOKBACK_S = 7 * 24 * 3600
"""How far back a request id is searched for."""
_STATUS = {"ERROR": "error", "OK": "ok"}


class JaegerError(RuntimeError):
    """Jaeger did not answer, or knows no such trace."""


def _tags(tags: list[dict] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tag in tags or ():
        value = tag.get("value")
        if tag.get("type") == "int64" and isinstance(value, str):
            value = int(value)
        elif isinstance(value, str) and value.startswith("[") and value.endswith("]"):
            try:  # Jaeger keeps an array attribute (gen_ai.response.finish_reasons) as its JSON text
                value = json.loads(value)
            except ValueError:
                pass
        out[tag["key"]] = value
    return out


def parse_trace(doc: dict) -> list[Span]:
    """Every span of Jaeger's answer for one trace (``data[0]``; [] when it holds none)."""
    data = doc.get("data") or []
    if not data:
        return []
    trace = data[0]
    processes = trace.get("processes") or {}
    out = []
    for s in trace.get("spans") or ():
        tags = _tags(s.get("tags"))
        parent = next((r["spanID"] for r in s.get("references") or () if r.get("refType") == "CHILD_OF"), None)
        status = _STATUS.get(str(tags.pop("otel.status_code", "")).upper(), "unset")
        message = str(tags.pop("otel.status_description", ""))
        if status == "unset" and tags.get("error") is True:
            status = "error"
        tags.pop("error", None)
        kind = str(tags.pop("span.kind", "internal"))
        for key in ("otel.scope.name", "otel.scope.version", "internal.span.format"):
            tags.pop(key, None)
        start_ns = int(s["startTime"]) * 1000
        events = []
        for log_entry in s.get("logs") or ():
            fields = _tags(log_entry.get("fields"))
            events.append((str(fields.pop("event", "")), int(log_entry["timestamp"]) * 1000, fields))
        service = (processes.get(s.get("processID")) or {}).get("serviceName", "unknown")
        out.append(Span(trace_id=s["traceID"].rjust(32, "0"), span_id=s["spanID"].rjust(16, "0"),
                        parent_id=parent.rjust(16, "0") if parent else None, name=s["operationName"],
                        service=service, start_ns=start_ns, end_ns=start_ns + int(s.get("duration", 0)) * 1000,
                        kind=kind, attributes=tags, events=events, status=status, status_message=message))
    return out


def fetch_trace(base_url: str, ref: str, *, timeout: float = 10.0) -> list[Span]:
    """The spans of the trace ``ref`` names (a trace id, or a request id searched among the gateway's)."""
    import httpx

    base = base_url.rstrip("/")
    try:
        with httpx.Client(timeout=timeout) as http:
            if not TRACE_ID.match(ref):
                end_us = time.time_ns() // 1000
                found = http.get(f"{base}/api/traces", params={
                    "service": GATEWAY_SERVICE, "tags": json.dumps({REQUEST_ID: ref}), "limit": 1,
                    "start": end_us - SEARCH_LOOKBACK_S * 1_000_000, "end": end_us})
                found.raise_for_status()
                data = found.json().get("data") or []
                if not data:
                    raise JaegerError(f"Jaeger at {base} has no trace of request {ref}")
                return parse_trace({"data": data[:1]})
            reply = http.get(f"{base}/api/traces/{ref}")
            if reply.status_code == 404:
                raise JaegerError(f"Jaeger at {base} has no trace {ref}")
            reply.raise_for_status()
            return parse_trace(reply.json())
    except httpx.HTTPError as exc:
        raise JaegerError(f"Jaeger at {base}: {exc}") from None
