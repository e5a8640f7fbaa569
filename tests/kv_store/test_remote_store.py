"""Engines on another host than the kv_store: pages by value through the transfer layer.

First the store's offer / put / fetch protocol with synthetic pages (chunked:
the bus's max_payload is smaller than a batch), then two engine workers on two
"hosts" that share the store on a third: pages one writes back are fetched and
loaded by the other, greedy output token for token, and a store that dies
leaves them serving by recomputing until a new one starts.
"""

from __future__ import annotations

import gc
import random
import uuid

import numpy as np
import pytest
import torch

from bus.errors import InvalidArgument
from bus.memory import MemoryNetwork, memory_bus
from bus.subjects import KV_STORE_ATTACH, KV_STORE_FETCH, KV_STORE_OFFER, KV_STORE_PUT
from schemas.engine import SamplingParams
from schemas.kv_store import KVStoreAttachRequest, KVStoreFetchRequest, KVStoreOfferRequest, KVStorePutRequest
from services.kv_store.actor import KVStoreActor
from services.kv_store.config import KVStoreConfig
from services.transfer import KVReceiver, KVSender
from services.workers import WorkerConfig
from services.workers.actor import WorkerActor
from tests.streaming import cold_tokens, worker_tokens
from tests.waiting import wait_for

pytestmark = pytest.mark.anyio
STORE_HOST = "host-a"
PB, PS = 50_000, 4  # page bytes, tokens per page
MAX_PAYLOAD = 64 * 1024  # every page crosses in several chunks



def pages(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (n, PB), dtype=np.uint8)


@pytest.fixture
async def store_and_engine():
    """A kv_store on host-a and the bus end of an engine on host-b (its receiver and sender)."""
    network = MemoryNetwork(max_payload=MAX_PAYLOAD)
    store_bus, bus = memory_bus(network), memory_bus(network)
    store = KVStoreActor(KVStoreConfig(host_id=STORE_HOST, hicache_size=0.002, memory_reserve=0.0),
                         worker_id="kv_store-0")
    await store.start(store_bus)
    receiver = await KVReceiver.open(bus, "eng-l2", "host-b", "nats")
    sender = KVSender(bus, "eng", "host-b", backends=("nats",))
    await bus.request(KV_STORE_ATTACH, KVStoreAttachRequest(worker_id="eng", layout_key="L", page_bytes=PB,
                                                            page_size=PS, pool_bytes=10 * PB), host_id=STORE_HOST)
    yield store, bus, receiver, sender
    await receiver.close()
    await sender.close(grace=0)
    await bus.close()
    await store_bus.close()
    await store.stop()


async def put(bus, sender, hashes, data, worker_id="eng"):
    tokens = [[h % 1000 + i for i in range(PS)] for h in hashes]
    offer = await bus.request(KV_STORE_OFFER, KVStoreOfferRequest(
        worker_id=worker_id, layout_key="L", page_hashes=hashes, parent_hashes=[0] + hashes[:-1], token_ids=tokens,
        sender_host_id="host-b"), host_id=STORE_HOST)
    if not offer.wanted:
        return offer.wanted, 0
    desc = await sender.send(offer.target, torch.from_numpy(np.stack([data[i] for i in offer.wanted])))
    reply = await bus.request(KV_STORE_PUT, KVStorePutRequest(worker_id=worker_id, transfer=desc), host_id=STORE_HOST)
    return offer.wanted, reply.stored


async def fetch(bus, receiver, hashes):
    tid = uuid.uuid4().hex
    target = receiver.expect(tid, sender_host_id=STORE_HOST, sender_backends=("nats",))
    reply = await bus.request(KV_STORE_FETCH, KVStoreFetchRequest(worker_id="eng", layout_key="L",
                                                                  page_hashes=hashes, target=target),
                              host_id=STORE_HOST)
    if reply.transfer is None:
        receiver.cancel(tid)
        return reply, None
    return reply, (await receiver.receive(reply.transfer, timeout=10)).numpy()


