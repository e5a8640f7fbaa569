"""Per-request timelines kept on the engine thread, from which a worker records the request's spans.

The engine thread must not call OpenTelemetry per step or per token: that would be the step's own
time. A worker that records a request's trace registers a :class:`RequestTimeline` for it
(:meth:`Timelines.track`) before it submits the request; after every step the engine thread
(engine_thread.py) hands the step to :meth:`Timelines.after_step`, which updates the timelines of the
tracked requests in that step's batch with a few integer and float stores and, every
``event_every`` decode steps, appends one summary tuple. The worker's asyncio side reads the timeline
once the request finished and turns it into spans with explicit start and end times
(services/workers/trace_spans.py).

Nothing here runs for a worker that does not trace (it makes no Timelines), nor for a step with no
tracked request in it. A tracked request's detokenizer is wrapped to time it (two clock reads a
token, for traced requests only).
"""

from __future__ import annotations

import time

STEP_EVENT_EVERY = 16
"""Decode steps summarised by one span event (its batch sizes, tokens and drafts so far)."""


class RequestTimeline:
    """What the engine thread saw of one request, in ``time.monotonic()`` seconds (None: never)."""

    __slots__ = (
        "request_id", "tracked_at", "seq", "arrived_at", "admitted_at", "loading_from", "loaded_at",
        "prefill_from", "prefill_end", "num_prefill_steps", "num_prefill_tokens", "first_decode_at",
        "last_step_end", "num_decode_steps", "num_verify_steps", "batch_min", "batch_max", "batch_sum",
        "window_from", "window_steps", "window_batch_sum", "events", "detok_seconds", "num_detok_calls",
        "kv_arrived_at",
    )

    def __init__(self, request_id: str, tracked_at: float):
        self.request_id = request_id
        self.tracked_at = tracked_at
        self.seq = None
        """The engine's Sequence, from the first step it was in (read its counters once it finished)."""
        self.arrived_at: float | None = None
        self.admitted_at: float | None = None
        """Start of the step that first scheduled it, or put it in ``loading`` (queue wait ends)."""
        self.loading_from: float | None = None
        self.loaded_at: float | None = None
        """A lower tier's copies into its pages (asynchronous load-back): from admission to the step that ran it."""
        self.prefill_from: float | None = None
        self.prefill_end: float | None = None
        self.num_prefill_steps = 0
        self.num_prefill_tokens = 0
        """Prompt tokens computed here (chunks of every prefill step, recomputations after preemption included)."""
        self.first_decode_at: float | None = None
        self.last_step_end: float | None = None
        self.num_decode_steps = 0
        self.num_verify_steps = 0
        self.batch_min = 0
        self.batch_max = 0
        self.batch_sum = 0
        self.window_from = 0.0
        self.window_steps = 0
        self.window_batch_sum = 0
        self.events: list[tuple] = []
        """Every ``event_every`` decode steps: (end, decode steps, output tokens, mean batch size of the
        window, window seconds, drafted tokens, accepted tokens)."""
        self.detok_seconds = 0.0
        self.num_detok_calls = 0
        self.kv_arrived_at: float | None = None
        """A decode worker's imported request: when its pages came from the prefill worker (set by the worker)."""

    def seen(self, seq) -> None:
        """First step with ``seq`` in it: remember it, and time its detokenizer from now on."""
        self.seq = seq
        self.arrived_at = seq.arrival_time
        if seq.detok is not None and not isinstance(seq.detok, TimedDetokenizer):
            seq.detok = TimedDetokenizer(seq.detok, self)

    def on_step(self, seq, start: float, end: float, batch_size: int, is_decode: bool, num_new_tokens: int,
                event_every: int) -> None:
        if self.seq is None:
            self.seen(seq)
        if self.admitted_at is None:
            self.admitted_at = start
        if self.loading_from is not None and self.loaded_at is None:
            self.loaded_at = start
        self.last_step_end = end
        if not is_decode:
            if self.prefill_from is None:
                self.prefill_from = start
            self.prefill_end = end
            self.num_prefill_steps += 1
            self.num_prefill_tokens += num_new_tokens
            return
        if self.first_decode_at is None:
            self.first_decode_at = self.window_from = start
            self.batch_min = batch_size
        self.num_decode_steps += 1
        self.num_verify_steps += num_new_tokens > 1
        self.batch_sum += batch_size
        self.batch_min = min(self.batch_min, batch_size)
        self.batch_max = max(self.batch_max, batch_size)
        self.window_steps += 1
        self.window_batch_sum += batch_size
        if self.window_steps >= event_every:
            self.events.append((end, self.num_decode_steps, seq.num_output_tokens,
                                self.window_batch_sum / self.window_steps, end - self.window_from,
                                seq.num_drafted_tokens, seq.num_accepted_tokens))
            self.window_from, self.window_steps, self.window_batch_sum = end, 0, 0

    def on_loading(self, seq, start: float) -> None:
        """Admitted this step into ``loading`` (its pages copied from a lower tier meanwhile)."""
        if self.seq is None:
            self.seen(seq)
        if self.loading_from is None:
            self.loading_from = start
            if self.admitted_at is None:
                self.admitted_at = start


class TimedDetokenizer:
    """A tracked request's detokenizer, timed (the engine calls ``add`` per token and ``take`` per output)."""

    __slots__ = ("inner", "timeline")

    def __init__(self, inner, timeline: RequestTimeline):
        self.inner = inner
        self.timeline = timeline

    def add(self, token_id: int) -> bool:
        t0 = time.perf_counter()
        try:
            return self.inner.add(token_id)
        finally:
            self.timeline.detok_seconds += time.perf_counter() - t0
            self.timeline.num_detok_calls += 1

    def take(self, finished: bool) -> str:
        t0 = time.perf_counter()
        try:
            return self.inner.take(finished)
        finally:
            self.timeline.detok_seconds += time.perf_counter() - t0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class Timelines:
    """The tracked requests of one engine, by request id (tracked from the event loop, updated on the
    engine thread: dict reads and writes of single keys, safe under the GIL)."""

    def __init__(self, event_every: int = STEP_EVENT_EVERY):
        if event_every < 1:
            raise ValueError(f"event_every must be >= 1, got {event_every}")
        self.event_every = event_every
        self._by_id: dict[str, RequestTimeline] = {}

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def track(self, request_id: str) -> RequestTimeline:
        timeline = self._by_id[request_id] = RequestTimeline(request_id, time.monotonic())
        return timeline

    def get(self, request_id: str) -> RequestTimeline | None:
        return self._by_id.get(request_id)

    def untrack(self, request_id: str) -> None:
        self._by_id.pop(request_id, None)

    def after_step(self, engine, start: float, end: float) -> None:
        """On the engine thread, after a step from ``start`` to ``end``: the tracked requests it ran."""
        by_id = self._by_id
        if not by_id:
            return
        batch = engine.last_batch
        if batch is not None and batch.seqs:
            size, num_decode, every = len(batch.seqs), batch.num_decode, self.event_every
            for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
                timeline = by_id.get(seq.request_id)
                if timeline is not None:
                    # a one-row "prefill" of a sequence that had output before is an imported request's
                    # first step (its pages written, its first token's row computed): a decode step
                    is_decode = i < num_decode or (n == 1 and seq.num_output_tokens > 1)
                    timeline.on_step(seq, start, end, size, is_decode, n, every)
        for seq in engine.scheduler.loading:
            timeline = by_id.get(seq.request_id)
            if timeline is not None:
                timeline.on_loading(seq, start)
