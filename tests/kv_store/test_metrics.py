"""Prometheus series of the kv_store and of engine workers with HiCache (issue 7, observability).

Scraped over real HTTP from actors on the in-memory bus: the series move with
the traffic (a write-back, a load-back hit, the latency histogram) and equal
the health-detail counters; the write policy shows in them; the store's series
follow its tiers (spills, promotions, corrupted L3 files).
"""

from __future__ import annotations

import asyncio
import random

import httpx
import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bus.memory import MemoryNetwork, memory_bus
from services.kv_store.actor import KVStoreActor
from services.kv_store.config import KVStoreConfig
from services.kv_store.store import StoreCore
from services.natsd import free_port
from services.workers import WorkerConfig
from services.workers.actor import WorkerActor
from tests.kv_store.test_actor_bus import generate as stream_greedy
from tests.waiting import wait_for

pytestmark = pytest.mark.anyio
PROMPT = [random.Random(11).randrange(10, 300) for _ in range(70)]  # 4 full pages of 16 + 6 tokens
PAGE = 16


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels minus the identity ones) -> value."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("worker_id", "role", "host_id")))
            out[(s.name, labels)] = s.value
    return out


async def scrape(url: str) -> dict[tuple[str, tuple], float]:
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.get(url)
        assert r.status_code == 200, r.text
        return samples(r.text)



def worker_config(tiny_model, policy: str) -> WorkerConfig:
    return WorkerConfig(model=str(tiny_model), kv_cache_memory=0.002, max_running_requests=2, load_tokenizer=False,
                        hicache=True, hicache_write_policy=policy, hicache_reconnect_interval=0.05,
                        hicache_timeout=5.0, host_id="metrics-host", metrics_port=free_port())


async def start_system(tiny_model, policy: str, worker_ids: tuple[str, ...]):
    network = MemoryNetwork()
    started = []
    store = KVStoreActor(KVStoreConfig(host_id="metrics-host", hicache_size=0.05, memory_reserve=0.0,
                                       metrics_port=free_port()), worker_id="kv_store-m")
    bus = memory_bus(network)
    await store.start(bus)
    started.append((store, bus))
    workers = []
    for wid in worker_ids:
        bus = memory_bus(network)
        worker = WorkerActor(worker_config(tiny_model, policy), worker_id=wid)
        await worker.start(bus)
        started.append((worker, bus))
        workers.append(worker)
    await wait_for(lambda: all(w.tier.is_attached for w in workers), what="workers attached")
    return network, store, workers, started


async def stop_all(started) -> None:
    for actor, bus in reversed(started):
        await bus.close()
        await actor.stop()


async def generate(client, worker_id: str) -> list[int]:
    return await stream_greedy(client, worker_id, PROMPT)  # greedy, 6 tokens (test_actor_bus.GREEDY)


WRITTEN = 5
"""Pages worker-a writes back for PROMPT: its 4 full pages and the tail (the answer's computed rows,
block_manager.py); a later request for PROMPT alone loads the 4 full pages."""


def hicache(detail: dict[str, str], key: str) -> float:
    return float(detail[f"hicache_{key}"])


