"""HiCache across hosts on a real nats-server: engines that cannot map the kv_store's arena.

The kv_store says it serves host "store-host"; two engine workers say they run
on two other hosts, so each keeps a private staging arena and moves pages by
value through the transfer layer's nats backend (chunked under the server's
max_payload). What one worker writes back, the other fetches and loads: greedy
output token for token, its prefix not recomputed.
"""

from __future__ import annotations

import random
import uuid

import pytest

from bus.nats_transport import BusConfig, connect
from schemas.engine import SamplingParams
from services.kv_store.actor import KVStoreActor
from services.kv_store.config import KVStoreConfig
from services.workers import WorkerConfig
from services.workers.actor import WorkerActor
from tests.streaming import worker_tokens
from tests.waiting import wait_for

pytestmark = [pytest.mark.anyio, pytest.mark.integration]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [random.Random(21).randrange(100, 20000) for _ in range(150)]  # 9 full pages + 6 tokens



async def test_pages_cross_hosts_through_a_real_nats_server(nats_url, model_dir):
    from services.engine import LLMEngine

    config = WorkerConfig(model=str(model_dir), kv_cache_memory=0.02, max_running_requests=2, load_tokenizer=False,
                          hicache=True, hicache_write_policy="write_through", hicache_reconnect_interval=0.05,
                          hicache_store_host="store-host")
    reference = LLMEngine(config.engine_config.replace(enable_prefix_caching=False)).generate_sync(
        [PROMPT], GREEDY)[0].token_ids
    actors, buses = [], []

    async def start(actor):
        bus = await connect(BusConfig(nats_url=nats_url, request_timeout=60))
        await actor.start(bus)
        actors.append(actor)
        buses.append(bus)
        return actor

    try:
        store = await start(KVStoreActor(KVStoreConfig(host_id="store-host", hicache_size=0.1, memory_reserve=0.0),
                                         worker_id=f"kv_store-{uuid.uuid4().hex[:6]}"))
        b = await start(WorkerActor(config.replace(host_id="host-b"), worker_id=f"b-{uuid.uuid4().hex[:6]}"))
        c = await start(WorkerActor(config.replace(host_id="host-c"), worker_id=f"c-{uuid.uuid4().hex[:6]}"))
        await wait_for(lambda: b.tier.is_attached and c.tier.is_attached, what="workers attached")
        client = buses[0]

        async def generate(worker_id):
            return await worker_tokens(client, worker_id, PROMPT, GREEDY)

        assert await generate(b.worker_id) == reference
        await wait_for(lambda: store.core.index.num_stored >= 9, what=f"pages put into the store {b.tier.link.stats} {b.tier.stats}")
        assert client.max_payload < 9 * c.tier.page_bytes  # the batch crossed in several chunks
        assert await generate(c.worker_id) == reference
        assert c.tier.stats["loaded_back"] == 9 and c.tier.link.stats["pages_received"] == 9
        assert c.engine.stats.num_prefill_tokens == len(PROMPT) - 9 * 16
        assert store.core.counters["remote_in"] >= 9 and store.core.counters["remote_out"] == 9
        store.core.index.check()
    finally:
        for actor, bus in zip(reversed(actors), reversed(buses)):
            await bus.close()
            await actor.stop()
