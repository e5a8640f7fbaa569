"""The kv_store actor with two engine workers on the in-memory bus.

Pages written back by one worker are loaded by the other (through the shared
arena; the bus carries only metadata), KV events arrive in order with
monotonic ids, and a kv_store that dies leaves the workers serving (by
recomputing) until a new one starts, when hits resume.
"""

from __future__ import annotations

import random

import pytest

from bus.memory import MemoryNetwork, memory_bus
from bus.subjects import KV_EVENTS, KV_EVENTS_DUMP
from schemas.engine import SamplingParams
from schemas.kv_store import KVDumpRequest
from services.kv_store.actor import KVStoreActor
from services.kv_store.config import KVStoreConfig
from services.workers import WorkerConfig
from services.workers.actor import WorkerActor
from tests.streaming import cold_tokens, worker_tokens
from tests.waiting import wait_for

pytestmark = pytest.mark.anyio
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [random.Random(7).randrange(100, 20000) for _ in range(70)]  # 4 full pages + 6 tokens



@pytest.fixture(scope="module")
def config(model_dir):
    return WorkerConfig(model=str(model_dir), kv_cache_memory=0.02, max_running_requests=2, load_tokenizer=False,
                        hicache=True, hicache_write_policy="write_through", hicache_reconnect_interval=0.05,
                        hicache_timeout=5.0, host_id="test-host")


@pytest.fixture(scope="module")
def reference(config):
    from services.engine import LLMEngine

    engine = LLMEngine(config.engine_config.replace(enable_prefix_caching=False))
    return engine.generate_sync([PROMPT], GREEDY)[0].token_ids


async def start_store(network, worker_id="kv_store-0"):
    bus = memory_bus(network)
    store = KVStoreActor(KVStoreConfig(host_id="test-host", hicache_size=0.1, memory_reserve=0.0),
                         worker_id=worker_id)
    await store.start(bus)
    return store, bus


async def stop(actor, bus):
    await bus.close()
    await actor.stop()


@pytest.fixture
async def system(config):
    network = MemoryNetwork()
    store, store_bus = await start_store(network)
    workers, buses = [], []
    for wid in ("worker-a", "worker-b"):
        bus = memory_bus(network)
        worker = WorkerActor(config, worker_id=wid)
        await worker.start(bus)
        workers.append(worker)
        buses.append(bus)
    client = memory_bus(network)
    state = {"store": store, "store_bus": store_bus}
    yield network, state, workers, client
    for worker, bus in zip(workers, buses):
        await stop(worker, bus)
    if state["store"] is not None:
        await stop(state["store"], state["store_bus"])
    await client.close()


async def generate(client, worker_id: str, prompt: list[int] = PROMPT, **fields) -> list[int]:
    """Greedy tokens of ``prompt`` streamed from ``worker_id``; ``fields``: more WorkerGenerateRequest fields."""
    return await worker_tokens(client, worker_id, prompt, GREEDY, **fields)


async def test_pages_from_one_worker_load_in_another_with_kv_events(system, reference):
    network, state, (a, b), client = system
    store = state["store"]
    batches = []

    async def on_event(batch):
        batches.append(batch)

    await client.subscribe(KV_EVENTS, on_event)
    await wait_for(lambda: a.tier.is_attached and b.tier.is_attached, what="workers attached")
    assert await generate(client, "worker-a") == reference
    # write-through: PROMPT's 4 full pages, then the tail (the answer's computed rows, block_manager.py)
    await wait_for(lambda: store.core.index.num_stored >= 5, what="write-through commits")
    assert await generate(client, "worker-b") == reference
    assert b.tier.stats["loaded_back"] == 4  # (70 - 1) // 16 pages, none recomputed
    assert b.engine.stats.num_prefill_tokens == len(PROMPT) - 4 * 16
    # KV events: device pages of both workers and the host tier of the store, ids 1, 2, 3... per publisher
    await wait_for(lambda: {x.worker_id for x in batches} >= {"worker-a", "worker-b", "kv_store-0"}, what="events")
    await wait_for(lambda: sum(len(e.page_hashes) for x in batches if x.worker_id == "kv_store-0" for e in x.events
                               if e.kind == "stored") >= 5, what="the store's events of all 5 pages")
    by_pub: dict[str, list[int]] = {}
    for batch in batches:
        by_pub.setdefault(batch.worker_id, []).append(batch.event_id)
        assert all(len(e.page_hashes) == len(e.parent_hashes) for e in batch.events)
    for ids in by_pub.values():
        assert ids == list(range(1, len(ids) + 1))
    host = [h for x in batches if x.worker_id == "kv_store-0" for e in x.events if e.tier == "host"
            and e.kind == "stored" for h in e.page_hashes]
    device = [h for x in batches if x.worker_id == "worker-a" for e in x.events if e.tier == "device"
              and e.kind == "stored" for h in e.page_hashes]
    assert host == device and len(host) == 5  # all written through, in order
    dump = await client.request(KV_EVENTS_DUMP, KVDumpRequest(), worker_id="kv_store-0")
    assert set(dump.events[0].page_hashes) == set(host)
    dump_a = await client.request(KV_EVENTS_DUMP, KVDumpRequest(), worker_id="worker-a")
    assert set(dump_a.events[0].page_hashes) == set(device)
    store.core.index.check()


