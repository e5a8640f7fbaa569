"""A trace as a terminal waterfall: one line per span, children under their parent in start order,
each with its start offset, its duration, a bar on the trace's time line, its service and its key
attributes (``kvbus trace``)."""

from __future__ import annotations

from typing import Any

from bus.tracing import ERROR_CODE, REQUEST_ID
from bus.tracing import names as n
from services.traces.spans import Span, roots

BAR_WIDTH = 32
KEY_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    (n.REQUEST_MODEL, "model"), (n.OPERATION_NAME, "op"), (n.REQUEST_MAX_TOKENS, "max_tokens"),
    (n.REQUEST_TEMPERATURE, "temperature"), (n.USAGE_INPUT_TOKENS, "in"), (n.USAGE_OUTPUT_TOKENS, "out"),
    (n.USAGE_CACHE_READ_INPUT_TOKENS, "cached_in"), (n.RESPONSE_FINISH_REASONS, "finish"), (n.TTFT_S, "ttft_s"),
    (n.TPOT_S, "tpot_s"), (n.ATTEMPT, "attempt"), (n.DECODE_WORKER, "decode"), (n.PREFILL_WORKER, "prefill"),
    (n.ROUTE_POLICY, "policy"), (n.ROUTE_REASON, "reason"), (n.PREDICTED_CACHED_TOKENS, "predicted_cached"),
    (n.WORKER_ID, "worker"), (n.PROMPT_TOKENS, "prompt"), (n.CACHED_TOKENS, "cached"),
    (n.LOADED_TOKENS, "loaded_back"), (n.COMPUTED_TOKENS, "computed"), (n.NUM_STEPS, "steps"),
    (n.NUM_TOKENS, "tokens"), (n.BATCH_SIZE_MIN, "batch_min"), (n.BATCH_SIZE_MEAN, "batch_mean"),
    (n.BATCH_SIZE_MAX, "batch_max"), (n.PREEMPTIONS, "preemptions"), (n.TIER, "tier"), (n.PAGES, "pages"),
    (n.BYTES, "bytes"), (n.BACKEND, "backend"), (n.PAGES_SKIPPED, "skipped_pages"), (n.DRAFTER, "drafter"),
    (n.DRAFT_PLACEMENT, "placement"), (n.DRAFTED_TOKENS, "drafted"), (n.ACCEPTED_TOKENS, "accepted"),
    (n.BUSY_S, "busy_s"), (n.FROM_WORKER, "from"), (n.TO_WORKER, "to"), (n.TOKENS_SO_FAR, "tokens_before"),
    (n.NUM_CHUNKS, "chunks"), ("kvbus.batch_size", "batch"), (ERROR_CODE, "error"),
)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ",".join(_fmt(v) for v in value)
    return str(value)


def key_attributes(span: Span) -> str:
    return " ".join(f"{label}={_fmt(span.attributes[key])}" for key, label in KEY_ATTRIBUTES
                    if key in span.attributes and span.attributes[key] not in (None, "", []))


def ordered(spans: list[Span], top: Span | None = None) -> list[tuple[int, Span]]:
    """(depth, span) in waterfall order under ``top`` (default: every root, earliest first): each
    span's children after it, earliest first."""
    children: dict[str, list[Span]] = {}
    for s in spans:
        if s.parent_id is not None:
            children.setdefault(s.parent_id, []).append(s)
    out: list[tuple[int, Span]] = []
    tops = [top] if top is not None else sorted(roots(spans), key=lambda s: s.start_ns, reverse=True)
    stack = [(0, s) for s in tops]
    while stack:
        depth, span = stack.pop()
        out.append((depth, span))
        for c in sorted(children.get(span.span_id, ()), key=lambda s: s.start_ns, reverse=True):
            stack.append((depth + 1, c))
    return out


def render(spans: list[Span], *, events: bool = False, width: int = BAR_WIDTH) -> str:
    """The waterfall of one trace's ``spans`` (``events``: each span event on a line of its own)."""
    if not spans:
        return "(no spans)"
    t0 = min(s.start_ns for s in spans)
    total = max(max(s.end_ns for s in spans) - t0, 1)
    rid = next((s.attributes[REQUEST_ID] for s in sorted(spans, key=lambda s: s.start_ns)
                if REQUEST_ID in s.attributes), None)
    services = sorted({s.service for s in spans})
    lines = [f"trace {spans[0].trace_id}" + (f"  request {rid}" if rid else "")
             + f"  {total / 1e6:.1f} ms, {len(spans)} spans, services: {', '.join(services)}",
             f"{'start ms':>9} {'dur ms':>9}  {'':{width}}  span [service]  attributes"]
    tops = sorted(roots(spans), key=lambda s: s.start_ns)
    rows = ordered(spans, tops[0])
    for i, orphan in enumerate(tops[1:]):  # e.g. the prefill worker's spans of a decode worker that died
        rows.append((-1, None) if i == 0 else (-2, None))
        rows += ordered(spans, orphan)
    for depth, s in rows:
        if s is None:
            if depth == -1:
                lines.append(f"{'':9} {'':9}  {'':{width}}  (spans whose parent never arrived: its process "
                             "died before exporting it)")
            continue
        start = (s.start_ns - t0) / 1e6
        dur = (s.end_ns - s.start_ns) / 1e6
        col = int((s.start_ns - t0) / total * width)
        length = max(1, round((s.end_ns - s.start_ns) / total * width))
        bar = (" " * col + "█" * length)[:width].ljust(width)
        status = f"  ✗ {s.status_message}" if s.status == "error" else ""
        service = s.service.removeprefix("kvbus-")
        lines.append(f"{start:9.1f} {dur:9.1f}  {bar}  {'  ' * depth}{s.name} [{service}]  {key_attributes(s)}{status}")
        if events:
            for name, at, attrs in s.events:
                detail = " ".join(f"{k.removeprefix('kvbus.')}={_fmt(v)}" for k, v in attrs.items())
                lines.append(f"{(at - t0) / 1e6:9.1f} {'':9}  {'':{width}}  {'  ' * (depth + 1)}· {name}  {detail}")
        elif s.events:
            lines[-1] += f"  ({len(s.events)} events)"
    return "\n".join(lines)
