"""The whole system (gateway + router + prefill/decode over NATS) against the in-process engine.

    python -m bench.serving_bench                      # 1P1D, then aggregated, ~5 min on 2 cores
    python -m bench.serving_bench --setups 1P1D --quick

Same requests, same process for the client, one run:
  single-stream TPOT   ISL 128, OSL 64: time per output token after the first, one request at a time
  8 concurrent         ISL 256, OSL 64, all 8 submitted at once: output tokens/s over the whole run
  TTFT at ISL 1024     cold cache, and its parts from the first chunk's timings (tokenize, route,
                       prefill on the prefill worker, KV send, KV receive, first decode step)
The in-process baseline is services.engine.LLMEngine driven through its AsyncEngine in this
process, without speculative decoding; so is the system (``--speculative off``, the default here:
the rows then measure the serving path alone; ``--speculative auto`` starts `kvbus up` as its users
get it, n-gram drafts for greedy requests, against the same plain baseline).
The system is started with `kvbus up` (services.local_system) and called on
kvbus.v1.generate with prompt_token_ids, so tokenization is skipped in both; prompts are random
token ids with ignore_eos.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import time

from bench.common import machine, table
from schemas.engine import SamplingParams
from services.transfer import TRANSFER_CHOICES

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SETUPS = {
    "1P1D": ("--prefill", "1", "--decode", "1"),
    "aggregated": ("--aggregated",),
}


def random_prompt(n: int, seed: int, vocab: int = 49152) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def measure(stream_fn, args, seed: int = 0) -> dict:
    """The three measurements through ``stream_fn(prompt_ids, max_tokens) -> async iterator of
    (timestamp, num_new_tokens, timings|None)``."""
    out: dict = {}
    # single stream: TPOT after the first token
    tpots = []
    for i in range(args.repeats):
        stamps = []
        async for t, n, _ in stream_fn(random_prompt(128, seed + 100 + i), 64):
            stamps += [t] * n
        tpots.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    out["tpot"] = min(tpots)
    # 8 concurrent
    rates = []
    for r in range(args.repeats):
        prompts = [random_prompt(256, seed + 200 + 8 * r + i) for i in range(8)]

        async def one(p):
            total = 0
            async for _, n, _ in stream_fn(p, 64):
                total += n
            return total

        t0 = time.perf_counter()
        totals = await asyncio.gather(*(one(p) for p in prompts))
        rates.append(sum(totals) / (time.perf_counter() - t0))
    out["concurrent"] = max(rates)
    # TTFT at ISL 1024 (a fresh prompt each time: cold cache)
    ttfts, parts = [], []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        async for t, n, timings in stream_fn(random_prompt(1024, seed + 300 + i), 1):
            if n:
                ttfts.append(t - t0)
                parts.append(timings or {})
                break
    best = min(range(len(ttfts)), key=ttfts.__getitem__)
    out["ttft"], out["ttft_parts"] = ttfts[best], parts[best]
    return out


async def in_process(args) -> dict:
    from services.engine import AsyncEngine, EngineConfig, build_engine

    engine = AsyncEngine(build_engine(EngineConfig(model=args.model, kv_cache_memory=args.kv_cache_memory)))

    async def stream_fn(ids, max_tokens):
        async for o in engine.generate(ids, params(max_tokens)):
            yield time.perf_counter(), len(o.new_token_ids), None

    try:
        await measure(stream_fn, argparse.Namespace(repeats=1), seed=10_000)  # warm-up, other prompts
        return await measure(stream_fn, args)
    finally:
        await engine.aclose()


async def through_system(nats_url: str, args) -> dict:
    from bus.nats_transport import BusConfig, connect
    from bus.subjects import GENERATE
    from schemas.generate import GenerateRequest

    bus = await connect(BusConfig(nats_url=nats_url, request_timeout=300))

    async def stream_fn(ids, max_tokens):
        req = GenerateRequest(prompt_token_ids=ids, sampling=params(max_tokens), include_token_ids=True)
        async with bus.stream(GENERATE, req) as chunks:
            async for c in chunks:
                yield time.perf_counter(), len(c.token_ids), c.timings

    try:
        await measure(stream_fn, argparse.Namespace(repeats=1), seed=10_000)  # warm-up, other prompts
        return await measure(stream_fn, args)
    finally:
        await bus.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one repeat")
    parser.add_argument("--model", default=None)
    parser.add_argument("--kv-cache-memory", type=float, default=1.0)
    parser.add_argument("--worker-threads", type=int, default=0,
                        help="torch threads per engine worker process (0: all cores)")
    parser.add_argument("--kv-transfer", default="auto", choices=TRANSFER_CHOICES)
    parser.add_argument("--speculative", default="off", choices=["off", "auto"],
                        help="kvbus up's speculative decoding (off: as the in-process baseline)")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1
    from services.local_system import LocalSystem
    from services.models import resolve_model

    model_dir = resolve_model(args.model)
    args.model = str(model_dir)
    print(f"machine: {machine()}", flush=True)
    print("in-process engine ...", flush=True)
    base = asyncio.run(in_process(args))
    gc.collect()
    results = {}
    for setup in args.setups:
        print(f"{setup} through kvbus up ...", flush=True)
        extra = ("--num-threads", str(args.worker_threads), "--kv-transfer", args.kv_transfer,
                 "--speculative", args.speculative)
        with LocalSystem(*SETUPS[setup], *extra, "--kv-cache-memory", str(args.kv_cache_memory),
                         model_dir=model_dir) as system:
            results[setup] = asyncio.run(through_system(system.nats_url, args))
    rows = [["single-stream TPOT ms (ISL 128, OSL 64)", f"{base['tpot'] * 1e3:.1f}"]
            + [f"{r['tpot'] * 1e3:.1f} ({r['tpot'] / base['tpot']:.2f}x)" for r in results.values()],
            ["8 concurrent output tok/s (ISL 256, OSL 64)", f"{base['concurrent']:.1f}"]
            + [f"{r['concurrent']:.1f} ({r['concurrent'] / base['concurrent']:.2f}x)" for r in results.values()],
            ["TTFT s (ISL 1024, cold)", f"{base['ttft']:.3f}"]
            + [f"{r['ttft']:.3f} ({r['ttft'] / base['ttft']:.2f}x)" for r in results.values()]]
    print(table(rows, ["metric", "in-process engine"] + [f"kvbus {s} over NATS" for s in results]))
    for setup, r in results.items():
        parts = dict(r["ttft_parts"])
        if "prefill_call_s" in parts:  # derived: what the decode worker did after the pages arrived
            parts["decode: import pages + first output"] = (
                parts["first_token_s"] - parts["prefill_call_s"] - parts["transfer_receive_s"])
        parts["gateway + bus (client TTFT - route - tokenize - worker)"] = (
            r["ttft"] - parts.get("route_s", 0) - parts.get("tokenize_s", 0) - parts.get("first_token_s", 0))
        print(f"\nTTFT parts, {setup} (ISL 1024; seconds, from the first chunk's timers; "
              f"client-measured TTFT {r['ttft']:.3f} s):")
        print(table([[k, f"{v:.3f}"] for k, v in parts.items()], ["part", "s"]))
    print(f"\nworker threads: {args.worker_threads or 'all cores'}; kv transfer: {args.kv_transfer}; "
          f"speculative: {args.speculative}; repeats: {args.repeats} (best of)")


if __name__ == "__main__":
    main()
