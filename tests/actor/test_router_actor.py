"""The router actor on the in-memory bus: heartbeats in, routes out, errors in headers."""

from __future__ import annotations

import asyncio
import time

import pytest

from bus import errors
from bus.memory import MemoryNetwork, memory_bus
from bus.subjects import ROUTE, WORKER_HEARTBEAT
from schemas.worker import RouteRequest, WorkerHeartbeatEvent, WorkerLoad
from services.registry import actor_class
from services.router import RouterActor, RouterConfig

pytestmark = pytest.mark.anyio


def beat(worker_id: str, role: str = "decode", *, running: int = 0, draining: bool = False) -> WorkerHeartbeatEvent:
    return WorkerHeartbeatEvent(worker_id=worker_id, role=role, host_id="h1", model="m", interval_s=0.05,
                                load=WorkerLoad(num_running=running, num_free_pages=10, num_total_pages=10),
                                is_draining=draining)


def request(ids: int = 64, exclude: list[str] | None = None) -> RouteRequest:
    return RouteRequest(request_id="r1", prompt_token_ids=list(range(ids)), exclude_worker_ids=exclude or [])


async def eventually(predicate, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.fixture
async def system():
    network = MemoryNetwork()
    server, client = memory_bus(network), memory_bus(network)
    actor = RouterActor(RouterConfig(worker_ttl=0.3, min_disagg_tokens=16, max_requests_per_worker=3),
                        worker_id="router-0")
    await actor.start(server)
    yield actor, client
    await server.drain(timeout=5)
    await actor.stop()
    await client.close()


async def test_role_is_registered():
    assert actor_class("router") is RouterActor


async def test_routes_to_workers_announced_by_heartbeats(system):
    actor, client = system
    with pytest.raises(errors.Unavailable, match="no decode worker"):
        await client.request(ROUTE, request())
    for event in (beat("d1", running=2), beat("d2"), beat("p1", "prefill")):
        await client.publish(WORKER_HEARTBEAT, event)
    await eventually(lambda: actor.router.workers.known_ids() == ["d1", "d2", "p1"])
    reply = await client.request(ROUTE, request(64))
    assert (reply.decode_worker_id, reply.prefill_worker_id, reply.policy) == ("d2", "p1", "least_loaded")
    reply = await client.request(ROUTE, request(8))  # short prompt: prefilled on the decoder
    assert (reply.decode_worker_id, reply.prefill_worker_id) == ("d2", None)
    reply = await client.request(ROUTE, request(64, exclude=["d2", "p1"]))
    assert (reply.decode_worker_id, reply.prefill_worker_id) == ("d1", None)
    detail = actor.health_detail()
    assert detail["workers_decode"] == "2" and detail["workers_prefill"] == "1" and detail["routed"] == "3"


async def test_errors_cross_the_wire(system):
    actor, client = system
    await client.publish(WORKER_HEARTBEAT, beat("d1", running=3))
    await eventually(lambda: actor.router.workers.known_ids() == ["d1"])
    with pytest.raises(errors.Overloaded, match="all 1 decode workers are busy"):
        await client.request(ROUTE, request())
    with pytest.raises(errors.InvalidArgument, match="prompt_token_ids"):
        await client.request(ROUTE, request(0))


async def test_silent_worker_disappears_after_ttl_and_draining_at_once(system):
    actor, client = system

    async def keep_beating(stop: asyncio.Event) -> None:
        while not stop.is_set():
            await client.publish(WORKER_HEARTBEAT, beat("alive"))
            await asyncio.sleep(0.05)

    await client.publish(WORKER_HEARTBEAT, beat("silent"))
    await client.publish(WORKER_HEARTBEAT, beat("leaving"))
    stop = asyncio.Event()
    beater = asyncio.create_task(keep_beating(stop))
    try:
        await eventually(lambda: actor.router.workers.known_ids() == ["alive", "leaving", "silent"])
        await client.publish(WORKER_HEARTBEAT, beat("leaving", draining=True))
        await eventually(lambda: "leaving" not in actor.router.workers.known_ids())
        # The sweep drops "silent" with nobody routing; "alive" stays.
        await eventually(lambda: actor.router.workers.known_ids() == ["alive"], timeout=1.5)
        assert (await client.request(ROUTE, request())).decode_worker_id == "alive"
    finally:
        stop.set()
        await beater
    await eventually(lambda: actor.router.workers.known_ids() == [], timeout=5.0)
    with pytest.raises(errors.Unavailable, match="none has sent a heartbeat"):
        await client.request(ROUTE, request())