async def test_store_dies_workers_recompute_then_hits_resume(system, reference):
    network, state, (a, b), client = system
    await wait_for(lambda: a.tier.is_attached and b.tier.is_attached, what="workers attached")
    old_arena = a.tier.arena.name
    await stop(state["store"], state["store_bus"])
    state["store"] = None
    b.engine.block_manager.evict_all_cached()
    for _ in range(2):  # still served, token for token: pages still mapped are verified, the rest recomputed
        assert await generate(client, "worker-b") == reference
        b.engine.block_manager.evict_all_cached()
    assert not b.tier.link.healthy
    loaded = b.tier.stats["loaded_back"]
    store, store_bus = await start_store(network, "kv_store-1")
    state["store"], state["store_bus"] = store, store_bus
    await wait_for(lambda: a.tier.arena.name != old_arena and b.tier.arena.name == a.tier.arena.name,
                   what="re-attach to the new arena")
    assert await generate(client, "worker-a") == reference
    await wait_for(lambda: store.core.index.num_stored >= 4, what="write-through commits")
    b.engine.block_manager.evict_all_cached()
    assert await generate(client, "worker-b") == reference
    assert b.tier.stats["loaded_back"] == loaded + 4


async def test_a_decode_worker_counts_host_tier_pages_as_held(system, config, reference):
    """1P1D with HiCache: pages in L2 (written by another worker) are loaded by the decode worker,
    so they are not sent by the prefill worker either: only the page with the last token crosses."""
    from services.workers.decode import DecodeActor
    from services.workers.prefill import PrefillActor

    network, state, (a, _), client = system
    store = state["store"]
    await wait_for(lambda: a.tier.is_attached, what="worker attached")
    assert await generate(client, "worker-a") == reference
    await wait_for(lambda: store.core.index.num_stored >= 4, what="write-through commits")
    pair, buses = [], []
    for cls, wid in ((PrefillActor, "prefill-x"), (DecodeActor, "decode-x")):
        bus = memory_bus(network)
        actor = cls(config.replace(kv_transfer="nats"), worker_id=wid)
        await actor.start(bus)
        pair.append(actor)
        buses.append(bus)
    prefill, decode = pair
    try:
        await wait_for(lambda: prefill.tier.is_attached and decode.tier.is_attached, what="pair attached")
        assert await generate(client, "decode-x", prefill_worker_id="prefill-x") == reference
        assert decode.num_remote_prefills == 1
        assert (decode.transfer_pages_skipped, decode.transfer_pages) == (4, 1)
        assert decode.tier.stats["loaded_back"] == 4 and prefill.tier.stats["loaded_back"] == 4
        assert decode.engine.scheduler.num_import_gaps == 0
    finally:
        for actor, bus in zip(pair, buses):
            await stop(actor, bus)


async def test_a_tail_one_worker_wrote_is_found_by_another_through_the_store(system, config):
    """Turn 2 of a chat on another worker: its prefetch finds the full pages, then (one `first_of`
    lookup) the tail worker-a left: the answer's computed rows are loaded, not recomputed."""
    from services.engine import LLMEngine

    network, state, (a, b), client = system
    await wait_for(lambda: a.tier.is_attached and b.tier.is_attached, what="workers attached")
    answer = await generate(client, "worker-a")  # PROMPT's 70 and 6 generated: 4 pages + 11 computed rows
    await wait_for(lambda: state["store"].core.index.num_stored >= 5, what="write-through of the pages and the tail")
    turn2 = PROMPT + answer + [1000 + i for i in range(9)]
    ref = cold_tokens(config.engine_config, turn2, GREEDY)
    assert await generate(client, "worker-b", turn2) == ref
    assert b.engine.block_manager.num_tail_loads == 1 and b.tier.stats["loaded_back"] == 5
    assert b.engine.stats.num_prefill_tokens == len(turn2) - (len(PROMPT) + len(answer) - 1)
