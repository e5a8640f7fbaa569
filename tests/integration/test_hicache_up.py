"""HiCache through ``kvbus up --hicache`` on a real nats-server: real processes, real arena.

An aggregated worker with a tiny KV pool (L1 evicts) and the host's kv_store:
a prompt whose pages left L1 is served from L2 (loaded back, not recomputed)
with the same greedy tokens as its first, cold run. The worker's and the store's
Prometheus endpoints, printed by ``kvbus up``, show that traffic.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bus.nats_transport import BusConfig, connect
from bus.subjects import GENERATE_ONCE, WORKER_HEALTH
from schemas.common import HealthRequest
from schemas.engine import SamplingParams
from schemas.generate import GenerateRequest
from services.local_system import LocalSystem

pytestmark = [pytest.mark.slow]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


async def generate(nats_url: str, prompt: list[int]) -> tuple[list[int], int]:
    bus = await connect(BusConfig(nats_url=nats_url, request_timeout=120))
    try:
        reply = await bus.request(GENERATE_ONCE, GenerateRequest(prompt_token_ids=prompt, sampling=GREEDY))
        return reply.token_ids, reply.usage.cached_prompt_tokens
    finally:
        await bus.close()


async def health(nats_url: str, role: str, worker_id: str) -> dict:
    bus = await connect(BusConfig(nats_url=nats_url))
    try:
        return (await bus.request(WORKER_HEALTH, HealthRequest(), role=role, worker_id=worker_id)).detail
    finally:
        await bus.close()


async def wait_detail(nats_url, role, wid, cond, timeout=60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        detail = await health(nats_url, role, wid)
        if cond(detail):
            return detail
        if time.monotonic() > deadline:
            raise AssertionError(f"{wid}: {detail}")
        await asyncio.sleep(0.2)


def scrape(url: str) -> dict[str, float]:
    """Sample name (with its labels) -> value, identity labels left out."""
    text = httpx.get(url, timeout=30).raise_for_status().text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k not in ("worker_id", "role", "host_id"))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_l2_hits_through_kvbus_up(model_dir):
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 20000) for _ in range(200)] for _ in range(4)]  # 12 full pages each
    # 0.03 GB: about 40 pages of SmolLM2's 16 tokens in float32 (twice as many in bfloat16, dtype auto on
    # some CPUs); 4 prompts of 13 pages do not fit.
    with LocalSystem("--aggregated", "--hicache", "--kv-cache-memory", "0.03", "--dtype", "float32",
                     model_dir=model_dir) as system:
        try:
            url = system.nats_url
            asyncio.run(wait_detail(url, "worker", "worker-0", lambda d: d.get("hicache_attached") == "1"))
            cold = [asyncio.run(generate(url, p)) for p in prompts]
            assert all(cached == 0 for _, cached in cold)
            again, cached = asyncio.run(generate(url, prompts[0]))  # its pages left L1
            assert again == cold[0][0]
            assert cached == 12 * 16, cached  # L1 + L2 hits: only the last partial page is computed
            detail = asyncio.run(health(url, "worker", "worker-0"))
            assert float(detail["hicache_loaded_back"]) >= 1, detail  # the rest were still L1 hits
            store = asyncio.run(health(url, "kv_store", "kv_store-0"))
            assert int(store["stored"]) > 0 and int(store["committed"]) > 0, store
            assert set(system.metrics_urls) == {"tokenizer-0", "kv_store-0", "router-0", "worker-0"}, system.metrics_urls
            worker = scrape(system.metrics_urls["worker-0"])
            assert worker["kvbus_hicache_loaded_back_pages_total"] == float(detail["hicache_loaded_back"])
            assert worker["kvbus_hicache_load_back_seconds_count"] >= 1
            assert worker["kvbus_engine_prefix_cache_hit_tokens_total{tier=host}"] >= 16
            assert worker["kvbus_hicache_written_back_pages_total"] >= worker["kvbus_hicache_loaded_back_pages_total"]
            s = scrape(system.metrics_urls["kv_store-0"])
            assert s["kvbus_kv_store_committed_pages_total"] >= int(store["committed"]) > 0
            # each cold prompt's lookup reached the store and missed (the warm one hit the worker's own map)
            assert s["kvbus_kv_store_misses_total{tier=host}"] >= len(prompts)
            slots = [s[f"kvbus_kv_store_slots{{state={k}}}"] for k in ("stored", "leased", "free")]
            assert slots[0] > 0 and sum(slots) == s["kvbus_kv_store_slots_capacity"], s  # one consistent snapshot
        except BaseException:
            print(system.log(150))
            raise