async def test_scraped_series_move_and_equal_the_health_detail(tiny_model):
    network, store, (a, b), started = await start_system(tiny_model, "write_through", ("worker-a", "worker-b"))
    client = memory_bus(network)
    try:
        assert a.metrics_server.port == a.config.metrics_port and store.metrics_server is not None
        before = await scrape(b.metrics_server.url)
        assert before[("kvbus_hicache_loaded_back_pages_total", ())] == 0
        assert before[("kvbus_hicache_load_back_seconds_count", ())] == 0
        assert before[("kvbus_hicache_attached", ())] == 1

        first = await generate(client, "worker-a")
        await wait_for(lambda: store.core.counters["committed"] >= WRITTEN, what="write-through commits")
        m = await scrape(a.metrics_server.url)
        d = a.health_detail()
        assert m[("kvbus_hicache_written_back_pages_total", ())] == hicache(d, "written_back") == WRITTEN
        assert m[("kvbus_hicache_written_back_bytes_total", ())] == hicache(d, "write_back_bytes") == WRITTEN * a.tier.page_bytes
        assert m[("kvbus_hicache_written_back_sync_pages_total", ())] == hicache(d, "written_sync") == 0
        assert m[("kvbus_engine_prompt_tokens_total", ())] == len(PROMPT)
        assert m[("kvbus_engine_prefix_cache_hit_tokens_total", (("tier", "device"),))] == 0
        assert m[("kvbus_engine_kv_pages_total", ())] == int(d["total_pages"])
        assert m[("kvbus_engine_kv_pages_free", ())] == int(d["free_pages"])
        assert m[("kvbus_num_requests_running", ())] == 0
        # idle: nothing waits, so nothing is held
        assert m[("kvbus_engine_kv_pages_held", ())] == m[("kvbus_engine_kv_held_pages_evicted_total", ())] == 0
        assert d["held_pages"] == d["held_pages_evicted"] == d["preemptions"] == "0"  # the health detail's view
        assert m[("kvbus_engine_kv_pages_evicted_total", ())] == int(d["pages_evicted"])
        used = int(d["total_pages"]) - int(d["free_pages"])
        assert m[("kvbus_kv_cache_usage_perc", ())] == used / int(d["total_pages"])

        assert await generate(client, "worker-b") == first  # its 4 leading pages come from L2
        m = await scrape(b.metrics_server.url)
        d = b.health_detail()
        assert m[("kvbus_hicache_loaded_back_pages_total", ())] == hicache(d, "loaded_back") == 4
        assert m[("kvbus_hicache_loaded_back_bytes_total", ())] == hicache(d, "load_back_bytes") == 4 * b.tier.page_bytes
        assert m[("kvbus_hicache_lookups_total", (("result", "hit"),))] == hicache(d, "hits") == 1
        assert m[("kvbus_hicache_load_back_seconds_count", ())] == 1
        # alone on its engine, the load ran at admission (synchronously): none on the copy thread
        assert m[("kvbus_hicache_async_loads_total", ())] == b.engine.block_manager.num_async_loads == 0
        assert m[("kvbus_hicache_loads_given_up_total", ())] == m[("kvbus_hicache_loads_inflight", ())] == 0
        assert m[("kvbus_hicache_load_back_seconds_sum", ())] == pytest.approx(hicache(d, "load_back_seconds"),
                                                                             rel=1e-3, abs=1e-6)
        assert m[("kvbus_hicache_load_back_seconds_bucket", (("le", "+Inf"),))] == 1
        assert m[("kvbus_engine_prefix_cache_hit_tokens_total", (("tier", "host"),))] == 4 * PAGE
        assert m[("kvbus_engine_prefix_cache_hit_tokens_total", (("tier", "device"),))] == 0
        assert m[("kvbus_engine_prompt_tokens_total", ())] == len(PROMPT)
        assert await generate(client, "worker-a") == first  # worker-a's L1 still holds the prompt
        m = await scrape(a.metrics_server.url)
        # 4 pages, then the rows of its earlier run's 5th page but the last token's
        assert m[("kvbus_engine_prefix_cache_hit_tokens_total", (("tier", "device"),))] == len(PROMPT) - 1
        assert m[("kvbus_engine_prefix_cache_hit_tokens_total", (("tier", "host"),))] == 0
        assert m[("kvbus_engine_prompt_tokens_total", ())] == 2 * len(PROMPT)

        s = await scrape(store.metrics_server.url)
        sd = store.health_detail()
        assert s[("kvbus_kv_store_committed_pages_total", ())] == int(sd["committed"]) == WRITTEN
        assert s[("kvbus_kv_store_slots", (("state", "stored"),))] == int(sd["stored"]) == WRITTEN
        assert s[("kvbus_kv_store_slots", (("state", "leased"),))] == int(sd["leased"])
        assert s[("kvbus_kv_store_slots", (("state", "free"),))] == int(sd["free"])
        assert s[("kvbus_kv_store_slots_capacity", ())] == int(sd["slots"])
        assert s[("kvbus_kv_store_hits_total", (("tier", "host"),))] == int(sd["hits_host"]) >= 4
        assert s[("kvbus_kv_store_bytes", (("tier", "host"),))] == WRITTEN * a.tier.page_bytes
    finally:
        await client.close()
        await stop_all(started)
    with pytest.raises(OSError):  # the endpoints went with the actors
        await asyncio.open_connection("127.0.0.1", b.config.metrics_port)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
async def test_write_policy_shows_in_the_written_back_series(tiny_model, policy):
    network, store, (w,), started = await start_system(tiny_model, policy, ("worker-p",))
    client = memory_bus(network)
    try:
        await generate(client, "worker-p")
        if policy == "write_through":  # copied as computed, off the engine thread
            await wait_for(lambda: store.core.counters["committed"] >= WRITTEN, what="write-through commits")
        m = await scrape(w.metrics_server.url)
        assert m[("kvbus_hicache_written_back_pages_total", ())] == (WRITTEN if policy == "write_through" else 0)
        evicted = m[("kvbus_engine_kv_pages_evicted_total", ())]
        w.engine.block_manager.evict_all_cached()  # write_back: the pages reach L2 only now, on eviction
        await wait_for(lambda: store.core.counters["committed"] >= WRITTEN, what="commits")
        m = await scrape(w.metrics_server.url)
        d = w.health_detail()
        assert m[("kvbus_hicache_written_back_pages_total", ())] == hicache(d, "written_back") == WRITTEN
        # write_back with an idle engine: no step ran to copy ahead of eviction, so eviction copied them
        assert m[("kvbus_hicache_written_back_sync_pages_total", ())] == (0 if policy == "write_through" else WRITTEN)
        assert m[("kvbus_engine_kv_pages_evicted_total", ())] >= evicted + WRITTEN
        assert m[("kvbus_hicache_write_back_queue_depth", ())] == 0
        s = await scrape(store.metrics_server.url)
        assert s[("kvbus_kv_store_committed_pages_total", ())] == WRITTEN
    finally:
        await client.close()
        await stop_all(started)


