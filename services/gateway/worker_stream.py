"""One generation's stream from the workers: route, stream from the decode worker, and when a worker
fails, retry (nothing streamed yet) or migrate (the next worker continues the output), so the caller
sees one stream with no gap and no repeat.

:class:`~services.gateway.pipeline.GenerationPipeline` validates, tokenizes and counts; it asks
:class:`WorkerStreams` for each choice's chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator

import msgspec

from bus import Bus, BusError, Timeout, Unavailable
from bus.core import REQUEST_ID_HEADER, StreamBroken
from bus.subjects import ROUTE, TOKENIZER_DECODE, WORKER_GENERATE
from bus.tracing import NO_TRACE, RequestTrace
from schemas.engine import Usage
from schemas.generate import GenerateRequest
from schemas.tokenizer import DecodeRequest
from schemas.worker import RouteRequest, TokenChunk, WorkerGenerateRequest
from services.gateway.config import GatewayConfig
from services.gateway.request_trace import AttemptTrace
from services.gateway.stop_span import HeldText
from services.liveness import WorkerDied, WorkerLiveness

log = logging.getLogger(__name__)

MAX_RETRIES = 1
"""A worker that answers unavailable before it streamed anything is retried once elsewhere (a dead
worker, known from its heartbeats, is a migration instead: GatewayConfig.max_migrations)."""


DEADLINE_GRACE_S = 1.0
"""The worker's bus cancels a generation this long after the gateway's deadline: the gateway ends the
caller's request itself, the worker's own expiry only matters when the gateway is gone."""


class WorkerStreams:
    def __init__(self, bus: Bus, config: GatewayConfig, liveness: WorkerLiveness | None = None):
        self.bus = bus
        self.config = config
        self.liveness = liveness
        """Heartbeat watch: a stream from a worker that died ends at once (then migrates)."""
        self.num_migrations = 0
        """Requests moved to another worker mid-generation (each move counts)."""
        self.num_migrations_failed = 0
        """Requests that ran out of max_migrations (or of workers) and ended unavailable."""

    async def stream(self, req: GenerateRequest, prompt_ids: list[int], request_id: str,
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
                async with contextlib.aclosing(self._chunks_from(worker_id, message, request_id, deadline,
                                                                 worker_span)) as chunks:  # closed with us
                    async for chunk in chunks:
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


def _continued(chunk: TokenChunk, num_before: int, pending_text: str) -> TokenChunk:
    """A chunk of a migrated stream as the caller sees it: usage over the whole generation, text joined."""
    usage = chunk.usage
    if usage is not None:
        prompt_tokens = usage.prompt_tokens - num_before
        usage = Usage(prompt_tokens=prompt_tokens, cached_prompt_tokens=min(usage.cached_prompt_tokens, prompt_tokens),
                      completion_tokens=usage.completion_tokens + num_before)
    return msgspec.structs.replace(chunk, text=pending_text + chunk.text, usage=usage, timings=None)
