"""One generation through the services: validate, tokenize, then stream from the workers
(``worker_stream.py``: route, stream, retry, migrate) while counting and tracing.

NATS handlers and the HTTP API both run requests through :class:`GenerationPipeline`,
so limits, retries and metrics are the same on every entry point.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from bus import Bus, BusError, Cancelled, Internal, InvalidArgument, Overloaded
from bus.errors import HTTP_STATUS, ErrorCode
from bus.tracing import NO_TRACE, RequestTrace
from bus.tracing import names as trace_names
from bus.subjects import HEALTH, TOKENIZER_CHAT, TOKENIZER_DECODE, TOKENIZER_ENCODE, TOKENIZER_INFO
from schemas.common import HealthReply, HealthRequest
from schemas.generate import GenerateChunk, GenerateReply, GenerateRequest
from schemas.tokenizer import ChatTemplateRequest, DecodeRequest, EncodeRequest, TokenizerInfoReply, \
    TokenizerInfoRequest
from schemas.worker import TokenChunk
from services.agent.tools import BadField
from services.gateway import agent_request, choices
from services.gateway.config import GatewayConfig
from services.gateway.metrics import GatewayMetrics
from services.gateway.request_trace import GatewayTrace
from services.gateway.validation import check_before_work
from services.gateway.worker_stream import WorkerStreams
from services.liveness import WorkerLiveness

log = logging.getLogger(__name__)

class PromptTooLong(InvalidArgument):
    """The prompt (plus max_tokens) does not fit the context length (OpenAI: context_length_exceeded)."""


class UnknownModel(InvalidArgument):
    """The request names a model this gateway does not serve (OpenAI: model_not_found)."""


class GenerationPipeline:
    def __init__(self, bus: Bus, config: GatewayConfig, metrics: GatewayMetrics,
                 liveness: WorkerLiveness | None = None):
        self.bus = bus
        self.config = config
        self.metrics = metrics
        self.streams = WorkerStreams(bus, config, liveness)
        """Route, stream from the worker, retry and migrate (worker_stream.py)."""
        self.num_inflight = 0
        self._info: TokenizerInfoReply | None = None
        self._info_lock = asyncio.Lock()
        self._token_texts: dict[int, str] = {}

    @property
    def num_migrations(self) -> int:
        """Requests moved to another worker mid-generation (each move counts)."""
        return self.streams.num_migrations

    @property
    def num_migrations_failed(self) -> int:
        """Requests that ran out of max_migrations (or of workers) and ended unavailable."""
        return self.streams.num_migrations_failed

    # --- facts from the tokenizer (cached once known) -------------------------------------
    async def info(self) -> TokenizerInfoReply:
        if self._info is None:
            async with self._info_lock:
                if self._info is None:
                    self._info = await self.bus.request(TOKENIZER_INFO, TokenizerInfoRequest(),
                                                        timeout=self.config.call_timeout)
        return self._info

    async def model_name(self) -> str:
        return self.config.model_name or (await self.info()).model

    async def context_length(self) -> int:
        length = (await self.info()).context_length
        if self.config.max_model_len is not None:
            length = min(length, self.config.max_model_len) if length else self.config.max_model_len
        return length

    async def health_of(self, role: str) -> HealthReply | None:
        """The health reply of some ready replica of ``role``, or None when none answers ready."""
        try:
            reply = await self.bus.request(HEALTH, HealthRequest(), timeout=min(2.0, self.config.call_timeout),
                                           role=role)
        except BusError:
            return None
        return reply if reply.ready else None

    async def token_texts(self, token_ids: list[int]) -> dict[int, str]:
        """Each id's own text (special tokens included), for logprobs; cached per id."""
        missing = sorted({i for i in token_ids if i not in self._token_texts})
        if missing:
            replies = await asyncio.gather(*(
                self.bus.request(TOKENIZER_DECODE, DecodeRequest(ids=[i], skip_special_tokens=False),
                                 timeout=self.config.call_timeout) for i in missing))
            for i, reply in zip(missing, replies):
                self._token_texts[i] = reply.text
        return {i: self._token_texts[i] for i in token_ids}

    # --- validation and tokenization -------------------------------------------------------
    async def prompt_token_ids(self, req: GenerateRequest, trace: RequestTrace = NO_TRACE) -> list[int]:
        """Check the request and return the prompt as token ids; raises InvalidArgument. ``trace``: the
        request's, for the tokenizer's stage."""
        check_before_work(req, await self.context_length())  # limits before any tokenizer work
        served = await self.model_name()
        if req.model is not None and req.model != served:
            raise UnknownModel(f"model {req.model!r} is not served here; this gateway serves {served!r}")
        info = await self.info()
        bias = req.sampling.logit_bias
        if bias and max(bias) >= info.vocab_size:  # (the engine checks again against its model)
            raise BadField("logit_bias", f"logit_bias token ids must be in [0, {info.vocab_size}), got {max(bias)}")
        timeout = self.config.call_timeout
        if req.prompt is not None:
            with trace.stage(trace_names.TOKENIZE):
                ids = (await self.bus.request(TOKENIZER_ENCODE, EncodeRequest(text=req.prompt), timeout=timeout)).ids
        elif req.messages is not None:
            if not info.has_chat_template:
                raise InvalidArgument(f"model {served} has no chat template; send a plain prompt instead")
            extras = {k: v for k in ("tools", "chat_template_kwargs") if (v := getattr(req, k))}
            with trace.stage(trace_names.CHAT_TEMPLATE):
                ids = (await self.bus.request(TOKENIZER_CHAT, ChatTemplateRequest(messages=req.messages, **extras),
                                              timeout=timeout)).ids
        else:
            ids = list(req.prompt_token_ids)
            bad = [i for i in ids if not 0 <= i < info.vocab_size]
            if bad:
                raise InvalidArgument(f"prompt_token_ids must be in [0, {info.vocab_size}), got {bad[:8]}")
        if not ids:
            raise InvalidArgument("the prompt is empty")
        await self._check_length(len(ids), req.sampling.max_tokens)
        return ids

    async def _check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        limit = await self.context_length()
        if not limit:
            return
        if num_prompt_tokens >= limit:
            raise PromptTooLong(f"the prompt has {num_prompt_tokens} tokens; the context length is {limit} "
                                "(prompt plus at least one generated token must fit)")
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise PromptTooLong(f"the prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}: "
                                f"{num_prompt_tokens + max_tokens} exceeds the context length {limit}")

    # --- generation -------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest, *, request_id: str, endpoint: str,
                       deadline: float | None = None, trace: RequestTrace | None = None
                       ) -> AsyncIterator[GenerateChunk]:
        """Stream the generation; every way out is counted in the metrics under ``endpoint``, and told
        in the request's trace (``trace``, default: the span the current message is handled in).

        ``deadline`` (time.monotonic()) is when the caller stops waiting; the earliest of it,
        ``req.timeout_s`` and ``generate_timeout`` bounds the generation on every hop.
        """
        if self.num_inflight >= self.config.max_concurrent_requests:
            self.metrics.observe_request(endpoint, HTTP_STATUS[ErrorCode.OVERLOADED], ErrorCode.OVERLOADED.value)
            raise Overloaded(f"the gateway is at max_concurrent_requests={self.config.max_concurrent_requests}",
                             retry_after=1.0)
        self.num_inflight += 1
        started = time.monotonic()
        error: BusError | None = None
        gtrace = GatewayTrace(trace or RequestTrace.current(), req, request_id=request_id, endpoint=endpoint,
                              started=started)
        try:
            if req.timeout_s is not None and not req.timeout_s > 0:
                raise InvalidArgument(f"timeout_s must be > 0, got {req.timeout_s}")
            ends = [started + self.config.generate_timeout]
            ends += [deadline] if deadline is not None else []
            ends += [started + req.timeout_s] if req.timeout_s is not None else []
            req = agent_request.prepare(req, self.config)  # tools, structured output (docs/agents.md)
            parsers = [agent_request.parser_for(req, self.config) for _ in range(req.sampling.n)]
            prompt_ids = await self.prompt_token_ids(req, gtrace.trace)
            timings = {"tokenize_s": time.monotonic() - started}
            if gtrace.is_recording:
                gtrace.set_model(await self.model_name())
            first: dict[int, float] = {}
            last: dict[int, float] = {}
            num_finished = 0
            # closed here, not when collected: the workers' streams end with this generator
            async with contextlib.aclosing(self._choices(req, prompt_ids, request_id, min(ends), timings,
                                                         gtrace.trace)) as chunks:
                async for index, chunk in chunks:
                    now = time.monotonic()
                    gtrace.chunk(index, chunk, now)
                    if chunk.token_ids:
                        if index not in last:
                            first[index] = now
                            if len(first) == 1:
                                self.metrics.ttft.observe(now - started)
                        else:
                            self.metrics.itl.observe((now - last[index]) / len(chunk.token_ids))
                        last[index] = now
                        self.metrics.generation_tokens.inc(len(chunk.token_ids))
                    if chunk.usage is not None:
                        self.metrics.observe_usage(chunk.usage, now - first.get(index, now))
                        num_finished += 1
                        if num_finished == req.sampling.n:
                            self.metrics.e2e.observe(now - started)
                    out = GenerateChunk(text=chunk.text, token_ids=chunk.token_ids if req.include_token_ids else [],
                                        finish_reason=chunk.finish_reason, usage=chunk.usage, logprobs=chunk.logprobs,
                                        timings={**timings, **chunk.timings} if chunk.timings else None, index=index)
                    yield parsers[index].chunk(out) if parsers[index] is not None else out
        except BusError as exc:
            error = exc
            raise
        except (asyncio.CancelledError, GeneratorExit):
            error = Cancelled("the caller went away")
            raise
        except Exception:
            error = Internal(f"internal error (request id {request_id})")
            raise
        finally:
            self.num_inflight -= 1
            gtrace.finish(error)
            if error is None:
                self.metrics.observe_request(endpoint, 200)
            else:
                self.metrics.observe_request(endpoint, HTTP_STATUS[error.code], error.code.value)

    async def generate_once(self, req: GenerateRequest, *, request_id: str, endpoint: str,
                            deadline: float | None = None) -> GenerateReply:
        """The whole generation as one reply (one choice: n > 1 streams, or HTTP's ``generate_choices``)."""
        if req.sampling.n > 1:
            raise BadField("sampling.n", "sampling.n > 1 needs a stream: use kvbus.v1.generate, whose chunks carry "
                                         "their choice's index")
        return (await self.generate_choices(req, request_id=request_id, endpoint=endpoint, deadline=deadline))[0]

    async def generate_choices(self, req: GenerateRequest, *, request_id: str, endpoint: str,
                               deadline: float | None = None, trace: RequestTrace | None = None
                               ) -> list[GenerateReply]:
        """The whole generation as one reply per choice (``sampling.n`` of them)."""
        return await choices.replies(self.generate(req, request_id=request_id, endpoint=endpoint, deadline=deadline,
                                                   trace=trace), req, request_id)

    def _choices(self, req: GenerateRequest, prompt_ids: list[int], request_id: str, deadline: float,
                 timings: dict[str, float], trace: RequestTrace = NO_TRACE) -> AsyncIterator[tuple[int, TokenChunk]]:
        """(choice index, chunk): one stream, or ``sampling.n`` of them sharing the prompt (choices.py)."""
        if req.sampling.n == 1:
            return _indexed(self.streams.stream(req, prompt_ids, request_id, deadline, timings, trace=trace))
        return choices.stream_choices(req.sampling.n, lambda i, route: self.streams.stream(
            choices.choice_request(req, i), prompt_ids, f"{request_id}.{i}", deadline, timings if i == 0 else {},
            route_hint=route, trace=trace))

async def _indexed(chunks: AsyncIterator[TokenChunk]) -> AsyncIterator[tuple[int, TokenChunk]]:
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            yield 0, chunk
