"""The router actor on the in-memory bus: heartbeats in, routes out, errors in headers."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from bus import errors
from bus.memory import MemoryNetwork, memory_bus
from bus.subjects import KV_EVENTS, KV_EVENTS_DUMP, ROUTE, WORKER_HEARTBEAT
from schemas.kv_store import KVDumpReply, KVDumpRequest, KVEvent, KVEventBatchEvent
from schemas.worker import RouteRequest, WorkerHeartbeatEvent, WorkerLoad
from services.engine.page_hash import SCHEME, page_hashes
from services.natsd import free_port
from services.registry import actor_class
from services.router import RouterActor, RouterConfig
from tests.waiting import wait_for

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
    actor = RouterActor(RouterConfig(policy="least_loaded", worker_ttl=0.3, min_disagg_tokens=16,
                                     max_requests_per_worker=3),
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


# --- the KV feed on the bus -------------------------------------------------------------------
def kv_beat(worker_id: str) -> WorkerHeartbeatEvent:
    return WorkerHeartbeatEvent(worker_id=worker_id, role="worker", host_id="h1", model="m", interval_s=0.05,
                                load=WorkerLoad(num_free_pages=100, num_total_pages=100), hash_scheme=SCHEME)


def kv_batch(worker_id: str, event_id: int, hashes, tier: str = "device") -> KVEventBatchEvent:
    return KVEventBatchEvent(worker_id=worker_id, host_id="h1", event_id=event_id, events=[
        KVEvent(kind="stored", tier=tier, page_hashes=list(hashes), parent_hashes=[0] * len(hashes))])


class FakePublisher:
    """What an engine worker serves for KV events: its dump subject, from a set of held pages."""

    def __init__(self, worker_id: str):
        self.worker_id, self.event_id, self.pages, self.num_dumps = worker_id, 0, [], 0

    async def handle_dump(self, req: KVDumpRequest) -> KVDumpReply:
        self.num_dumps += 1
        return KVDumpReply(worker_id=self.worker_id, host_id="h1", event_id=self.event_id, events=[
            KVEvent(kind="stored", tier="device", page_hashes=self.pages, parent_hashes=[0] * len(self.pages))])

    async def publish(self, bus, hashes, *, lose: bool = False) -> None:
        """One batch of stored pages; ``lose``: it never reaches anyone (the id still advances)."""
        self.event_id += 1
        self.pages = self.pages + list(hashes)
        if not lose:
            await bus.publish(KV_EVENTS, kv_batch(self.worker_id, self.event_id, hashes), worker_id=self.worker_id)


@pytest.fixture
async def kv_system():
    network = MemoryNetwork()
    server, client = memory_bus(network), memory_bus(network)
    port = free_port()
    actor = RouterActor(RouterConfig(worker_ttl=60, metrics_port=port), worker_id="router-kv")
    await actor.start(server)
    yield actor, client, port
    await server.drain(timeout=5)
    await actor.stop()
    await client.close()


async def test_kv_feed_dumps_joining_workers_follows_events_and_resyncs_after_a_gap(kv_system):
    actor, client, port = kv_system
    index = actor.router.policy.index
    w1, w2 = FakePublisher("w1"), FakePublisher("w2")
    hashes = page_hashes(list(range(160)), 16)
    w2.pages = hashes[:3]  # w2 held pages before this router started
    w2.event_id = 9
    for pub in (w1, w2):
        await client.serve(KV_EVENTS_DUMP, pub.handle_dump, worker_id=pub.worker_id)
        await client.publish(WORKER_HEARTBEAT, kv_beat(pub.worker_id))
    await wait_for(lambda: index.is_synced("w1") and index.is_synced("w2"), 5, "both workers dumped")
    assert (w1.num_dumps, w2.num_dumps) == (1, 1)
    await w1.publish(client, hashes[:2])
    await w2.publish(client, hashes[3:6])
    await wait_for(lambda: index.stats()["pages_device"] == 8, 5, "the events applied")
    reply = await client.request(ROUTE, RouteRequest(request_id="a", prompt_token_ids=list(range(161))))
    assert (reply.decode_worker_id, reply.num_cached_tokens, reply.reason) == ("w2", 96, "overlap")
    await w1.publish(client, hashes[2:4], lose=True)  # lost: w1's next batch shows a gap
    await w1.publish(client, hashes[4:9])
    await wait_for(lambda: w1.num_dumps == 2 and index.stats()["resyncs"] == 3, 5, "the resync")
    assert index.match("w1", "h1", hashes).num_device_pages == 9 and index.stats()["gaps"] == 1
    detail = actor.health_detail()
    assert detail["policy"] == "kv" and detail["kv_gaps"] == "1" and detail["kv_publishers_synced"] == "2"
    async with httpx.AsyncClient(timeout=30) as http:
        text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    assert "kvbus_router_kv_resyncs_total 3.0" in text
    assert 'kvbus_router_decisions_total{policy="kv",reason="overlap",stage="decode"} 1.0' in text


async def test_a_worker_serving_no_dump_is_routed_in_approximate_mode(kv_system):
    actor, client, _ = kv_system
    index = actor.router.policy.index
    for worker_id in ("w1", "w2"):  # no dump served, no events: another implementation of our subjects
        await client.publish(WORKER_HEARTBEAT, kv_beat(worker_id))
    await wait_for(lambda: index.is_approximate("w1") and index.is_approximate("w2"), 5, "approximate mode")
    prompt = list(range(300))
    first = await client.request(ROUTE, RouteRequest(request_id="a", prompt_token_ids=prompt))
    for worker_id in ("w1", "w2"):  # fresh reports: the first route's load is forgotten
        await client.publish(WORKER_HEARTBEAT, kv_beat(worker_id))
    await wait_for(lambda: all(w.num_routed == 0 for w in actor.router.workers.alive()), 5, "fresh heartbeats")
    again = await client.request(ROUTE, RouteRequest(request_id="b", prompt_token_ids=prompt + [1, 2]))
    assert (first.num_cached_tokens, again.decode_worker_id, again.num_cached_tokens) == \
        (0, first.decode_worker_id, 288)