async def test_put_then_fetch_round_trips_pages_by_value_and_dedupes(store_and_engine):
    store, bus, receiver, sender = store_and_engine
    data = pages(1, 5)
    hashes = [101, 102, 103, 104, 105]
    assert await put(bus, sender, hashes[:3], data[:3]) == ([0, 1, 2], 3)
    # a second offer of overlapping pages: only the two the store lacks are wanted and sent
    assert await put(bus, sender, hashes, data) == ([3, 4], 2)
    assert store.core.counters["remote_in"] == 5
    reply, got = await fetch(bus, receiver, hashes + [999])  # the chain's leading run: 5 pages
    assert reply.page_hashes == hashes and reply.parent_hashes == [0] + hashes[:-1]
    assert reply.token_ids == [[h % 1000 + i for i in range(PS)] for h in hashes]
    assert np.array_equal(got, data)
    assert store.core.counters["remote_out"] == 5
    reply, got = await fetch(bus, receiver, [999, 101])  # a miss first: nothing
    assert reply.page_hashes == [] and got is None
    store.core.index.check()


async def test_bad_offers_and_puts_get_clear_errors_and_store_nothing(store_and_engine):
    store, bus, receiver, sender = store_and_engine
    ok = dict(worker_id="eng", layout_key="L", page_hashes=[7], parent_hashes=[0], token_ids=[[1, 2, 3, 4]],
              sender_host_id="host-b")
    for bad, match in ((dict(layout_key="other"), "layout"), (dict(token_ids=[[]]), "tokens"),
                       (dict(token_ids=[[1, 2, 3, 4, 5]]), "tokens"), (dict(parent_hashes=[]), "parent")):
        with pytest.raises(InvalidArgument, match=match):
            await bus.request(KV_STORE_OFFER, KVStoreOfferRequest(**{**ok, **bad}), host_id=STORE_HOST)
    offer = await bus.request(KV_STORE_OFFER, KVStoreOfferRequest(**ok), host_id=STORE_HOST)
    desc = await sender.send(offer.target, torch.from_numpy(pages(2, 1)))
    with pytest.raises(InvalidArgument, match="not offered"):  # another worker can neither complete nor spoil it
        await bus.request(KV_STORE_PUT, KVStorePutRequest(worker_id="intruder", transfer=desc), host_id=STORE_HOST)
    reply = await bus.request(KV_STORE_PUT, KVStorePutRequest(worker_id="eng", transfer=desc), host_id=STORE_HOST)
    assert reply.stored == 1
    ok = {**ok, "page_hashes": [8]}
    offer = await bus.request(KV_STORE_OFFER, KVStoreOfferRequest(**ok), host_id=STORE_HOST)
    desc = await sender.send(offer.target, torch.from_numpy(pages(2, 2)))  # two pages for an offer of one
    with pytest.raises(InvalidArgument, match="must be"):
        await bus.request(KV_STORE_PUT, KVStorePutRequest(worker_id="eng", transfer=desc), host_id=STORE_HOST)
    with pytest.raises(InvalidArgument, match="not offered"):  # the offer is used up
        await bus.request(KV_STORE_PUT, KVStorePutRequest(worker_id="eng", transfer=desc), host_id=STORE_HOST)
    assert store.core.index.num_stored == 1 and store.core.counters["remote_in"] == 1
    assert receiver.num_expected == 0 and store.receiver.num_expected == 0
    store.core.index.check()


async def test_offers_never_put_are_bounded(store_and_engine, monkeypatch):
    from bus.errors import Unavailable
    from services.kv_store import actor as actor_mod

    store, bus, _, _ = store_and_engine
    monkeypatch.setattr(actor_mod, "MAX_OFFERS", 2)
    offer = dict(worker_id="eng", layout_key="L", parent_hashes=[0], token_ids=[[1, 2, 3, 4]], sender_host_id="host-b")
    for h in (1, 2):
        await bus.request(KV_STORE_OFFER, KVStoreOfferRequest(page_hashes=[h], **offer), host_id=STORE_HOST)
    with pytest.raises(Unavailable, match="offers await"):
        await bus.request(KV_STORE_OFFER, KVStoreOfferRequest(page_hashes=[3], **offer), host_id=STORE_HOST)
    assert len(store._offers) == 2 and store.receiver.num_expected == 2


