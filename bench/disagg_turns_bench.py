"""1P1D multi-turn: KV bytes that cross the transfer layer per turn, every page vs only the missing ones.

    python -m bench.disagg_turns_bench              # 4 users x 6 rounds, 256-token turns (~3-5 min on 2 cores)
    python -m bench.disagg_turns_bench --quick      # 2 users x 3 rounds, short turns (< 1 min): a check only
    python -m bench.disagg_turns_bench --hicache    # decode L1 of about two users' KV, plus a host tier (L2)

A prefill worker and a decode worker (real engines, the real transfer layer: shared memory on one
host) run in this process on the in-memory bus; a client sends every request to the decode worker
naming the prefill worker, as the router does for long prompts. An agent: every user starts with
--first-tokens of context (system prompt, tools, task) and resends its whole history each round
(previous prompt + answer + --turn-tokens new tokens: tool output), users taking turns. The share of
pages that must cross is about (turn + answer) / history, so the ratio below depends on that shape. The same
workload runs twice, with fresh engines: `transfer_missing_only=False` (every prompt page crosses on
every turn, the path before) and `True` (the decode worker says how many leading pages it holds, in
L1 or, with --hicache, in L2, and only the rest cross).

Rows: KV bytes and pages received per turn on rounds >= 2 (goal: only-missing / every-page <= 0.2),
TTFT p50 of rounds >= 2 and its ratio, and whether the outputs of both runs are identical.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
import uuid

from bench.common import machine, percentile, table
from schemas.engine import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")


async def run(config, users: int, rounds: int, first: int, turn: int, max_tokens: int,
              hicache_gb: float | None) -> dict:
    from bus.memory import MemoryNetwork, memory_bus
    from bus.subjects import WORKER_GENERATE
    from schemas.worker import WorkerGenerateRequest
    from services.workers.decode import DecodeActor
    from services.workers.prefill import PrefillActor

    network = MemoryNetwork()
    actors, buses = [], []
    if hicache_gb is not None:
        from services.kv_store.actor import KVStoreActor
        from services.kv_store.config import KVStoreConfig

        store = KVStoreActor(KVStoreConfig(host_id=config.host_id, hicache_size=hicache_gb, memory_reserve=0.5),
                             worker_id="kv_store-bench")
        bus = memory_bus(network)
        await store.start(bus)
        actors.append(store)
        buses.append(bus)
    for cls, wid in ((PrefillActor, "prefill-bench"), (DecodeActor, "decode-bench")):
        bus = memory_bus(network)
        actor = cls(config, worker_id=wid)
        await actor.start(bus)
        actors.append(actor)
        buses.append(bus)
    prefill, decode = actors[-2:]
    if hicache_gb is not None:
        while not (prefill.tier.is_attached and decode.tier.is_attached):
            await asyncio.sleep(0.05)
    client = memory_bus(network)
    rng = random.Random(0)
    vocab = decode.engine.model_config.vocab_size
    history = [[] for _ in range(users)]
    rows, outputs = [], []
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    try:
        for r in range(rounds):
            for u in range(users):
                history[u] += [rng.randrange(100, vocab - 100) for _ in range(first if r == 0 else turn)]
                nbytes, pages, skipped = decode.transfer_bytes, decode.transfer_pages, decode.transfer_pages_skipped
                req = WorkerGenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=list(history[u]),
                                            sampling=params, prefill_worker_id="prefill-bench")
                t0, ttft, out = time.perf_counter(), None, []
                async with client.stream(WORKER_GENERATE, req, worker_id="decode-bench") as chunks:
                    async for chunk in chunks:
                        if ttft is None and chunk.token_ids:
                            ttft = time.perf_counter() - t0
                        out += chunk.token_ids
                rows.append(dict(round=r, ttft=ttft, prompt=len(history[u]), bytes=decode.transfer_bytes - nbytes,
                                 pages=decode.transfer_pages - pages,
                                 skipped=decode.transfer_pages_skipped - skipped))
                outputs.append(out)
                history[u] += out
        stats = dict(remote=decode.num_remote_prefills, local=decode.num_local_prefills,
                     gaps=decode.engine.scheduler.num_import_gaps,
                     loaded_back=decode.tier.stats["loaded_back"] if decode.tier is not None else 0)
    finally:
        await client.close()
        for actor, bus in zip(reversed(actors), reversed(buses)):
            await bus.close()
            await actor.stop()
    return dict(rows=rows, outputs=outputs, stats=stats)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--first-tokens", type=int, default=1024)
    ap.add_argument("--turn-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--hicache", action="store_true", help="decode L1 of about two users' KV plus an L2")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.users, args.rounds, args.first_tokens, args.turn_tokens, args.max_tokens = 2, 3, 96, 48, 4
    from services.engine.kv_pool import kv_bytes_per_page
    from services.engine.model_config import ModelConfig
    from services.models import resolve_model
    from services.workers import WorkerConfig

    model = str(resolve_model(args.model))
    page_bytes = kv_bytes_per_page(ModelConfig.from_dir(model), 16, __import__("torch").float32)
    final_len = args.first_tokens + args.rounds * (args.turn_tokens + args.max_tokens)
    kv_gb, hicache_gb = 0.5, None
    if args.hicache:
        kv_gb = 2 * (final_len // 16 + 2) * page_bytes / 1024**3
        hicache_gb = max(kv_gb * args.users, 0.01)
    config = WorkerConfig(model=model, kv_cache_memory=kv_gb, load_tokenizer=False, host_id="bench-host",
                          hicache=args.hicache, hicache_timeout=5.0, max_running_requests=4)
    print(machine())
    print(f"1P1D in one process: {args.users} users x {args.rounds} rounds, {args.first_tokens} tokens first, "
          f"then {args.turn_tokens} new tokens a turn, "
          f"{args.max_tokens} generated; decode L1 {kv_gb * 1024:.0f} MB"
          + (f", L2 {hicache_gb * 1024:.0f} MB" if hicache_gb else ""))
    results = {}
    for name, missing_only in (("every page", False), ("only missing", True)):
        results[name] = asyncio.run(run(config.replace(transfer_missing_only=missing_only), args.users,
                                        args.rounds, args.first_tokens, args.turn_tokens, args.max_tokens,
                                        hicache_gb))
    lines = []
    for name, res in results.items():
        later = [r for r in res["rows"] if r["round"] >= 1]
        n = max(1, len(later))
        res["bytes"] = sum(r["bytes"] for r in later) / n
        res["ttft"] = percentile([r["ttft"] for r in later], 50)
        lines.append([name, f"{res['bytes'] / 1e6:.2f}", f"{sum(r['pages'] for r in later) / n:.1f}",
                      f"{sum(r['skipped'] for r in later) / n:.1f}", f"{res['ttft'] * 1e3:.0f}",
                      str(res["stats"])])
    print(table(lines, ["transfer", "KV MB per turn (rounds>=2)", "pages sent", "pages held", "TTFT p50 (ms)",
                        "decode counters"]))
    before, after = results["every page"], results["only missing"]
    later = [r for r in before["rows"] if r["round"] >= 1]
    new = sum(args.turn_tokens + args.max_tokens for _ in later) / max(1, sum(r["prompt"] for r in later))
    print(f"KV bytes per turn, only missing / every page: {after['bytes'] / before['bytes']:.3f} (goal <= 0.2; "
          f"new tokens / prompt tokens on these turns: {new:.3f})")
    print(f"TTFT p50 rounds >= 2, only missing / every page: {after['ttft'] / before['ttft']:.2f}")
    same = before["outputs"] == after["outputs"]
    print(f"outputs identical in both runs: {same}")
    if not same:
        raise SystemExit("outputs differ between the two transfer modes")


if __name__ == "__main__":
    main()
