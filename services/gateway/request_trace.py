"""The gateway's part of a request's trace: the root span's story and the stages the gateway runs.

The root span is the bus's server span of ``kvbus.v1.generate(.once)`` or the HTTP API's request
span (services/gateway/http.py); :class:`GatewayTrace` puts on it the request's GenAI attributes as it
starts (operation, model, sampling), and as it ends its usage, finish reasons, TTFT and TPOT, the
``stream_out`` span (first chunk out to the last) and, on failure, the kvbus error code. The
pipeline's stages (``tokenize`` / ``chat_template``, ``route``, one ``worker`` span per attempt and a
``migration`` span when a worker died) hang under it through :meth:`GatewayTrace.stage` and friends.

All of it costs nothing when the request is not traced (the trace is ``NO_TRACE``).
"""

from __future__ import annotations

import time

from bus.errors import BusError
from bus.tracing import NO_TRACE, RequestTrace
from bus.tracing import names as n
from schemas.generate import GenerateRequest
from schemas.worker import RouteReply, TokenChunk


def request_attributes(req: GenerateRequest, *, request_id: str, endpoint: str, is_streamed: bool) -> dict:
    """The GenAI semantic conventions' request attributes (and kvbus's) of ``req``."""
    s = req.sampling
    return {
        n.OPERATION_NAME: "chat" if req.messages is not None else "text_completion",
        n.PROVIDER_NAME: n.PROVIDER, n.REQUEST_MAX_TOKENS: s.max_tokens, n.REQUEST_TEMPERATURE: s.temperature,
        n.REQUEST_TOP_P: s.top_p, n.REQUEST_TOP_K: s.top_k or None, n.REQUEST_SEED: s.seed,
        n.REQUEST_STOP_SEQUENCES: list(s.stop) or None,
        n.REQUEST_PRESENCE_PENALTY: s.presence_penalty or None,
        n.REQUEST_FREQUENCY_PENALTY: s.frequency_penalty or None,
        n.REQUEST_CHOICE_COUNT: s.n if s.n != 1 else None, n.REQUEST_STREAM: is_streamed,
        n.CONVERSATION_ID: req.session_id, n.RESPONSE_ID: request_id, n.ENDPOINT: endpoint,
        n.REQUEST_MODEL: req.model,
    }


class GatewayTrace:
    """One request's root span at the gateway, and what it learns as the chunks pass."""

    def __init__(self, trace: RequestTrace, req: GenerateRequest, *, request_id: str, endpoint: str,
                 started: float, is_streamed: bool = True):
        self.trace = trace
        self.started = started
        self.first_chunk_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.usage_by_choice: dict = {}
        self.finish_by_choice: dict[int, str] = {}
        if trace.is_recording:
            trace.set(request_attributes(req, request_id=request_id, endpoint=endpoint, is_streamed=is_streamed))

    @property
    def is_recording(self) -> bool:
        return self.trace.is_recording

    def set_model(self, model: str) -> None:
        """The model served (the request's model, when it names one, is the same: else it was refused)."""
        self.trace.set({n.REQUEST_MODEL: model, n.RESPONSE_MODEL: model})

    def tokenizer_stage(self, kind: str):
        """``tokenize`` (a prompt) or ``chat_template`` (messages) around the tokenizer call."""
        return self.trace.stage(n.CHAT_TEMPLATE if kind == "chat" else n.TOKENIZE)

    def chunk(self, index: int, chunk: TokenChunk, now: float) -> None:
        """A chunk of choice ``index`` is going out."""
        if not self.trace.is_recording:
            return
        if self.first_chunk_at is None:
            self.first_chunk_at = now
        if chunk.token_ids:
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
        if chunk.usage is not None:
            self.usage_by_choice[index] = chunk.usage
        if chunk.finish_reason is not None:
            self.finish_by_choice[index] = chunk.finish_reason

    def finish(self, error: BusError | None) -> None:
        """The last chunk left (or the request failed): usage, finish reasons, TTFT and TPOT."""
        trace = self.trace
        if not trace.is_recording:
            return
        now = time.monotonic()
        usages = [self.usage_by_choice[i] for i in sorted(self.usage_by_choice)]
        attrs: dict = {}
        if usages:
            attrs[n.USAGE_INPUT_TOKENS] = usages[0].prompt_tokens
            attrs[n.USAGE_CACHE_READ_INPUT_TOKENS] = usages[0].cached_prompt_tokens
            attrs[n.USAGE_OUTPUT_TOKENS] = sum(u.completion_tokens for u in usages)
            drafted = sum(u.draft_tokens for u in usages)
            if drafted:
                attrs[n.DRAFTED_TOKENS] = drafted
                attrs[n.ACCEPTED_TOKENS] = sum(u.accepted_draft_tokens for u in usages)
        if self.finish_by_choice:
            attrs[n.RESPONSE_FINISH_REASONS] = [self.finish_by_choice[i] for i in sorted(self.finish_by_choice)]
        if self.first_token_at is not None:
            ttft = self.first_token_at - self.started
            attrs[n.TTFT_S] = round(ttft, 6)
            attrs[n.RESPONSE_TIME_TO_FIRST_CHUNK] = round(ttft, 6)
            num_output = sum(u.completion_tokens for u in usages[:1])  # (per choice: choice 0's pace)
            if num_output > 1 and self.last_token_at is not None:
                attrs[n.TPOT_S] = round((self.last_token_at - self.first_token_at) / (num_output - 1), 6)
        trace.set(attrs)
        if self.first_chunk_at is not None:
            trace.record(n.STREAM_OUT, self.first_chunk_at, now)
        if error is not None:
            if error.code.value == "cancelled":
                trace.set({"kvbus.cancelled": True})
            else:
                trace.error(error.code.value, error.message)


