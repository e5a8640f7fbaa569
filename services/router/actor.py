"""Router service: picks the decode (and prefill) worker for each request.

Serves ``kvbus.v1.router.route`` (queue group ``router``: replicas share the requests) and listens,
without a queue group, to every worker's heartbeat on ``kvbus.v1.workers.heartbeat`` and, for a
cache-aware policy, to every publisher's KV events (:mod:`services.router.events`), so each replica
keeps the whole picture. The decision itself lives in :mod:`services.router.core`; routing does no
I/O, so a handler runs start to finish without yielding and needs no lock.
"""

from __future__ import annotations

import asyncio
import random
import time

from bus import tracing
from bus.subjects import ROUTE, WORKER_HEARTBEAT
from bus.tracing import names as trace_names
from schemas.worker import RouteReply, RouteRequest, WorkerHeartbeatEvent
from services.actor import Actor
from services.metrics_http import start_metrics
from services.router.config import RouterConfig
from services.router.core import Router
from services.router.events import KVFeed
from services.router.workers import Clock


class RouterActor(Actor):
    """Routes requests to engine workers found by their heartbeats."""

    role = "router"
    config_class = RouterConfig

    def __init__(self, config: RouterConfig, *, worker_id: str | None = None,
                 clock: Clock = time.monotonic, rng: random.Random | None = None):
        super().__init__(config, worker_id=worker_id)
        self.router = Router(config, clock=clock, rng=rng)
        self.feed = KVFeed(self.router, dump_timeout=config.kv_dump_timeout)
        self._heartbeats = None
        self._sweeper: asyncio.Task | None = None
        self.metrics_server = None
        self.num_routed = 0

    @property
    def sweep_interval(self) -> float:
        return min(1.0, self.config.worker_ttl / 2)

    async def start(self, bus) -> None:
        # Listen before serving, so the first routes already see the workers that beat meanwhile.
        await self.feed.start(bus)
        self._heartbeats = await bus.subscribe(WORKER_HEARTBEAT, self.handle_heartbeat)
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="router-sweep")
        await super().start(bus)
        self.metrics_server = await start_metrics(self.router.metrics.registry, self.config.metrics_host,
                                                  self.config.metrics_port, f"router {self.worker_id}")

    async def stop(self) -> None:
        await super().stop()
        if self.metrics_server is not None:
            await self.metrics_server.stop()
            self.metrics_server = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        if self._heartbeats is not None:
            await self._heartbeats.unsubscribe()
            self._heartbeats = None
        await self.feed.stop()

    def routes(self):
        return [(ROUTE, self.handle_route, {})]

    async def handle_route(self, req: RouteRequest) -> RouteReply:
        reply = self.router.route(req)
        self.num_routed += 1
        tracing.RequestTrace.current().set({
            trace_names.DECODE_WORKER: reply.decode_worker_id, trace_names.PREFILL_WORKER: reply.prefill_worker_id,
            trace_names.ROUTE_POLICY: reply.policy, trace_names.ROUTE_REASON: reply.reason,
            trace_names.PREDICTED_CACHED_TOKENS: reply.num_cached_tokens,
            trace_names.PROMPT_TOKENS: len(req.prompt_token_ids), "kvbus.route.excluded": req.exclude_worker_ids})
        return reply

    async def handle_heartbeat(self, event: WorkerHeartbeatEvent) -> None:
        self.router.observe(event)
        self.feed.request_dumps()  # a worker that joined is dumped at once

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval)
            self.router.tick()
            self.feed.request_dumps()  # retries, silent kv_stores

    def health_detail(self) -> dict[str, str]:
        counts = self.router.workers.count_by_role()
        return {"policy": self.router.policy.name, "disaggregation": self.config.disaggregation,
                "routed": str(self.num_routed),
                **{f"workers_{role}": str(counts.get(role, 0)) for role in ("prefill", "decode", "worker")},
                **self.router.detail()}
