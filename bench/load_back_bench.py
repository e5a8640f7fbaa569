"""Load-back on the engine thread (synchronous) vs through the copy thread (asynchronous), per run length.

    python -m bench.load_back_bench            # default model's page shape, 1..32 pages, 30 reps (~10 s)
    python -m bench.load_back_bench --quick    # 5 reps (a check only)

In one process, no model forward: a CPU KV pool with the default model's page shape (pages of
16 tokens), the kv_store core in process (LocalLink) on the real shared-memory arena.

Rows, per run length k (pages):
  sync ms          HostTierClient.load_back on the calling thread: the time the engine step stalls
  async wait ms    start_load .. wait_loaded: the latency the loading request waits (one thread hand-off)
  async stall ms   start_load + poll_loaded on the calling thread: what the step pays when it overlaps
It chose BlockManager.async_load_min_pages (block_manager.ASYNC_LOAD_MIN_PAGES): below it the
synchronous copy stalls the step for less than the hand-off costs the loading request.

Then the write-back of a page into a slot never written before, and a load of the longest run
queued right behind as many write-backs (a burst of evictions or of
write-through copies): its wait with loads taken first (the client's order) against one queue in
the order things were queued (the path before), the two alternating rep by rep. All of it twice:
with L2 committed by the store and mapped by the client ahead (hicache_prefault, the default), and
without (the path before: pages fault in at their first touch).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.common import machine, table

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args(argv)
    reps = 5 if args.quick else args.reps

    from services.engine.kv_pool import KVPool
    from services.engine.model_config import ModelConfig
    from services.models import resolve_model

    mc = ModelConfig.from_dir(resolve_model(None))
    n = 32
    pool = KVPool(mc, 2 * n, args.page_size, torch.float32, torch.device("cpu"))
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(0)))
    print(machine())
    results = {}
    for prefault in (True, False):
        rows, behind, write_ms = measure(pool, args.page_size, reps, prefault)
        results[prefault] = write_ms
        print("L2 committed and mapped ahead (hicache_prefault, the default):" if prefault else
              "L2 neither committed nor mapped ahead (the path before hicache_prefault):")
        print(table(rows, ["pages", "MiB", "sync ms", "async wait ms", "async stall ms", "wait/sync"]))
        first, fifo = (statistics.median(behind[k]) for k in ("first", "fifo"))
        print(f"write-back of a page into a slot never written before: {write_ms:.3f} ms")
        print(f"a load of {n} pages queued behind {n} write-backs: waits {first * 1e3:.2f} ms with loads first, "
              f"{fifo * 1e3:.2f} ms in queue order ({first / fifo:.2f}x)")
    print(f"write-back into a fresh slot, prefault / lazy: {results[True] / results[False]:.2f}x")


def measure(pool, page_size: int, reps: int, prefault: bool):
    from services.kv_store.client import HostTierClient
    from services.kv_store.config import KVStoreConfig
    from services.kv_store.links import LocalLink
    from services.kv_store.store import StoreCore

    sizes = [1, 2, 4, 8, 16, 32]
    n = max(sizes)
    core = StoreCore(KVStoreConfig(hicache_size=pool.num_bytes * 20 / 1024**3, memory_reserve=0.0,
                                   hicache_prefault=prefault))
    client = HostTierClient(LocalLink(core), owner="bench", lease_batch=2 * n, prefault=prefault)
    client.bind(pool)
    for thread in (core.prefault_thread, client.prefault_thread):
        if thread is not None:  # measured once the arena is committed and mapped, as in a running system
            thread.join()
    hashes = [1000 + i for i in range(n)]
    tokens = [tuple(range(i * page_size, (i + 1) * page_size)) for i in range(n)]
    t0 = time.perf_counter()
    for i in range(n):  # leases are capped at 1/8 of the arena per engine: 20 x the pool covers n
        assert client.write_back(hashes[i], 0, tokens[i], i)
    landed = 0
    while landed < n:
        landed += len(client.wait_written(30.0))
    write_ms = (time.perf_counter() - t0) / n * 1e3
    dst = list(range(n, 2 * n))
    rows = []
    for k in sizes:
        assert client.lookup(hashes[:k]) == k
        sync, wait, stall = [], [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            assert client.load_back(hashes[:k], tokens[:k], dst[:k]) == k
            sync.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ticket = client.start_load(hashes[:k], tokens[:k], dst[:k])
            t1 = time.perf_counter()
            got = client.wait_loaded(30.0)
            t2 = time.perf_counter()
            assert got == [(ticket, k)]
            wait.append(t2 - t0)
            stall.append(t1 - t0)
        ms = lambda xs: f"{statistics.median(xs) * 1e3:.3f}"  # noqa: E731
        rows.append([k, f"{k * client.page_bytes / 2**20:.1f}", ms(sync), ms(wait), ms(stall),
                     f"{statistics.median(wait) / statistics.median(sync):.2f}"])
    behind = load_behind_writes(client, hashes, tokens, dst, reps)
    client.close()
    core.close()
    return rows, behind, write_ms


def load_behind_writes(client, hashes, tokens, dst, reps: int) -> dict[str, list[float]]:
    """Seconds from start_load to its landing with ``len(hashes)`` write-backs queued just before."""
    from services.kv_store import client as client_module

    n, kinds = len(hashes), (client_module._LOAD, client_module._WRITE)
    waits: dict[str, list[float]] = {"first": [], "fifo": []}
    fresh = iter(range(10_000, 10**9))
    for rep in range(2 * reps):
        order = "first" if rep % 2 == 0 else "fifo"
        client_module._LOAD = kinds[0] if order == "first" else kinds[1]  # fifo: a load is queued like a write
        try:
            for i in range(n):  # new hashes: a page L2 holds already is not copied again
                assert client.write_back(next(fresh), 0, tokens[i], i)
            t0 = time.perf_counter()
            ticket = client.start_load(hashes, tokens, dst)
            assert client.wait_loaded(30.0) == [(ticket, n)]
            waits[order].append(time.perf_counter() - t0)
        finally:
            client_module._LOAD = kinds[0]
        landed = 0
        while landed < n:
            landed += len(client.wait_written(30.0))
        assert client.lookup(hashes) == n  # (keeps them the most recently used in L2)
    return waits


if __name__ == "__main__":
    main()
