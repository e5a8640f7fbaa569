"""CUDA: write-back copies on HiCache's copy stream vs on the engine's (default) stream, under compute.

    python -m bench.cuda_copy_bench                  # 128 pages of the default model's shape, 3 reps
    python -m bench.cuda_copy_bench --pages 64 --reps 1

Needs CUDA; no model weights (the page shape comes from the default model's config.json if it is
prepared, else SmolLM2-135M's shape is used). In one process: a CUDA KV pool, the kv_store core in
process (LocalLink) on the real shared-memory arena, a HostTierClient on the pool.

Each rep: the engine thread calls write_back for N pages (as tier_tick does before a step), then
enqueues a chain of matmuls on the default stream (the "step"), then waits until the chain and
every copy landed.
  copy stream:     the client's path (device -> pinned on its copy stream after an event, the copy
                   thread waits on the event, then memcpy into the arena slot)
  default stream:  the previous path (the copy thread's page.to("cpu") on the default stream: it
                   queues behind the matmuls)
Rows: compute alone, both modes' total time, the write_back calls' time on the engine thread,
and the ratio default / copy stream (> 1: the copy stream overlaps the copies with compute).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def page_config():
    from services.engine.model_config import ModelConfig
    from services.models import default_model_dir

    d = default_model_dir()
    if (d / "config.json").is_file():
        return ModelConfig.from_dir(d)
    return None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--matmuls", type=int, default=50)
    ap.add_argument("--dim", type=int, default=2048)
    args = ap.parse_args(argv)
    # One engine may lease at most 1/16 of the arena (KVStoreConfig.max_lease too): the arena is
    # about 17 x the pages written (128 pages of 0.7 MiB: 1.5 GB of /dev/shm).
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")

    from services.engine.kv_pool import KVPool
    from services.kv_store.client import HostTierClient
    from services.kv_store.config import KVStoreConfig
    from services.kv_store.links import LocalLink
    from services.kv_store.store import StoreCore

    dev = torch.device("cuda")
    mc = page_config()
    n = args.pages
    if mc is not None:
        pool = KVPool(mc, n, 16, torch.float32, dev)
    else:  # SmolLM2-135M: 30 layers, 3 KV heads of 64
        pool = type("Pool", (), {})()
        pool.data = torch.empty(n, 30, 2, 16, 3, 64, device=dev)
        pool.page_size, pool.dtype, pool.is_fp8 = 16, torch.float32, False
        pool.num_bytes = pool.data.numel() * 4
    pool.data.normal_()
    page_bytes = pool.data[0].numel() * pool.data.element_size()
    a = torch.randn(args.dim, args.dim, device=dev)

    def compute():
        x = a
        for _ in range(args.matmuls):
            x = torch.tanh(x @ a / args.dim)
        return x

    compute()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    compute()
    torch.cuda.synchronize()
    t_compute = time.perf_counter() - t0

    results = {}
    for mode in ("copy stream", "default stream"):
        times, calls = [], []
        for rep in range(args.reps):
            core = StoreCore(KVStoreConfig(hicache_size=page_bytes * n * 17 / 1024**3, memory_reserve=0.0))
            client = HostTierClient(LocalLink(core), owner=f"bench{rep}", lease_batch=2 * n)
            client.bind(pool)
            if mode == "default stream":
                client.stream = None  # the copy thread copies with page.to("cpu") on the default stream
            # warm the pinned allocator and the thread
            assert client.write_back(10**9, 0, tuple(range(16)), 0)
            client.wait_written(30.0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(1, n):  # as tier_tick does, before the step's forward is enqueued
                assert client.write_back(1000 + i, 0, tuple(range(16)), i), "no leased slot"
            t1 = time.perf_counter()
            compute()
            landed = 0
            while landed < n - 1:
                got = client.wait_written(60.0)
                assert got, "copies did not land"
                landed += len(got)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            calls.append(t1 - t0)
            client.close()
            core.close()
        results[mode] = (statistics.median(times), statistics.median(calls))
    mib = (n - 1) * page_bytes / 2**20
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {n - 1} pages x {page_bytes / 2**20:.2f} MiB "
          f"= {mib:.0f} MiB written back under {args.matmuls} matmuls of {args.dim}")
    print(f"compute alone: {t_compute * 1e3:.1f} ms")
    for mode, (t, c) in results.items():
        print(f"{mode:>15}: total {t * 1e3:.1f} ms, write_back calls on the engine thread {c * 1e3:.2f} ms")
    ratio = results["default stream"][0] / results["copy stream"][0]
    print(f"ratio total default / copy stream: {ratio:.2f} (> 1: the copy stream overlaps write-back with compute)")


if __name__ == "__main__":
    main()