class AttemptTrace:
    """One stream's attempts: each one's ``route`` stage and ``worker`` span (route to last chunk), and
    the ``migration`` span from a dead worker's failure to the next worker's first chunk."""

    def __init__(self, trace: RequestTrace):
        self.trace = trace
        self.worker: RequestTrace = NO_TRACE
        self.migrating_since: float | None = None
        self.migration: dict = {}

    def route_stage(self, attempt: int, excluded: list[str]):
        return self.trace.stage(n.ROUTE, {n.ATTEMPT: attempt, "kvbus.route.excluded": list(excluded) or None})

    def routed(self, stage: RequestTrace, route: RouteReply) -> None:
        stage.set({n.DECODE_WORKER: route.decode_worker_id, n.PREFILL_WORKER: route.prefill_worker_id,
                   n.ROUTE_POLICY: route.policy, n.ROUTE_REASON: route.reason,
                   n.PREDICTED_CACHED_TOKENS: route.num_cached_tokens})

    def open_worker(self, attempt: int, route: RouteReply, num_tokens_before: int) -> RequestTrace:
        """The attempt's span on ``route``'s workers (the worker stream opened while it is activated
        joins it); ended by :meth:`ended`."""
        self.worker = self.trace.open(n.WORKER, {
            n.ATTEMPT: attempt, n.DECODE_WORKER: route.decode_worker_id, n.PREFILL_WORKER: route.prefill_worker_id,
            n.TOKENS_SO_FAR: num_tokens_before or None})
        return self.worker

    def first_chunk(self, to_worker: str) -> None:
        """A chunk of this attempt arrived: a migration in progress is complete."""
        if self.migrating_since is not None:
            self.trace.record(n.MIGRATION, self.migrating_since, time.monotonic(),
                              {**self.migration, n.TO_WORKER: to_worker})
            self.migrating_since = None

    def failed(self, exc: BaseException) -> None:
        """The attempt failed (its worker, a timeout, the caller gone): its span ends now."""
        self.worker.fail(exc)
        self.ended()

    def migrating(self, exc: BusError, *, from_worker: str, num_tokens: int) -> None:
        """The stream goes on on another worker: the migration starts now."""
        self.migrating_since = time.monotonic()
        self.migration = {n.FROM_WORKER: from_worker, n.TOKENS_SO_FAR: num_tokens,
                          "kvbus.migration.reason": exc.message[:200]}

    def ended(self) -> None:
        worker, self.worker = self.worker, NO_TRACE
        worker.end()
