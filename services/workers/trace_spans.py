"""An engine worker's part of a request's trace: the engine's stages, recorded after the fact.

The engine thread keeps a :class:`~services.engine.timeline.RequestTimeline` of each traced request
(timestamps and counters, no OpenTelemetry); once the request is done on this worker,
:func:`record_engine_stages` turns it into spans under the worker's span for the request, with the
times the engine saw:

    queue               arrival (or its KV's arrival) to the step that admitted it
    hicache.load_back   pages copied from the host tier into the device pool (tier, pages, bytes)
    prefill             the prompt's chunks to the first token (cached, loaded-back, computed tokens)
    decode              first decode step to the last (steps, batch sizes seen, tokens, preemptions),
                        with a span event every STEP_EVENT_EVERY steps (timeline.py)
      speculation       drafter, placement, drafted and accepted tokens
      detokenize        the incremental detokenizer's time (busy_s) within decode's extent
    hicache.write_back  the request's own pages copied to the host tier while it ran (write-through)

A worker that records a request's trace makes its engine's Timelines on first use (:func:`track`).
"""

from __future__ import annotations

from bus.tracing import RequestTrace
from bus.tracing import names as n
from services.engine.timeline import RequestTimeline, Timelines


def track(worker, request_id: str, trace: RequestTrace) -> RequestTimeline | None:
    """Start the engine's timeline of ``request_id`` when ``trace`` records (else None: no cost)."""
    if not trace.is_recording:
        return None
    engine = worker.engine.engine  # the LLMEngine under the worker's AsyncEngine
    if engine.timelines is None:
        engine.timelines = Timelines()
    tier = worker.tier
    if tier is not None and tier.trace_log is None:
        from services.kv_store.trace_log import TierTraceLog

        tier.trace_log = TierTraceLog()
    return engine.timelines.track(request_id)


def untrack(worker, timeline: RequestTimeline | None) -> None:
    if timeline is not None and worker.engine.timelines is not None:
        worker.engine.timelines.untrack(timeline.request_id)


def speculation_of(worker) -> tuple[str, str] | None:
    """(drafter, placement) when the worker's engine speculates, else None."""
    if worker.engine.drafter is None:
        return None
    return worker.config.speculative_method or type(worker.engine.drafter).__name__, worker.config.draft_placement


def kv_arrived(worker, request_id: str, at: float) -> None:
    """A decode worker handed a traced request's pages from its prefill worker to the engine at ``at``:
    its queue wait starts there (the wait before is the transfer's span)."""
    timelines = worker.engine.timelines
    timeline = timelines.get(request_id) if timelines is not None else None
    if timeline is not None:
        timeline.kv_arrived_at = at


def record_engine_stages(worker, trace: RequestTrace, timeline: RequestTimeline | None, *,
                         ended_at: float) -> None:
    """The engine's stages of a finished (or abandoned) request as spans under ``trace``."""
    untrack(worker, timeline)
    if timeline is None or not trace.is_recording:
        return
    seq, tl = timeline.seq, timeline
    arrived = tl.arrived_at if tl.arrived_at is not None else tl.tracked_at
    if tl.kv_arrived_at is not None:
        arrived = max(arrived, tl.kv_arrived_at)
    if tl.admitted_at is not None:
        trace.record(n.QUEUE, arrived, tl.admitted_at)
    else:  # never admitted (aborted while waiting): its whole time here was queueing
        trace.record(n.QUEUE, arrived, ended_at, {"kvbus.admitted": False})
        return
    page_size = worker.engine.block_manager.page_size
    _load_back(worker, trace, tl, seq, page_size)
    if tl.prefill_from is not None and seq is not None:
        num_cached = seq.num_cached_tokens
        loaded = min(seq.num_loaded_tokens, num_cached)
        trace.record(n.PREFILL, tl.prefill_from, tl.prefill_end, {
            n.PROMPT_TOKENS: seq.num_prompt_tokens, n.CACHED_TOKENS: num_cached,
            n.DEVICE_CACHED_TOKENS: num_cached - loaded, n.LOADED_TOKENS: loaded,
            n.COMPUTED_TOKENS: tl.num_prefill_tokens, n.NUM_STEPS: tl.num_prefill_steps})
    if tl.first_decode_at is not None:
        _decode(worker, trace, tl, seq)
    _write_back(worker, trace, tl, seq, arrived)


