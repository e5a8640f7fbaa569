"""HiCache across hosts: TTFT of a prompt whose pages a kv_store on another host holds.

    python -m bench.remote_tier_bench             # ISL 2048, 5 reps (~2 min on 2 cores)
    python -m bench.remote_tier_bench --quick     # ISL 512, 2 reps (a check only)

A private nats-server on 127.0.0.1, a kv_store process (``kvbus serve kv_store``) that serves
host "store-host", and three engine workers in this process (default model, fp32):

  writer  host "host-w": computes each prompt once; write-through puts its pages into the store
          by value over NATS (offer, chunked transfer, put)
  remote  host "host-r": the same prompt again: its pages are fetched over NATS into the
          worker's staging arena, loaded into the KV pool, and only the tail is computed
  local   host "store-host": the same prompt from the store's arena, mapped (the same-host path:
          no page bytes on the bus), the baseline a remote hit is compared with
  cold    the remote worker on a fresh prompt of the same length (recompute, no tier)

Every TTFT is a WorkerGenerateRequest on the bus to the first token chunk (max_tokens 1).
Reports the p50s, remote/cold and remote/local, and fetch time per token against prefill
time per token (a fetch is the request to the store, the chunks, the checksum and the copy
into staging).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
import uuid

from bench.common import machine, median, nats_server, table

os.environ.setdefault("HF_HUB_OFFLINE", "1")


async def run(args) -> None:
    from bus.nats_transport import BusConfig, connect
    from bus.subjects import KV_STORE_LOOKUP, WORKER_GENERATE
    from schemas.kv_store import KVStoreLookupRequest
    from schemas.engine import SamplingParams
    from schemas.worker import WorkerGenerateRequest
    from services.engine.page_hash import page_hashes
    from services.workers import WorkerConfig
    from services.workers.actor import WorkerActor

    rng = random.Random(0)
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    base = WorkerConfig(model=args.model, kv_cache_memory=args.kv_gb, load_tokenizer=False, hicache=True,
                        hicache_write_policy="write_through", hicache_store_host="store-host",
                        hicache_reconnect_interval=0.5)
    actors, buses = [], []
    with nats_server() as url:
        async def start(actor):
            bus = await connect(BusConfig(nats_url=url, request_timeout=600))
            await actor.start(bus)
            actors.append(actor)
            buses.append(bus)
            return actor

        store = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "kv_store", "--nats-url", url,
                                  "--host-id", "store-host", "--hicache-size", str(args.store_gb),
                                  "--worker-id", "kv_store-0", "--log-level", "WARNING"])
        try:
            client = await connect(BusConfig(nats_url=url, request_timeout=600))
            buses.append(client)
            deadline = time.monotonic() + 120
            while True:  # the store answers (an unknown arena is refused, but it answers)
                try:
                    await client.request(KV_STORE_LOOKUP, KVStoreLookupRequest(page_hashes=[1]), timeout=1,
                                         host_id="store-host")
                    break
                except Exception:
                    if time.monotonic() > deadline or store.poll() is not None:
                        raise RuntimeError("the kv_store did not start") from None
                    await asyncio.sleep(0.2)
            workers = {name: await start(WorkerActor(base.replace(host_id=host), worker_id=name))
                       for name, host in (("writer", "host-w"), ("remote", "host-r"), ("local", "store-host"))}
            deadline = time.monotonic() + 120
            while not all(w.tier.is_attached and w.tier.link.healthy for w in workers.values()):
                if time.monotonic() > deadline:
                    raise RuntimeError("workers did not attach to the kv_store")
                await asyncio.sleep(0.05)

            async def ttft(worker: str, prompt: list[int]) -> float:
                req = WorkerGenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt, sampling=sampling)
                t0 = time.perf_counter()
                first = None
                async with client.stream(WORKER_GENERATE, req, worker_id=worker) as chunks:
                    async for _ in chunks:
                        first = first or time.perf_counter() - t0
                return first

            def prompt() -> list[int]:
                return [rng.randrange(100, 20000) for _ in range(args.isl)]

            for name in workers:  # warm-up: kernels, allocator
                await ttft(name, prompt())
            page = base.page_size
            rows = {k: [] for k in ("remote", "local", "cold")}
            remote = workers["remote"]
            fetched0 = remote.tier.link.stats["pages_received"]
            seconds0 = remote.tier.link.stats["fetch_seconds"]
            for rep in range(args.reps):
                p = prompt()
                await ttft("writer", p)
                hashes = page_hashes(p[: (len(p) - 1) // page * page], page, base.cache_salt)
                deadline = time.monotonic() + 120
                while True:  # every put landed
                    found = await client.request(KV_STORE_LOOKUP, KVStoreLookupRequest(page_hashes=hashes),
                                                 host_id="store-host")
                    if len(found.page_hashes) == len(hashes):
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError("the writer's pages did not reach the store")
                    await asyncio.sleep(0.01)
                rows["remote"].append(await ttft("remote", p))
                rows["local"].append(await ttft("local", p))
                rows["cold"].append(await ttft("remote", prompt()))
                print(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in rows.items()),
                      flush=True)
            fetched = remote.tier.link.stats["pages_received"] - fetched0
            fetch_s = remote.tier.link.stats["fetch_seconds"] - seconds0
            if fetched != args.reps * len(hashes) or remote.tier.stats["verify_failed"]:
                raise RuntimeError(f"the remote worker fetched {fetched} pages, expected {args.reps * len(hashes)}")
        finally:
            for actor in actors:  # before the buses close: a last write-back still finds its bus
                await actor.stop()
            for bus in buses:
                await bus.close()
            store.terminate()
            store.wait(30)

    p50 = {k: median(v) for k, v in rows.items()}
    print(f"\n{machine()}; ISL {args.isl}, {args.reps} reps, pages of {page} tokens "
          f"({remote.tier.page_bytes / 2**20:.2f} MiB)\n")
    print(table([[k, f"{v * 1e3:.1f}"] for k, v in p50.items()], ["TTFT p50", "ms"]))
    fetch_per_token = fetch_s / (fetched * page)
    prefill_per_token = p50["cold"] / args.isl
    print(f"\nremote hit / cold: {p50['remote'] / p50['cold']:.2f}x; remote hit / same-host hit: "
          f"{p50['remote'] / p50['local']:.2f}x")
    print(f"fetch {fetch_per_token * 1e6:.1f} us/token ({fetched * remote.tier.page_bytes / fetch_s / 2**20:.0f} MiB/s) "
          f"vs prefill {prefill_per_token * 1e6:.1f} us/token: {prefill_per_token / fetch_per_token:.0f}x cheaper")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--isl", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kv-gb", type=float, default=0.3, help="each worker's KV pool")
    ap.add_argument("--store-gb", type=float, default=1.0, help="the kv_store's L2")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.isl, args.reps = 512, 2
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
