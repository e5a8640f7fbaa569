"""The OpenAI-compatible HTTP API (FastAPI), served by uvicorn inside the gateway's event loop.

Bodies are parsed with msgspec (not FastAPI's pydantic models), so a malformed
request gets an OpenAI-style 400 with msgspec's message instead of a 422.
A streamed request is primed before the response starts: errors before the
first token (bad prompt, overloaded, no worker) keep their status code; after
it they arrive as an SSE ``error`` event. A client that goes away, before or
during the stream, closes the pipeline's generator, which cancels the worker.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from bus import tracing
from bus.errors import BusError, Internal
from bus.tracing import names as trace_names
from schemas.generate import GenerateChunk, GenerateRequest
from services.actor import VERSION
from services.gateway.auth import install_auth
from services.gateway.choices import merged_usage
from services.gateway.metrics import CONTENT_TYPE
from services.gateway.openai_format import ChatCompletions as _ChatCompletions
from services.gateway.openai_format import Completions as _Completions
from services.gateway.openai_format import sse as _sse
from services.gateway.openai_mapping import BodyTooLarge, decode_body, error_response, with_session
from services.gateway.openai_schemas import ErrorDetail, ErrorResponse, ModelCard, ModelList
from services.gateway.pipeline import GenerationPipeline

if TYPE_CHECKING:
    from services.gateway.actor import GatewayActor

log = logging.getLogger(__name__)
T = TypeVar("T")
_encoder = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The HTTP client disconnected before the response started."""


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_encoder.encode(body), status_code=status, media_type="application/json", headers=headers)


def _error(exc: BaseException, request_id: str | None = None) -> Response:
    status, body = error_response(exc)
    headers = {"X-Request-Id": request_id} if request_id else None
    if status in (429, 503):  # refused, not failed: say when to come back (RFC 9110 Retry-After, seconds)
        retry_after = getattr(exc, "retry_after", None) or 1.0
        headers = {**(headers or {}), "Retry-After": str(max(1, math.ceil(retry_after)))}
    return _json(body, status, headers)


class _ClosingStreamingResponse(StreamingResponse):
    """Closes the body generator however the response ends (Starlette leaves a disconnected one open)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    finally:
        for t in (task, watcher):
            t.cancel()


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the request body has {declared} bytes; the limit is {limit}")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise BodyTooLarge(f"the request body exceeds {limit} bytes")
        parts.append(part)
    return b"".join(parts)


# --- the app ------------------------------------------------------------------------------------


def _without_native_spans() -> dict:
    """FastAPI (from 0.13x) opens spans of its own for every request once a tracer provider exists: a
    second root beside the request's (RequestTrace.start below). The gateway's spans are kvbus's."""
    import inspect

    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "operation_spans": False}}