# ---- two engine workers on other hosts ---------------------------------------------------------

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [random.Random(11).randrange(100, 20000) for _ in range(70)]  # 4 full pages + 6 tokens
PROMPT2 = [random.Random(12).randrange(100, 20000) for _ in range(70)]


@pytest.fixture(scope="module")
def config(model_dir):
    return WorkerConfig(model=str(model_dir), kv_cache_memory=0.02, max_running_requests=2, load_tokenizer=False,
                        hicache=True, hicache_write_policy="write_through", hicache_reconnect_interval=0.05,
                        hicache_store_host=STORE_HOST)


@pytest.fixture(scope="module")
def reference(config):
    from services.engine import LLMEngine

    engine = LLMEngine(config.engine_config.replace(enable_prefix_caching=False))
    return {tuple(p): out.token_ids for p, out in zip((PROMPT, PROMPT2), engine.generate_sync([PROMPT, PROMPT2], GREEDY))}


async def start_store(network, worker_id):
    bus = memory_bus(network)
    store = KVStoreActor(KVStoreConfig(host_id=STORE_HOST, hicache_size=0.1, memory_reserve=0.0),
                         worker_id=worker_id)
    await store.start(bus)
    return store, bus


@pytest.fixture
async def system(config):
    # Each worker's staging arena refuses to start past MemAvailable minus its 1 GB reserve: let
    # engines of earlier tests that only reference cycles keep alive go first (CI's one process).
    gc.collect()
    network = MemoryNetwork(max_payload=256 * 1024)  # a page (0.7 MiB) crosses in chunks
    store, store_bus = await start_store(network, "kv_store-0")
    workers, buses = [], []
    for wid, host in (("worker-b", "host-b"), ("worker-c", "host-c")):
        bus = memory_bus(network)
        worker = WorkerActor(config.replace(host_id=host), worker_id=wid)
        await worker.start(bus)
        workers.append(worker)
        buses.append(bus)
    client = memory_bus(network)
    state = {"store": store, "store_bus": store_bus, "network": network}
    yield state, workers, client
    for worker, bus in zip(workers, buses):
        await bus.close()
        await worker.stop()
    if state["store"] is not None:
        await state["store_bus"].close()
        await state["store"].stop()
    await client.close()


async def generate(client, worker_id: str, prompt: list[int] = PROMPT) -> list[int]:
    return await worker_tokens(client, worker_id, prompt, GREEDY)


async def test_pages_written_back_on_one_host_load_on_another(system, reference):
    reference = reference[tuple(PROMPT)]
    state, (b, c), client = system
    store = state["store"]
    await wait_for(lambda: b.tier.is_attached and c.tier.is_attached, what="workers attached")
    # neither worker maps the store's arena: each has a staging arena of its own
    assert len({store.core.arena.name, b.tier.arena.name, c.tier.arena.name}) == 3
    assert await generate(client, "worker-b") == reference
    await wait_for(lambda: store.core.index.num_stored >= 4, what="pages put into the store")
    assert b.tier.link.stats["pages_sent"] >= 4 and store.core.counters["remote_in"] >= 4
    assert await generate(client, "worker-c") == reference
    assert c.tier.stats["loaded_back"] == 4  # (70 - 1) // 16 pages fetched, then loaded, none recomputed
    assert c.engine.stats.num_prefill_tokens == len(PROMPT) - 4 * 16
    assert c.tier.link.stats["pages_received"] == 4 and store.core.counters["remote_out"] == 4
    from prometheus_client import generate_latest
    from tests.kv_store.test_metrics import samples

    worker_series = samples(generate_latest(c.metrics.registry).decode())
    assert worker_series[("kvbus_hicache_remote_pages_total", (("direction", "received"),))] == 4
    assert worker_series[("kvbus_hicache_remote_bytes_total", (("direction", "received"),))] == 4 * c.tier.page_bytes
    store_series = samples(generate_latest(store.metrics.registry).decode())
    assert store_series[("kvbus_kv_store_remote_pages_total", (("direction", "out"),))] == 4
    # c's fetched pages are in its staging cache: after an L1 eviction it needs no second fetch
    c.engine.block_manager.evict_all_cached()
    assert await generate(client, "worker-c") == reference
    assert c.tier.stats["loaded_back"] == 8 and c.tier.link.stats["pages_received"] == 4
    # and c did not send back what it fetched (its write-through found the pages in staging)
    assert c.tier.link.stats["pages_sent"] == 0
    store.core.index.check()
    b.tier.link.staging.index.check()
    c.tier.link.staging.index.check()