PB, PS = 256, 4


async def test_store_series_follow_spills_promotions_and_corruption(tmp_path):
    cfg = KVStoreConfig(host_id="h", hicache_size=3 * PB / 1024**3, memory_reserve=0.0,
                        hicache_storage_dir=str(tmp_path), hicache_l3_admit_hits=0)
    actor = KVStoreActor(cfg, worker_id="kv_store-u")

    def scraped():
        return samples(generate_latest(actor.metrics.registry).decode())

    assert scraped() == {("kvbus_kv_store_attached", ()): 0}  # no arena before the first engine
    actor.core = core = StoreCore(cfg)
    arena = core.attach("e", "k", PB, PS, PB)
    for h in range(1, 6):  # 5 pages through 3 slots: 1 and 2 spill to L3
        (slot,) = core.lease("e", 1)
        arena.write(slot, h, [h] * PS, np.full(PB, h, np.uint8))
        core.commit("e", [(slot, h, h - 1)])
    m = scraped()
    assert m[("kvbus_kv_store_pages", (("tier", "host"),))] == 3
    assert m[("kvbus_kv_store_pages", (("tier", "disk"),))] == 2
    assert m[("kvbus_kv_store_bytes", (("tier", "disk"),))] == 2 * PB
    assert m[("kvbus_kv_store_spilled_pages_total", ())] == 2
    assert m[("kvbus_kv_store_spilled_bytes_total", ())] == 2 * PB
    assert m[("kvbus_kv_store_evicted_pages_total", (("tier", "host"),))] == 2
    assert m[("kvbus_kv_store_committed_pages_total", ())] == 5
    path = core.disk._path(2)
    path.write_bytes(path.read_bytes()[:-1] + b"\xff")  # page 2's file is corrupted
    assert [h for h, _ in core.lookup([1, 2, 3])] == [1]  # 1 promoted; 2 dropped: a miss
    m = scraped()
    assert m[("kvbus_kv_store_promoted_pages_total", ())] == 1
    assert m[("kvbus_kv_store_hits_total", (("tier", "disk"),))] == 1
    assert m[("kvbus_kv_store_hits_total", (("tier", "host"),))] == 0
    assert m[("kvbus_kv_store_corrupted_pages_total", ())] == 1
    assert m[("kvbus_kv_store_misses_total", (("tier", "disk"),))] == 1
    assert m[("kvbus_kv_store_misses_total", (("tier", "host"),))] == 2
    detail = actor.health_detail()
    assert m[("kvbus_kv_store_evicted_pages_total", (("tier", "host"),))] == int(detail["evicted_host"]) == 3
    assert m[("kvbus_kv_store_slots", (("state", "stored"),))] == int(detail["stored"]) == 3
    assert m[("kvbus_kv_store_pages", (("tier", "disk"),))] == int(detail["disk_pages"])
    core.close()


async def test_prefill_and_decode_workers_serve_their_series(tiny_model):
    from services.workers.decode import DecodeActor
    from services.workers.prefill import PrefillActor

    network, store, _, started = await start_system(tiny_model, "write_back", ())
    try:
        for cls, wid in ((PrefillActor, "prefill-m"), (DecodeActor, "decode-m")):
            bus = memory_bus(network)
            worker = cls(worker_config(tiny_model, "write_back"), worker_id=wid)
            await worker.start(bus)
            started.append((worker, bus))
            await wait_for(lambda: worker.tier.is_attached, what=f"{wid} attached")
            async with httpx.AsyncClient(timeout=30) as client:
                text = (await client.get(worker.metrics_server.url)).text
            fams = {f.name: f for f in text_string_to_metric_families(text)}
            (total,) = fams["kvbus_engine_kv_pages_total"].samples
            assert total.labels == {"role": cls.role, "worker_id": wid}
            assert total.value == worker.engine.block_manager.num_pages > 0
            assert fams["kvbus_hicache_attached"].samples[0].value == 1
            assert fams["kvbus_hicache_load_back_seconds"].samples[0].labels["role"] == cls.role
            if cls is DecodeActor:  # KV received from prefill workers, and the pages it held instead
                for name in ("received_bytes", "received_pages", "skipped_pages", "import_gaps"):
                    assert fams[f"kvbus_kv_transfer_{name}"].samples[0].value == 0
            else:
                assert "kvbus_kv_transfer_received_bytes" not in fams
    finally:
        await stop_all(started)
