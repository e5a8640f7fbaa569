"""A load-back is accounted the same whether it ran on the engine thread or on the copy thread.

The asynchronous path (``start_load`` -> ``poll_loaded``) once kept its own copy of the counters
and never fed the load-back histogram, so ``kvbus_hicache_load_back_seconds`` missed every long
load. Here the client's ``observe_load_back`` is a real Prometheus histogram (as
``WorkerMetrics.attach_tier`` wires it) and both paths load the same pages.
"""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry, Histogram

from services.engine.kv_pool import KVPool
from services.engine.model_config import ModelConfig
from services.kv_store.client import HostTierClient
from services.kv_store.config import KVStoreConfig
from services.kv_store.links import LocalLink
from services.kv_store.store import StoreCore

PAGE = 16
HASHES = [1000, 1001, 1002]


def tokens_of(i: int) -> tuple[int, ...]:
    return tuple(range(i * PAGE, (i + 1) * PAGE))


TOKENS = [tokens_of(i) for i in range(len(HASHES))]


@pytest.fixture()
def loaded(tiny_model):
    """A CPU client whose L2 holds pages 0..2 of a seeded pool as HASHES, and the histogram it feeds."""
    core = StoreCore(KVStoreConfig(hicache_size=0.05, memory_reserve=0.0, hicache_prefault=False))
    pool = KVPool(ModelConfig.from_dir(tiny_model), 10, PAGE, torch.float32, torch.device("cpu"))
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(3)))
    client = HostTierClient(LocalLink(core), owner="acct", prefault=False)
    registry = CollectorRegistry()
    histogram = Histogram("kvbus_hicache_load_back_seconds", "load-backs", registry=registry)
    client.observe_load_back = histogram.observe
    client.bind(pool)
    for page_id, (h, parent) in enumerate(zip(HASHES, [0, *HASHES[:-1]])):
        assert client.write_back(h, parent, TOKENS[page_id], page_id)
    written: list = []
    while len(written) < len(HASHES):
        got = client.wait_written(30.0)
        assert got, "a write-back did not land"
        written += got
    assert sorted(written) == [(p, True) for p in range(len(HASHES))]
    assert client.lookup(HASHES) == len(HASHES)
    yield client, pool, registry
    client.close()
    core.close()


def observed(registry: CollectorRegistry) -> tuple[float, float]:
    return (registry.get_sample_value("kvbus_hicache_load_back_seconds_count"),
            registry.get_sample_value("kvbus_hicache_load_back_seconds_sum"))


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def test_an_asynchronous_load_feeds_the_histogram_and_counts_as_a_synchronous_one(loaded):
    client, pool, registry = loaded
    assert observed(registry) == (0, 0)

    before = dict(client.stats)
    assert client.load_back(HASHES, TOKENS, [3, 4, 5]) == 3
    sync = delta(before, client.stats)
    count, total = observed(registry)
    assert count == 1 and total == pytest.approx(sync["load_back_seconds"])

    before = dict(client.stats)
    ticket = client.start_load(HASHES, TOKENS, [6, 7, 8])
    assert client.wait_loaded(30.0) == [(ticket, 3)]
    asynchronous = delta(before, client.stats)
    count, total_after = observed(registry)
    assert count == 2, "the asynchronous load did not reach the load-back histogram"
    assert asynchronous["load_back_seconds"] > 0
    assert total_after - total == pytest.approx(asynchronous["load_back_seconds"])
    seconds = ("load_back_seconds",)
    assert {k: v for k, v in asynchronous.items() if k not in seconds} == \
           {k: v for k, v in sync.items() if k not in seconds}
    assert asynchronous["loaded_back"] == 3 and asynchronous["hits"] == 1
    assert asynchronous["load_back_bytes"] == 3 * client.page_bytes
    for src, sync_dst, async_dst in zip((0, 1, 2), (3, 4, 5), (6, 7, 8)):
        assert torch.equal(pool.data[sync_dst], pool.data[src]) and torch.equal(pool.data[async_dst], pool.data[src])


def test_an_asynchronous_load_failing_verification_is_observed_and_forgets_the_page(loaded):
    client, pool, registry = loaded
    client.arena.invalidate(client.mirror[HASHES[1]])  # evicted and refilled after the lookup
    before = dict(client.stats)
    ticket = client.start_load(HASHES, TOKENS, [6, 7, 8])
    assert client.wait_loaded(30.0) == [(ticket, 1)]
    got = delta(before, client.stats)
    assert got["loaded_back"] == 1 and got["verify_failed"] == 1 and got["hits"] == 1
    assert HASHES[1] not in client.mirror and HASHES[0] in client.mirror
    assert observed(registry)[0] == 1
    assert torch.equal(pool.data[6], pool.data[0])