async def test_a_tail_written_on_one_host_is_fetched_on_another(system, config):
    """Turn 2 of a chat on a worker of another host: its prefetch fetches the full pages, then
    (one ``first_of`` lookup, one page by value) the tail worker-b left: the answer's computed
    rows are loaded, not recomputed."""
    state, (b, c), client = system
    store = state["store"]
    await wait_for(lambda: b.tier.is_attached and c.tier.is_attached, what="workers attached")
    answer = await generate(client, "worker-b")  # PROMPT's 70 and 6 generated: 4 pages + 11 computed rows
    await wait_for(lambda: store.core.index.num_stored >= 5, what="write-through of the pages and the tail")
    turn2 = PROMPT + answer + [1000 + i for i in range(9)]
    ref = cold_tokens(config.engine_config, turn2, GREEDY)
    assert await generate(client, "worker-c", turn2) == ref
    bm = c.engine.block_manager
    seen = {"tail_loads": bm.num_tail_loads, "load_timeouts": bm.num_load_timeouts, "tier": dict(c.tier.stats),
            "link": dict(c.tier.link.stats), "store_stored": store.core.index.num_stored}  # (a failure says why)
    assert bm.num_tail_loads == 1 and c.tier.stats["loaded_back"] == 5, seen
    assert c.engine.stats.num_prefill_tokens == len(turn2) - (len(PROMPT) + len(answer) - 1)
    assert c.tier.link.stats["pages_received"] == 5 and c.tier.link.stats["fetch_failed"] == 0
    c.tier.link.staging.index.check()


async def test_store_dies_remote_workers_recompute_then_hits_resume(system, reference):
    state, (b, c), client = system
    await wait_for(lambda: b.tier.is_attached and c.tier.is_attached, what="workers attached")
    await state["store_bus"].close()
    await state["store"].stop()
    state["store"] = None
    assert await generate(client, "worker-b") == reference[tuple(PROMPT)]  # computed; its put fails quietly
    await wait_for(lambda: not c.tier.link.healthy, what="c notices the store is gone")
    assert await generate(client, "worker-c") == reference[tuple(PROMPT)]  # recomputed: nothing to fetch from
    assert c.tier.stats["loaded_back"] == 0 and c.engine.stats.num_prefill_tokens == len(PROMPT)
    store, store_bus = await start_store(state["network"], "kv_store-1")
    state["store"], state["store_bus"] = store, store_bus
    await wait_for(lambda: b.tier.link.healthy and c.tier.link.healthy, what="re-attach to the new store")
    assert await generate(client, "worker-b", PROMPT2) == reference[tuple(PROMPT2)]
    await wait_for(lambda: store.core.index.num_stored >= 4, what="pages put into the new store")
    assert await generate(client, "worker-c", PROMPT2) == reference[tuple(PROMPT2)]
    assert c.tier.stats["loaded_back"] == 4 and c.tier.link.stats["pages_received"] == 4
    store.core.index.check()
