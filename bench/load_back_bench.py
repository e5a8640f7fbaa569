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
    from services.kv_store.client import HostTierClient
    from services.kv_store.config import KVStoreConfig
    from services.kv_store.links import LocalLink
    from services.kv_store.store import StoreCore
    from services.models import resolve_model

    mc = ModelConfig.from_dir(resolve_model(None))
    sizes = [1, 2, 4, 8, 16, 32]
    n = max(sizes)
    pool = KVPool(mc, 2 * n, args.page_size, torch.float32, torch.device("cpu"))
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(0)))
    core = StoreCore(KVStoreConfig(hicache_size=pool.num_bytes * 20 / 1024**3, memory_reserve=0.0))
    client = HostTierClient(LocalLink(core), owner="bench", lease_batch=2 * n)
    client.bind(pool)
    hashes = [1000 + i for i in range(n)]
    tokens = [tuple(range(i * args.page_size, (i + 1) * args.page_size)) for i in range(n)]
    for i in range(n):  # leases are capped at 1/16 of the arena per engine: 20 x the pool covers n
        assert client.write_back(hashes[i], 0, tokens[i], i)
    landed = 0
    while landed < n:
        landed += len(client.wait_written(30.0))
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
    client.close()
    core.close()
    print(machine())
    print(table(rows, ["pages", "MiB", "sync ms", "async wait ms", "async stall ms", "wait/sync"]))


if __name__ == "__main__":
    main()
