"""One generation through the services: validate, tokenize, route, stream from the worker.

NATS handlers and the HTTP API both run requests through :class:`GenerationPipeline`,
so limits, retries and metrics are the same on every entry point.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from bus import Bus, BusError, Cancelled, Internal, InvalidArgument, Overloaded, Timeout, Unavailable
from bus.core import REQUEST_ID_HEADER
from bus.errors import HTTP_STATUS, ErrorCode
from bus.subjects import HEALTH, ROUTE, TOKENIZER_CHAT, TOKENIZER_DECODE, TOKENIZER_ENCODE, TOKENIZER_INFO, \
    WORKER_GENERATE
from schemas.common import HealthReply, HealthRequest
from schemas.engine import TokenLogprob, Usage
from schemas.generate import GenerateChunk, GenerateReply, GenerateRequest
from schemas.tokenizer import ChatTemplateRequest, DecodeRequest, EncodeRequest, TokenizerInfoReply, \
    TokenizerInfoRequest
from schemas.worker import RouteRequest, TokenChunk, WorkerGenerateRequest
from services.gateway.config import GatewayConfig
from services.gateway.metrics import GatewayMetrics
from services.gateway.validation import check_before_work

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 2
"""A worker that is unavailable before it streamed anything gets one retry elsewhere."""


class PromptTooLong(InvalidArgument):
    """The prompt (plus max_tokens) does not fit the context length (OpenAI: context_length_exceeded)."""


class UnknownModel(InvalidArgument):
    """The request names a model this gateway does not serve (OpenAI: model_not_found)."""


class GenerationPipeline:
    def __init__(self, bus: Bus, config: GatewayConfig, metrics: GatewayMetrics):
        self.bus = bus
        self.config = config
        self.metrics = metrics
        self.num_inflight = 0
        self._info: TokenizerInfoReply | None = None
        self._info_lock = asyncio.Lock()
        self._token_texts: dict[int, str] = {}

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
    async def prompt_token_ids(self, req: GenerateRequest) -> list[int]:
        """Check the request and return the prompt as token ids; raises InvalidArgument."""
        check_before_work(req, await self.context_length())  # limits before any tokenizer work
        served = await self.model_name()
        if req.model is not None and req.model != served:
            raise UnknownModel(f"model {req.model!r} is not served here; this gateway serves {served!r}")
        info = await self.info()
        timeout = self.config.call_timeout
        if req.prompt is not None:
            ids = (await self.bus.request(TOKENIZER_ENCODE, EncodeRequest(text=req.prompt), timeout=timeout)).ids
        elif req.messages is not None:
            if not info.has_chat_template:
                raise InvalidArgument(f"model {served} has no chat template; send a plain prompt instead")
            ids = (await self.bus.request(TOKENIZER_CHAT, ChatTemplateRequest(messages=req.messages),
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
    async def generate(self, req: GenerateRequest, *, request_id: str, endpoint: str) -> AsyncIterator[GenerateChunk]:
        """Stream the generation; every way out is counted in the metrics under ``endpoint``."""
        if self.num_inflight >= self.config.max_concurrent_requests:
            self.metrics.observe_request(endpoint, HTTP_STATUS[ErrorCode.OVERLOADED], ErrorCode.OVERLOADED.value)
            raise Overloaded(f"the gateway is at max_concurrent_requests={self.config.max_concurrent_requests}")
        self.num_inflight += 1
        started = time.monotonic()
        error: BusError | None = None
        try:
            prompt_ids = await self.prompt_token_ids(req)
            timings = {"tokenize_s": time.monotonic() - started}
            last = None
            async for chunk in self._stream_from_worker(req, prompt_ids, request_id, started, timings):
                now = time.monotonic()
                if chunk.token_ids:
                    if last is None:
                        self.metrics.ttft.observe(now - started)
                    else:
                        self.metrics.itl.observe((now - last) / len(chunk.token_ids))
                    last = now
                    self.metrics.generation_tokens.inc(len(chunk.token_ids))
                if chunk.usage is not None:
                    self.metrics.observe_usage(chunk.usage)
                    self.metrics.e2e.observe(now - started)
                yield GenerateChunk(text=chunk.text, token_ids=chunk.token_ids if req.include_token_ids else [],
                                    finish_reason=chunk.finish_reason, usage=chunk.usage, logprobs=chunk.logprobs,
                                    timings={**timings, **chunk.timings} if chunk.timings else None)
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
            if error is None:
                self.metrics.observe_request(endpoint, 200)
            else:
                self.metrics.observe_request(endpoint, HTTP_STATUS[error.code], error.code.value)

    async def generate_once(self, req: GenerateRequest, *, request_id: str, endpoint: str) -> GenerateReply:
        """The whole generation as one reply."""
        texts: list[str] = []
        token_ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        finish_reason, usage = None, None
        async for chunk in self.generate(req, request_id=request_id, endpoint=endpoint):
            texts.append(chunk.text)
            token_ids.extend(chunk.token_ids)
            logprobs.extend(chunk.logprobs or ())
            finish_reason = chunk.finish_reason or finish_reason
            usage = chunk.usage or usage
        if finish_reason is None:
            raise Internal(f"the worker's stream ended without a finish reason (request id {request_id})")
        if usage is None:
            usage = Usage(prompt_tokens=0, cached_prompt_tokens=0, completion_tokens=len(token_ids))
        return GenerateReply(text="".join(texts), token_ids=token_ids, finish_reason=finish_reason, usage=usage,
                             logprobs=logprobs if req.sampling.logprobs is not None else None)

    async def _stream_from_worker(self, req: GenerateRequest, prompt_ids: list[int], request_id: str,
                                  started: float, timings: dict[str, float]) -> AsyncIterator[TokenChunk]:
        deadline = started + self.config.generate_timeout
        excluded: list[str] = []
        for attempt in range(MAX_ATTEMPTS):
            t_route = time.monotonic()
            route = await self.bus.request(
                ROUTE, RouteRequest(request_id=request_id, prompt_token_ids=prompt_ids, session_id=req.session_id,
                                    exclude_worker_ids=excluded),
                timeout=self.config.call_timeout)
            timings["route_s"] = time.monotonic() - t_route
            # One id per attempt (the worker's engine and the bus's cancel both key on it), distinct from
            # the caller's: a caller's cancel reaches the worker only through this gateway closing the stream.
            worker_request_id = f"{request_id}-{attempt}"
            message = WorkerGenerateRequest(request_id=worker_request_id, prompt_token_ids=prompt_ids,
                                            sampling=req.sampling, prefill_worker_id=route.prefill_worker_id,
                                            stream_interval=req.stream_interval,
                                            prefill_host_id=route.prefill_host_id)
            num_chunks = 0
            try:
                # Leaving this block early (error, timeout, our caller cancelled or closed us) closes
                # the stream, which publishes a CancelEvent: the worker aborts and frees its pages.
                async with self.bus.stream(WORKER_GENERATE, message, timeout=self.config.stream_stall_timeout,
                                           headers={REQUEST_ID_HEADER: worker_request_id},
                                           worker_id=route.decode_worker_id) as chunks:
                    while True:
                        remaining = deadline - time.monotonic()
                        try:
                            # NOTE: the timeout wraps one await, never a yield of this generator.
                            async with asyncio.timeout(max(remaining, 0.0)):
                                chunk = await chunks.__anext__()
                        except StopAsyncIteration:
                            return
                        except TimeoutError as exc:
                            if isinstance(exc, BusError):  # the stall timeout of the stream itself
                                raise
                            raise Timeout(f"request {request_id} exceeded generate_timeout="
                                          f"{self.config.generate_timeout:g}s") from None
                        num_chunks += 1
                        yield chunk
            except Unavailable as exc:
                if num_chunks or attempt + 1 == MAX_ATTEMPTS:
                    raise
                log.warning("worker %s unavailable for %s (%s); retrying on another worker",
                            route.decode_worker_id, request_id, exc.message)
                excluded.append(route.decode_worker_id)