def _decode(worker, trace: RequestTrace, tl: RequestTimeline, seq) -> None:
    start, end = tl.first_decode_at, tl.last_step_end
    events = [(n.STEP_EVENT, at, {n.NUM_STEPS: steps, n.NUM_TOKENS: tokens, n.BATCH_SIZE_MEAN: round(batch, 2),
                                  "kvbus.window_s": round(window_s, 6), n.DRAFTED_TOKENS: drafted,
                                  n.ACCEPTED_TOKENS: accepted})
              for at, steps, tokens, batch, window_s, drafted, accepted in tl.events]
    decode = trace.record(n.DECODE, start, end, {
        n.NUM_STEPS: tl.num_decode_steps, n.NUM_TOKENS: seq.num_output_tokens if seq is not None else None,
        n.BATCH_SIZE_MIN: tl.batch_min, n.BATCH_SIZE_MAX: tl.batch_max,
        n.BATCH_SIZE_MEAN: round(tl.batch_sum / tl.num_decode_steps, 2) if tl.num_decode_steps else None,
        n.PREEMPTIONS: seq.num_preemptions if seq is not None else None,
        "kvbus.step_event_every": worker.engine.timelines.event_every},
        events=events)
    spec = speculation_of(worker)
    if spec is not None and seq is not None:
        drafter, placement = spec
        decode.record(n.SPECULATION, start, end, {
            n.DRAFTER: drafter, n.DRAFT_PLACEMENT: placement, n.DRAFTED_TOKENS: seq.num_drafted_tokens,
            n.ACCEPTED_TOKENS: seq.num_accepted_tokens, n.VERIFY_STEPS: seq.num_spec_steps,
            n.ACCEPT_LENGTH: round((seq.num_accepted_tokens + seq.num_spec_steps) / seq.num_spec_steps, 3)
            if seq.num_spec_steps else 0.0,
            n.DRAFT_S: round(seq.draft_seconds, 6)})
    if tl.num_detok_calls:
        decode.record(n.DETOKENIZE, start, end, {n.BUSY_S: round(tl.detok_seconds, 6),
                                                 n.NUM_TOKENS: tl.num_detok_calls})


def _load_back(worker, trace: RequestTrace, tl: RequestTimeline, seq, page_size: int) -> None:
    tier = worker.tier
    if seq is None or tier is None or not seq.num_loaded_tokens:
        return
    num_pages = seq.num_loaded_tokens // page_size
    attrs = {n.TIER: "host", n.PAGES: num_pages, n.BYTES: num_pages * getattr(tier, "page_bytes", 0),
             n.NUM_TOKENS: seq.num_loaded_tokens}
    if tl.loading_from is not None and tl.loaded_at is not None:  # copied while the engine stepped on
        trace.record(n.LOAD_BACK, tl.loading_from, tl.loaded_at, {**attrs, "kvbus.hicache.mode": "async"})
        return
    moves = tier.trace_log.loads_of(seq.page_hashes, tl.tracked_at) if tier.trace_log is not None else []
    if moves:  # copied in the step that admitted it
        trace.record(n.LOAD_BACK, min(s for s, _ in moves), max(e for _, e in moves),
                     {**attrs, "kvbus.hicache.mode": "sync"})


def _write_back(worker, trace: RequestTrace, tl: RequestTimeline, seq, since: float) -> None:
    tier = worker.tier
    if seq is None or tier is None or tier.trace_log is None:
        return
    writes = tier.trace_log.writes_of(seq.page_hashes, since)
    if not writes:
        return
    landed = [w for w in writes if w[1] is not None]
    end = max((w[1] for w in landed), default=max(w[0] for w in writes))
    trace.record(n.WRITE_BACK, min(w[0] for w in writes), end, {
        n.TIER: "host", n.PAGES: len(writes), n.BYTES: len(writes) * tier.page_bytes,
        "kvbus.hicache.pages_landed": len(landed), "kvbus.hicache.write_policy": worker.config.hicache_write_policy})
