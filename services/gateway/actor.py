"""The gateway actor: the public generate subjects on NATS, and the OpenAI HTTP API beside them.

uvicorn runs inside the actor's event loop (the bus's), started in ``start`` and
stopped in ``drain``/``stop``; HTTP and NATS requests share one
:class:`GenerationPipeline`, so they share limits and metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator

from bus import Bus, RequestContext, tracing
from bus.subjects import GENERATE, GENERATE_ONCE
from bus.tracing import names as trace_names
from schemas.generate import GenerateChunk, GenerateReply, GenerateRequest
from services.actor import Actor
from services.config import ConfigError
from services.gateway.config import GatewayConfig
from services.gateway.metrics import GatewayMetrics
from services.gateway.pipeline import GenerationPipeline
from services.liveness import WorkerLiveness

log = logging.getLogger(__name__)


class GatewayActor(Actor):
    """Public entry point: kvbus.v1.generate(.once) on NATS and OpenAI-compatible HTTP."""

    role = "gateway"
    config_class = GatewayConfig

    def __init__(self, config: GatewayConfig, *, worker_id: str | None = None):
        super().__init__(config, worker_id=worker_id)
        self.pipeline: GenerationPipeline | None = None
        self.metrics = GatewayMetrics(num_inflight=lambda: self.pipeline.num_inflight if self.pipeline else 0,
                                      migrations=self._migrations)
        self.app = None
        self.http_port: int | None = None
        """The port the HTTP API listens on, once started (the real one when configured as 0)."""
        self._server = None
        self._server_task: asyncio.Task | None = None
        self.liveness: WorkerLiveness | None = None

    def routes(self):
        return [(GENERATE, self.handle_generate, {}), (GENERATE_ONCE, self.handle_generate_once, {})]

    async def start(self, bus: Bus) -> None:
        from services.gateway.http import create_app

        self.liveness = WorkerLiveness(self.config.worker_ttl)
        await self.liveness.start(bus)
        self.pipeline = GenerationPipeline(bus, self.config, self.metrics, self.liveness)
        self.app = create_app(self)
        await super().start(bus)
        if self.config.enable_http:
            await self._start_http()

    async def handle_generate(self, req: GenerateRequest, ctx: RequestContext) -> AsyncIterator[GenerateChunk]:
        tracing.RequestTrace.current().set({trace_names.REQUEST_STREAM: True})  # (the bus's span is the root)
        # closed here, not when collected: the bus closes this handler at its yield when a cancel lands
        # as a chunk goes out, and the worker's stream must end then
        async with contextlib.aclosing(self.pipeline.generate(req, request_id=ctx.request_id, endpoint="generate",
                                                              deadline=ctx.deadline)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def handle_generate_once(self, req: GenerateRequest, ctx: RequestContext) -> GenerateReply:
        tracing.RequestTrace.current().set({trace_names.REQUEST_STREAM: False})
        return await self.pipeline.generate_once(req, request_id=ctx.request_id, endpoint="generate_once",
                                                 deadline=ctx.deadline)

    def _migrations(self) -> tuple[int, int]:
        return (self.pipeline.num_migrations, self.pipeline.num_migrations_failed) if self.pipeline else (0, 0)

    def health_detail(self) -> dict[str, str]:
        detail = {"inflight": str(self.pipeline.num_inflight if self.pipeline else 0)}
        if self.pipeline is not None:
            detail["migrations"] = str(self.pipeline.num_migrations)
            detail["migrations_failed"] = str(self.pipeline.num_migrations_failed)
        if self.http_port is not None:
            detail["http"] = self.http_url
        return detail

    @property
    def http_url(self) -> str:
        host = self.config.http_host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.http_port}"

    # --- HTTP server lifecycle --------------------------------------------------------------
    async def _start_http(self) -> None:
        import uvicorn

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                # The service runner owns SIGTERM/SIGINT (drain in a defined order); uvicorn must not.
                yield

        host, port = self.config.http_host, self.config.http_port
        try:  # bind here, so a taken port fails start-up with a clear message and port 0 is known at once
            sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        except OSError as exc:
            raise ConfigError(f"--http-port {port}: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        # NOTE: accepted connections inherit TCP_NODELAY from the listener on Linux. Without it, on a
        # kept-alive connection the first SSE chunk waited for the client's delayed ACK of the
        # response headers (Nagle): ~40 ms more to every streamed request's first token.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.http_port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=30)
        self._server = _Server(config)
        self._server_task = asyncio.create_task(self._server.serve(sockets=[sock]), name="gateway-http")
        while not self._server.started:
            if self._server_task.done():
                self._server_task.result()  # raises what stopped it
                raise RuntimeError("the gateway's HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        log.info("gateway %s: OpenAI API on %s/v1", self.worker_id, self.http_url)
        print(f"kvbus gateway: OpenAI API on {self.http_url}/v1", flush=True)

    async def drain(self, timeout: float = 30.0) -> None:
        """Stop taking HTTP connections and let in-flight HTTP requests finish (the bus is still up)."""
        if self._server_task is None:
            return
        self._server.config.timeout_graceful_shutdown = timeout
        self._server.should_exit = True
        try:
            async with asyncio.timeout(timeout + 1.0):
                await asyncio.shield(self._server_task)
        except Exception:
            log.warning("gateway %s: HTTP server did not stop in %.0fs", self.worker_id, timeout)

    async def stop(self) -> None:
        await super().stop()
        if self.liveness is not None:
            await self.liveness.stop()
        if self._server_task is not None:
            self._server.should_exit = True
            self._server.force_exit = True
            await asyncio.wait({self._server_task}, timeout=5.0)
            for task in [self._server_task, *self._server.server_state.tasks]:  # still running: their bus is gone
                task.cancel()
            self._server_task = None
