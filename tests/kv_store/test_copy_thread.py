"""The HiCache client's copies on the CPU: what the copy thread runs first, and the arena mapped ahead.

A request waits for its load-back; nobody waits for a write-back but the page it frees. So a load
queued behind write-backs runs as soon as the copy in progress ends, ahead of the rest. And the
client maps the arena's pages into its process before the copy thread needs them.
"""

from __future__ import annotations

import threading

import torch

from services.engine.kv_pool import KVPool
from services.engine.model_config import ModelConfig
from services.kv_store.client import HostTierClient
from services.kv_store.config import KVStoreConfig
from services.kv_store.links import LocalLink
from services.kv_store.store import StoreCore

PAGE = 16


def tokens_of(i: int) -> tuple[int, ...]:
    return tuple(range(i * PAGE, (i + 1) * PAGE))


def test_a_load_runs_before_the_write_backs_queued_ahead_of_it(tiny_model):
    core = StoreCore(KVStoreConfig(hicache_size=0.05, memory_reserve=0.0))
    pool = KVPool(ModelConfig.from_dir(tiny_model), 8, PAGE, torch.float32, torch.device("cpu"))
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(0)))
    client = HostTierClient(LocalLink(core), owner="c")
    client.bind(pool)
    try:
        assert client.write_back(1000, 0, tokens_of(0), 0)
        assert client.wait_written(30.0) == [(0, True)]  # L2 holds page 0

        order: list[tuple[str, int]] = []
        entered, opened = threading.Event(), threading.Event()
        write, load = client._write_job, client._load_job

        def gated_write(arena, slot, page_hash, parent_hash, tokens, page_id, staged):
            order.append(("write", page_id))
            if page_id == 1:  # the copy in progress while the others queue
                entered.set()
                assert opened.wait(60), "the test never released the gate"
            write(arena, slot, page_hash, parent_hash, tokens, page_id, staged)

        def recorded_load(ticket, *args):
            order.append(("load", ticket))
            load(ticket, *args)

        client._write_job, client._load_job = gated_write, recorded_load
        assert client.write_back(1001, 1000, tokens_of(1), 1)
        assert entered.wait(60)
        for p in (2, 3, 4):
            assert client.write_back(1000 + p, 999 + p, tokens_of(p), p)
        assert client.lookup([1000]) == 1
        ticket = client.start_load([1000], [tokens_of(0)], [7])
        assert client.num_queued == 4
        opened.set()
        assert client.wait_loaded(30.0) == [(ticket, 1)]
        written: list = []
        while len(written) < 4:
            got = client.wait_written(30.0)
            assert got, "a write-back did not land"
            written += got
        assert sorted(written) == [(p, True) for p in (1, 2, 3, 4)]
        assert order == [("write", 1), ("load", ticket), ("write", 2), ("write", 3), ("write", 4)]
        assert torch.equal(pool.data[7], pool.data[0])
    finally:
        client.close()
        core.close()


def mapped_bytes(name: str) -> list[int]:
    """Resident bytes of each of this process's mappings of the shared-memory segment ``name``."""
    out, current = [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:  # a mapping's first line
                current = line.rstrip().endswith("/dev/shm/" + name)
            elif current and line.startswith("Rss:"):
                out.append(int(line.split()[1]) * 1024)
    return sorted(out)


def test_the_client_maps_the_arena_ahead_unless_told_not_to(tiny_model):
    pool = KVPool(ModelConfig.from_dir(tiny_model), 8, PAGE, torch.float32, torch.device("cpu"))
    for prefault in (True, False):
        core = StoreCore(KVStoreConfig(hicache_size=0.004, memory_reserve=0.0, hicache_prefault=False))
        client = HostTierClient(LocalLink(core), owner="c", prefault=prefault)
        try:
            client.bind(pool)  # the store makes the arena; the client maps it (a second mapping)
            total = core.arena.layout.total_bytes
            if prefault:
                client.prefault_thread.join(60)
                assert not client.prefault_thread.is_alive()
                store_side, client_side = mapped_bytes(core.arena.name)
                assert store_side < total // 4 and client_side >= total - 4096
            else:
                assert client.prefault_thread is None
                assert max(mapped_bytes(core.arena.name)) < total // 4
        finally:
            client.close()
            core.close()
