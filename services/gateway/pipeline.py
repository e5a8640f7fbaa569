"""One generation through the services: validate, tokenize, route, stream from the worker.

NATS handlers and the HTTP API both run requests through :class:`GenerationPipeline`,
so limits, retries and metrics are the same on every entry point.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator

import msgspec

from bus import Bus, BusError, Cancelled, Internal, InvalidArgument, Overloaded, Timeout, Unavailable
from bus.core import REQUEST_ID_HEADER, StreamBroken
from bus.errors import HTTP_STATUS, ErrorCode
from bus.tracing import NO_TRACE, RequestTrace
from bus.tracing import names as trace_names
from bus.subjects import HEALTH, ROUTE, TOKENIZER_CHAT, TOKENIZER_DECODE, TOKENIZER_ENCODE, TOKENIZER_INFO, \
    WORKER_GENERATE
from schemas.common import HealthReply, HealthRequest
from schemas.engine import Usage
from schemas.generate import GenerateChunk, GenerateReply, GenerateRequest
from schemas.tokenizer import ChatTemplateRequest, DecodeRequest, EncodeRequest, TokenizerInfoReply, \
    TokenizerInfoRequest
from schemas.worker import RouteRequest, TokenChunk, WorkerGenerateRequest
from services.agent.tools import BadField
from services.gateway import agent_request, choices
from services.gateway.config import GatewayConfig
from services.gateway.metrics import GatewayMetrics
from services.gateway.request_trace import AttemptTrace, GatewayTrace
from services.gateway.stop_span import HeldText
from services.gateway.validation import check_before_work
from services.liveness import WorkerDied, WorkerLiveness

log = logging.getLogger(__name__)

MAX_RETRIES = 1
"""A worker that answers unavailable before it streamed anything is retried once elsewhere (a dead
worker, known from its heartbeats, is a migration instead: GatewayConfig.max_migrations)."""


DEADLINE_GRACE_S = 1.0
"""The worker's bus cancels a generation this long after the gateway's deadline: the gateway ends the
caller's request itself, the worker's own expiry only matters when the gateway is gone."""


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
        self.liveness = liveness
        """Heartbeat watch: a stream from a worker that died ends at once (then migrates)."""
        self.num_inflight = 0
        self.num_migrations = 0
        """Requests moved to another worker mid-generation (each move counts)."""
        self.num_migrations_failed = 0
        """Requests that ran out of max_migrations (or of workers) and ended unavailable."""
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
            async for index, chunk in self._choices(req, prompt_ids, request_id, min(ends), timings, gtrace.trace):
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
            return _indexed(self._stream_from_worker(req, prompt_ids, request_id, deadline, timings, trace=trace))
        return choices.stream_choices(req.sampling.n, lambda i, route: self._stream_from_worker(
            choices.choice_request(req, i), prompt_ids, f"{request_id}.{i}", deadline, timings if i == 0 else {},
            route_hint=route, trace=trace))

    async def _stream_from_worker(self, req: GenerateRequest, prompt_ids: list[int], request_id: str,
                                  deadline: float, timings: dict[str, float],
                                  route_hint: list | None = None, trace: RequestTrace = NO_TRACE
                                  ) -> AsyncIterator[TokenChunk]:
        """The worker's chunks; a worker that dies mid-stream is replaced, the stream goes on.

        ``route_hint`` (n choices): the first attempt goes where its first route does, or, empty, its
        route is put there for the other choices.

        Migration: the next worker gets the prompt plus every token already streamed, and
        ``max_tokens`` (``min_tokens``) less those, so the caller's stream continues with no gap and
        no repeat; ``num_prior_output_tokens`` tells it which prompt tokens are output, so the grammar,
        the output penalties and seeded draws go on where they were (greedy and seeded output is the
        undisturbed one). Usage is reported as if one worker did it all.
        """
        excluded: list[str] = []
        generated: list[int] = []
        emitted: list[str] = []
        pending_text = ""
        num_retries = num_migrations = 0
        attempts = AttemptTrace(trace)  # the route, worker and migration spans of each attempt
        for attempt in itertools.count():
            t_route = time.monotonic()
            if attempt == 0 and route_hint:
                route = route_hint[0]
            else:
                with attempts.route_stage(attempt, excluded) as route_stage:
                    route = await self.bus.request(
                        ROUTE, RouteRequest(request_id=request_id, prompt_token_ids=prompt_ids + generated,
                                            session_id=req.session_id, exclude_worker_ids=excluded),
                        timeout=min(self.config.call_timeout, max(deadline - t_route, 0.001)))
                    attempts.routed(route_stage, route)
                if attempt == 0 and route_hint is not None:
                    route_hint.append(route)
            if attempt == 0:
                timings["route_s"] = time.monotonic() - t_route
            worker_id = route.decode_worker_id
            message = self._worker_request(req, prompt_ids, generated, route, f"{request_id}-{attempt}", deadline)
            num_before = len(generated)
            # a migrated stream: the text the dead worker held back goes in front, and a stop string
            # begun in it may end in the new worker's text (stop_span.py)
            held = HeldText(pending_text, req.sampling.stop) if num_before else None
            worker_span = attempts.open_worker(attempt, route, num_before)
            try:
                async for chunk in self._chunks_from(worker_id, message, request_id, deadline, worker_span):
                    attempts.first_chunk(worker_id)
                    if held is not None:  # count as if one worker did it all
                        out, ends = held.feed(_continued(chunk, num_before, ""))
                    else:
                        out, ends = [chunk], chunk.finish_reason is not None
                    for c in out:
                        if held is not None and held.stop_end is not None:  # stopped across the migration
                            c = await self._stopped_across(req, len(prompt_ids), generated, "".join(emitted), c,
                                                           held.stop_end)
                        generated += c.token_ids
                        emitted.append(c.text)
                        yield c
                    if ends:
                        return
                return
            except Unavailable as exc:
                attempts.failed(exc)
                died = isinstance(exc, WorkerDied)
                broken = isinstance(exc, StreamBroken)  # the connection lost chunks; the worker may be fine
                if not broken:
                    excluded.append(worker_id)
                if not generated and not died and num_retries < MAX_RETRIES:
                    num_retries += 1
                    log.warning("worker %s unavailable for %s (%s); retrying on another worker",
                                worker_id, request_id, exc.message)
                    continue
                if not generated and not died and not broken:
                    raise
                if num_migrations >= self.config.max_migrations:
                    self.num_migrations_failed += 1
                    raise Unavailable(f"request {request_id}: worker {worker_id} failed ({exc.message}) after "
                                      f"{num_migrations} migrations (max_migrations="
                                      f"{self.config.max_migrations})", request_id=request_id) from None
                num_migrations += 1
                self.num_migrations += 1
                attempts.migrating(exc, from_worker=worker_id, num_tokens=len(generated))
                log.warning("worker %s failed for %s after %d tokens (%s); migrating (%d/%d)", worker_id,
                            request_id, len(generated), exc.message, num_migrations, self.config.max_migrations)
                if generated:
                    pending_text = await self._missing_text(req, generated, "".join(emitted))
            except BaseException as exc:  # a timeout, the caller gone, a bug: the attempt's span says so
                attempts.failed(exc)
                raise
            finally:
                attempts.ended()

    def _worker_request(self, req: GenerateRequest, prompt_ids: list[int], generated: list[int], route,
                        worker_request_id: str, deadline: float) -> WorkerGenerateRequest:
        sampling = req.sampling
        if generated:  # the new worker continues the output: it knows which prompt tokens are output
            sampling = msgspec.structs.replace(
                sampling, num_prior_output_tokens=sampling.num_prior_output_tokens + len(generated),
                min_tokens=max(0, sampling.min_tokens - len(generated)),
                max_tokens=None if sampling.max_tokens is None else max(1, sampling.max_tokens - len(generated)))
        return WorkerGenerateRequest(request_id=worker_request_id, prompt_token_ids=prompt_ids + generated,
                                     sampling=sampling, prefill_worker_id=route.prefill_worker_id,
                                     stream_interval=req.stream_interval, prefill_host_id=route.prefill_host_id,
                                     deadline_s=max(deadline - time.monotonic(), 0.0))

    async def _chunks_from(self, worker_id: str, message: WorkerGenerateRequest, request_id: str,
                           deadline: float, attempt: RequestTrace = NO_TRACE) -> AsyncIterator[TokenChunk]:
        # One id per attempt (the worker's engine and the bus's cancel both key on it), distinct from
        # the caller's: a caller's cancel reaches the worker only through this gateway closing the stream.
        # Leaving this block early (error, timeout, our caller cancelled or closed us) closes the
        # stream, which publishes a CancelEvent: the worker aborts and frees its pages.
        with attempt.activated():  # the worker's spans hang under the attempt's
            stream = self.bus.stream(WORKER_GENERATE, message, timeout=self.config.stream_stall_timeout,
                                     headers={REQUEST_ID_HEADER: message.request_id},
                                     deadline=message.deadline_s + DEADLINE_GRACE_S, worker_id=worker_id)
        async with stream as chunks:
            dead = self.liveness.watch(worker_id) if self.liveness is not None else None
            if dead is not None:
                dead.add_done_callback(lambda f: f.cancelled() or chunks.abort(WorkerDied(
                    f"worker {worker_id} sent no heartbeat for {self.config.worker_ttl:g}s", request_id=request_id)))
            try:
                while True:
                    remaining = deadline - time.monotonic()
                    try:
                        # NOTE: the timeout wraps one await, never a yield of this generator.
                        async with asyncio.timeout(max(remaining, 0.0)):
                            chunk = await chunks.__anext__()
                    except StopAsyncIteration:
                        return
                    except TimeoutError as exc:
                        if isinstance(exc, BusError) and time.monotonic() < deadline:
                            raise  # the stall timeout of the stream itself
                        raise Timeout(f"request {request_id} exceeded generate_timeout="
                                      f"{self.config.generate_timeout:g}s or the caller's deadline") from None
                    yield chunk
            finally:
                if dead is not None:
                    dead.cancel()

    async def _stopped_across(self, req: GenerateRequest, prompt_len: int, generated: list[int], emitted: str,
                              chunk: TokenChunk, stop_end: int) -> TokenChunk:
        """The last chunk of a stream stopped by a stop string across a migration: its tokens up to
        the one whose decoded text completes the stop string, as one worker would have sent them
        (a chunk's text can lag its tokens, so the chunk boundary alone may keep a few too many)."""
        ids = chunk.token_ids
        n = len(ids)
        for i in range(1, len(ids)):
            try:
                reply = await self.bus.request(
                    TOKENIZER_DECODE,
                    DecodeRequest(ids=generated + ids[:i], skip_special_tokens=req.sampling.skip_special_tokens),
                    timeout=self.config.call_timeout)
            except BusError:
                break  # keep the chunk whole: a few tokens too many, never text past the stop
            if len(reply.text) >= len(emitted) + stop_end:
                n = i
                break
        usage = Usage(prompt_tokens=prompt_len, cached_prompt_tokens=0, completion_tokens=len(generated) + n)
        logprobs = chunk.logprobs[:n] if chunk.logprobs else None
        return msgspec.structs.replace(chunk, token_ids=ids[:n], logprobs=logprobs, usage=usage)

    async def _missing_text(self, req: GenerateRequest, generated: list[int], emitted: str) -> str:
        """Text of ``generated`` the dead worker held back (half a character, a possible stop string)."""
        try:
            reply = await self.bus.request(
                TOKENIZER_DECODE, DecodeRequest(ids=generated, skip_special_tokens=req.sampling.skip_special_tokens),
                timeout=self.config.call_timeout)
        except BusError:
            return ""
        return reply.text[len(emitted):] if reply.text.startswith(emitted) else ""


async def _indexed(chunks: AsyncIterator[TokenChunk]) -> AsyncIterator[tuple[int, TokenChunk]]:
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            yield 0, chunk


def _continued(chunk: TokenChunk, num_before: int, pending_text: str) -> TokenChunk:
    """A chunk of a migrated stream as the caller sees it: usage over the whole generation, text joined."""
    usage = chunk.usage
    if usage is not None:
        prompt_tokens = usage.prompt_tokens - num_before
        usage = Usage(prompt_tokens=prompt_tokens, cached_prompt_tokens=min(usage.cached_prompt_tokens, prompt_tokens),
                      completion_tokens=usage.completion_tokens + num_before)
    return msgspec.structs.replace(chunk, text=pending_text + chunk.text, usage=usage, timings=None)