def create_app(actor: GatewayActor) -> FastAPI:
    pipeline: GenerationPipeline = actor.pipeline
    metrics = actor.metrics
    app = FastAPI(title="kvbus gateway", version=VERSION, docs_url=None, redoc_url=None, **_without_native_spans())
    install_auth(app, actor.config)  # API keys on /v1 when configured (services/gateway/auth.py)
    started = int(time.time())

    @app.exception_handler(StarletteHTTPException)
    async def http_exception(request: Request, exc: StarletteHTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
        body = ErrorResponse(error=ErrorDetail(message=f"{request.method} {request.url.path}: {exc.detail}",
                                               type="invalid_request_error", code=code))
        return _json(body, exc.status_code)

    @app.exception_handler(Exception)
    async def unhandled(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error serving %s %s", request.method, request.url.path)
        return _error(exc)

    async def generate(request: Request, kind: type[_Completions]) -> Response:
        try:
            body = await _read_body(request, actor.config.max_request_bytes)
            openai_req = decode_body(body, kind.request_type)
            gen_req = with_session(kind.to_generate(openai_req), request.headers.get("x-session-id"),
                                   openai_req.user if actor.config.session_from_user else None)
        except BusError as exc:  # refused before the pipeline: counted here
            metrics.observe_request(kind.endpoint, error_response(exc)[0],
                                    exc.code.value)
            return _error(exc)
        request_id = kind.id_prefix + uuid.uuid4().hex
        # The request's root span, until its last byte left (a streamed response ends it); a W3C
        # traceparent header from the client makes it part of the client's trace.
        trace = tracing.RequestTrace.start(f"POST {request.url.path}", request.headers, request_id=request_id,
                                           attributes={"http.request.method": "POST", "url.path": request.url.path,
                                                       trace_names.REQUEST_STREAM: bool(openai_req.stream)})
        response = None
        try:
            response = await respond(request, kind, openai_req, gen_req, request_id, trace)
            return response
        except BusError as exc:
            trace.error(exc.code.value, exc.message)
            return _error(exc, request_id)
        except ClientGone:
            trace.set({"kvbus.cancelled": True})
            return Response(status_code=499, headers={"X-Request-Id": request_id})
        except BaseException as exc:
            trace.fail(exc)
            raise
        finally:
            if not isinstance(response, _ClosingStreamingResponse):
                trace.end()

    async def respond(request: Request, kind: type[_Completions], openai_req: Any, gen_req: GenerateRequest,
                      request_id: str, trace: tracing.RequestTrace) -> Response:
        wants_logprobs, num_choices = gen_req.sampling.logprobs is not None, gen_req.sampling.n
        if not openai_req.stream:
            replies = await _until_disconnected(
                request, pipeline.generate_choices(gen_req, request_id=request_id, endpoint=kind.endpoint,
                                                   trace=trace))
            fmt = kind(pipeline, request_id, await pipeline.model_name(), wants_logprobs, num_choices)
            return _json(await fmt.whole_choices(replies), headers={"X-Request-Id": request_id})
        chunks = pipeline.generate(gen_req, request_id=request_id, endpoint=kind.endpoint, trace=trace)
        try:
            first = await _until_disconnected(request, anext(chunks, None))
        except BaseException:
            await chunks.aclose()
            raise
        if first is None:
            raise Internal(f"the worker's stream for {request_id} ended before any chunk")
        fmt = kind(pipeline, request_id, await pipeline.model_name(), wants_logprobs, num_choices)
        include_usage = bool(openai_req.stream_options and openai_req.stream_options.include_usage)
        return _ClosingStreamingResponse(_ending(_sse_events(fmt, first, chunks, include_usage), trace),
                                         media_type="text/event-stream",
                                         headers={"X-Request-Id": request_id, "Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, _Completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, _ChatCompletions)

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            card = ModelCard(id=await pipeline.model_name(), created=started,
                             max_model_len=await pipeline.context_length() or None)
        except BusError as exc:
            return _error(exc)
        return _json(ModelList(data=[card]))

    @app.get("/health")
    async def health() -> Response:
        tokenizer, router = await asyncio.gather(pipeline.health_of("tokenizer"), pipeline.health_of("router"))
        ok = tokenizer is not None and router is not None and actor.is_ready
        # Engine workers the router knows (from its health detail): information, not a condition of health.
        workers = sum(int(v) for k, v in router.detail.items() if k.startswith("workers_") and v.isdigit()) \
            if router is not None else None
        return _json({"status": "ok" if ok else "unavailable", "ready": actor.is_ready,
                      "tokenizer": tokenizer is not None, "router": router is not None, "workers": workers},
                     200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


async def _ending(events: AsyncIterator[bytes], trace: tracing.RequestTrace) -> AsyncIterator[bytes]:
    """``events``, then the request's trace ends: its last byte left (or the client went away)."""
    try:
        async for event in events:
            yield event
    finally:
        await events.aclose()
        trace.end()


async def _sse_events(fmt: _Completions, first: GenerateChunk, chunks: AsyncIterator[GenerateChunk],
                      include_usage: bool) -> AsyncIterator[bytes]:
    usages = {}  # by choice
    try:
        for event in fmt.opening():
            yield event
        chunk: GenerateChunk | None = first
        while chunk is not None:
            if chunk.usage is not None:
                usages[chunk.index] = chunk.usage
            event = await fmt.piece(chunk)
            if event is not None:
                yield event
            chunk = await anext(chunks, None)
        if include_usage and usages:
            yield fmt.usage_event(merged_usage([usages[i] for i in sorted(usages)]))
    except Exception as exc:  # after the 200 went out, errors travel as an SSE event
        if not isinstance(exc, BusError):
            log.exception("stream %s failed", fmt.id)
        yield _sse(error_response(exc)[1])
    finally:
        await chunks.aclose()
    yield DONE
