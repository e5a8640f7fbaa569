"""The KV-aware router: its decision time, and what it buys a multi-session workload.

    python -m bench.router_bench decision                 # decision time, 100,000 pages on 16 workers (~30 s)
    python -m bench.router_bench workload                 # kv against round_robin, random, least_loaded on
                                                          # 2 and 4 aggregated workers and 1P2D (~30-60 min)
    python -m bench.router_bench workload --quick         # a smoke run: 2 workers, kv and round_robin (3-6 min)
    python -m bench.router_bench workload --hicache       # the same with host-memory tiers (kvbus up --hicache)

``decision``: a router in this process (no bus) follows 16 workers on 4 hosts; synthetic KV events
(the ones the engines publish) fill its index with ``--pages`` device pages, chains of conversations
each worker holds. Then ``--decisions`` requests, half resending a held conversation with a new tail
and half cold, are routed as the actor routes them (prompt hashing included); fresh heartbeats every
100 decisions, as workers send them. By default the router never routed the held conversations (as
after a restart: each one's first resend hashes its whole prompt); ``--warm``: it did. Rows: decision time p50, p99 and max (wall clock), and the
same in CPU time of the routing thread (what a decision costs; on a busy machine the wall clock also
counts the time other processes held the core). Goal: p99 <= 1 ms.

``workload``: ``kvbus up`` per layout and policy (a fresh system each, small KV pools), and
``--sessions`` conversations at once, each resending its growing history every turn (a shared system
prompt per group of sessions, a first message, then a tool output and an answer per turn), streamed
over NATS with a ``session_id`` as an agent would. The baselines run with session affinity off
(``KVBUS_SESSION_TTL=0``): they are the plain policies; ``kv`` runs with the router's defaults.
Rows per layout and policy: cached share of the prompt tokens (turns >= 2 and all), TTFT p50/p90 of
turns >= 2, wall time. Goals: kv's hit rate >= 2x round_robin's, TTFT p50 <= 0.5x, the lowest wall.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time

from bench.common import machine, percentile, table

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PAGE = 16


# --- decision time ---------------------------------------------------------------------------
def decision_bench(num_pages: int, num_workers: int, num_decisions: int, prompt_tokens: int, seed: int,
                   warm: bool = False) -> dict:
    from schemas.kv_store import KVDumpReply, KVEvent, KVEventBatchEvent
    from schemas.worker import RouteRequest, WorkerHeartbeatEvent, WorkerLoad
    from services.engine.page_hash import SCHEME, page_hashes
    from services.router.config import RouterConfig
    from services.router.core import Router

    rng = random.Random(seed)
    router = Router(RouterConfig(worker_ttl=1e9, seed=seed))

    def heartbeat(i: int) -> WorkerHeartbeatEvent:
        return WorkerHeartbeatEvent(worker_id=f"w{i}", role="worker", host_id=f"h{i % 4}", page_size=PAGE,
                                    load=WorkerLoad(num_running=rng.randrange(8), num_free_pages=4000,
                                                    num_total_pages=8000), hash_scheme=SCHEME)

    for i in range(num_workers):
        router.observe(heartbeat(i))
    for publisher in router.policy.take_kv_dump_requests():
        router.observe_dump(KVDumpReply(worker_id=publisher, host_id=f"h{int(publisher[1:]) % 4}", event_id=0,
                                        events=[]))
    # conversations of prompt_tokens + 64 tokens; each worker holds whole ones until the index is full
    chain_pages = (prompt_tokens + 64) // PAGE
    conversations: list[tuple[list[int], int]] = []  # (token ids, worker)
    event_ids = [0] * num_workers
    held = 0
    while held < num_pages:
        worker = len(conversations) % num_workers
        ids = [rng.randrange(32000) for _ in range(chain_pages * PAGE)]
        hashes = page_hashes(ids, PAGE)
        for start in range(0, len(hashes), 64):  # batches as an engine publishes them
            event_ids[worker] += 1
            chunk = hashes[start:start + 64]
            router.observe_kv(KVEventBatchEvent(worker_id=f"w{worker}", host_id=f"h{worker % 4}",
                                                event_id=event_ids[worker], events=[KVEvent(
                                                    kind="stored", tier="device", page_hashes=chunk,
                                                    parent_hashes=[0] * len(chunk))]))
        conversations.append((ids, worker))
        held += len(hashes)
    stats = router.policy.detail()
    if warm:  # as if this router had routed every conversation before (its page hashes remembered)
        from services.router.prompt import PromptPages, unsalted_root

        for ids, _ in conversations:
            PromptPages(ids, PAGE, unsalted_root()).hashes  # noqa: B018
    times, cpu_times, hits = [], [], 0
    for n in range(num_decisions):
        if n % 100 == 0:
            for i in range(num_workers):
                router.observe(heartbeat(i))
        if n % 2 == 0:
            ids, worker = rng.choice(conversations)
            prompt = ids[:prompt_tokens - 64] + [rng.randrange(32000) for _ in range(64)]
        else:
            prompt, worker = [rng.randrange(32000) for _ in range(prompt_tokens)], None
        t0, c0 = time.perf_counter(), time.thread_time()
        reply = router.route(RouteRequest(request_id=f"r{n}", prompt_token_ids=prompt))
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.thread_time() - c0)
        hits += worker is not None and reply.decode_worker_id == f"w{worker}"
    return {"pages": stats["pages_device"], "workers": num_workers, "decisions": num_decisions,
            "prompt_tokens": prompt_tokens, "p50_ms": percentile(times, 50) * 1e3,
            "p99_ms": percentile(times, 99) * 1e3, "max_ms": max(times) * 1e3,
            "cpu_p50_ms": percentile(cpu_times, 50) * 1e3, "cpu_p99_ms": percentile(cpu_times, 99) * 1e3,
            "resent_to_holder": hits / (num_decisions // 2)}


# --- the multi-session workload -------------------------------------------------------------------
LAYOUTS = {"aggregated-2": ("--aggregated", "--workers", "2"), "aggregated-4": ("--aggregated", "--workers", "4"),
           "1P2D": ("--prefill", "1", "--decode", "2")}
POLICIES = ("kv", "round_robin", "random", "least_loaded")
POOL_COUNTERS = ("preemptions", "pages_evicted", "held_pages_evicted")  # a worker's health detail
HICACHE_COUNTERS = ("hicache_written_back", "hicache_written_sync", "hicache_dropped", "hicache_loaded_back",
                    "hicache_hits", "hicache_misses")  # --hicache


async def conversations(nats_url: str, args) -> dict:
    from bus.nats_transport import BusConfig, connect
    from bus.subjects import GENERATE, HEALTH, WORKER_HEALTH
    from schemas.common import HealthRequest
    from schemas.engine import SamplingParams
    from schemas.generate import GenerateRequest

    rng = random.Random(args.seed)
    words = lambda n: [rng.randrange(300, 5000) for _ in range(n)]  # noqa: E731 (plain vocabulary ids)
    systems = [words(args.system_tokens) for _ in range(max(1, args.sessions // args.sessions_per_system))]
    histories = [systems[s % len(systems)] + words(args.first_tokens) for s in range(args.sessions)]
    tails = [[words(args.turn_tokens) for _ in range(args.turns)] for _ in range(args.sessions)]
    sampling = SamplingParams(max_tokens=args.answer_tokens, temperature=0.0, ignore_eos=True)
    bus = await connect(BusConfig(nats_url=nats_url, request_timeout=600))
    turns: list[dict] = []

    async def session(s: int) -> None:
        history = histories[s]
        for t in range(args.turns):
            if t:
                history = history + tails[s][t]
            started, first, answer, usage, remote, split = time.monotonic(), None, [], None, False, {}
            req = GenerateRequest(prompt_token_ids=history, sampling=sampling, session_id=f"session-{s}")
            async with bus.stream(GENERATE, req, timeout=600) as chunks:
                async for chunk in chunks:
                    if first is None and chunk.token_ids:
                        first = time.monotonic() - started
                        split = chunk.timings or {}  # route_s, and the worker's own first_token_s
                    answer += chunk.token_ids
                    usage = chunk.usage or usage
                    remote = remote or "prefill_call_s" in (chunk.timings or {})  # a prefill worker's
            turns.append({"turn": t, "ttft": first, "prompt": usage.prompt_tokens,
                          "cached": usage.cached_prompt_tokens, "remote": remote,
                          "route": split.get("route_s"), "worker_first": split.get("first_token_s")})
            history = history + answer

    try:
        t0 = time.monotonic()
        await asyncio.gather(*(session(s) for s in range(args.sessions)))
        wall = time.monotonic() - t0
        router = (await bus.request(HEALTH, HealthRequest(), timeout=10, role="router")).detail
        pools = {}  # each worker's pool under the workload: preemptions (recomputes), evictions, holds
        for wid in sorted(k.removeprefix("load_") for k in router if k.startswith("load_")):
            detail = (await bus.request(WORKER_HEALTH, HealthRequest(), timeout=10, role=wid.rpartition("-")[0],
                                        worker_id=wid)).detail
            pools[wid] = {k: int(detail[k]) for k in POOL_COUNTERS + ("remote_prefills", "local_prefills")
                          if k in detail}
            pools[wid].update({k: int(float(detail[k])) for k in HICACHE_COUNTERS if k in detail})
    finally:
        await bus.close()
    later = [t for t in turns if t["turn"] >= 1]
    share = lambda ts: sum(t["cached"] for t in ts) / max(1, sum(t["prompt"] for t in ts))  # noqa: E731
    ttfts = [t["ttft"] for t in later]

    def p50_of(key: str) -> float | None:  # None: no worker reported that timing
        values = [t[key] for t in later if t[key] is not None]
        return percentile(values, 50) if values else None

    return {"hit_later": share(later), "hit_all": share(turns), "ttft_p50": percentile(ttfts, 50),
            "ttft_p90": percentile(ttfts, 90), "wall": wall, "turns": len(turns),
            # where a later turn's TTFT went: the route call, and the worker from its request to its first token
            "route_p50": p50_of("route"), "worker_first_p50": p50_of("worker_first"),
            "remote_later": sum(t["remote"] for t in later) / max(1, len(later)),
            # the router's view: what it predicted cached against what the prefilling workers found
            "pools": pools, "router": {k: v for k, v in router.items() if k.startswith(("cached_tokens", "session", "kv_pages",
                                                                        "reports"))}}


def workload_bench(args) -> list[dict]:
    from services.local_system import LocalSystem

    results = []
    for layout in args.layouts:
        for policy in args.policies:
            env = {"KVBUS_POLICY": policy, "KVBUS_SEED": str(args.seed)}
            if policy != "kv" and not args.baseline_affinity:
                env["KVBUS_SESSION_TTL"] = "0"
            tiers = ("--hicache",) if args.hicache else ()
            with LocalSystem(*LAYOUTS[layout], *tiers, "--speculative", "off", "--dtype", args.dtype,
                             "--kv-cache-memory", str(args.kv_cache_memory), env=env) as system:
                row = asyncio.run(conversations(system.nats_url, args))
            row.update(layout=layout, policy=policy, hicache=args.hicache)
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def workload_table(results: list[dict]) -> str:
    rows = []
    for r in results:
        base = next((b for b in results if b["layout"] == r["layout"] and b["policy"] == "round_robin"), None)
        ratio = lambda k: f" ({r[k] / base[k]:.2f}x)" if base and base[k] else ""  # noqa: E731
        rows.append([r["layout"], r["policy"], f"{r['hit_later']:.1%}{ratio('hit_later')}", f"{r['hit_all']:.1%}",
                     f"{r['ttft_p50'] * 1e3:.0f}{ratio('ttft_p50')}", f"{r['ttft_p90'] * 1e3:.0f}",
                     f"{r['wall']:.1f}{ratio('wall')}", f"{r.get('remote_later', 0):.0%}"])
    return table(rows, ["layout", "policy", "cached share, turns >= 2 (x rr)", "cached share, all",
                        "TTFT p50 ms, turns >= 2 (x rr)", "TTFT p90 ms", "wall s (x rr)",
                        "prefilled remotely, turns >= 2"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    d = sub.add_parser("decision", help="decision time over a full index (no bus, no engines)")
    d.add_argument("--pages", type=int, default=100_000)
    d.add_argument("--workers", type=int, default=16)
    d.add_argument("--decisions", type=int, default=5000)
    d.add_argument("--prompt-tokens", type=int, default=2048)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--warm", action="store_true",
                   help="the router routed every held conversation before (their page hashes remembered); "
                        "default: it never saw them (a router rebuilt from dumps: every first resend hashes "
                        "its whole prompt)")
    w = sub.add_parser("workload", help="kv against the other policies on kvbus up")
    w.add_argument("--quick", action="store_true", help="aggregated-2, kv and round_robin, 4 short sessions")
    w.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    w.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    w.add_argument("--sessions", type=int, default=16)
    w.add_argument("--sessions-per-system", type=int, default=4, help="sessions sharing one system prompt")
    w.add_argument("--turns", type=int, default=6)
    w.add_argument("--system-tokens", type=int, default=512)
    w.add_argument("--first-tokens", type=int, default=256)
    w.add_argument("--turn-tokens", type=int, default=128, help="new tokens per turn (a tool's output)")
    w.add_argument("--answer-tokens", type=int, default=32)
    w.add_argument("--kv-cache-memory", type=float, default=0.35,
                   help="GB of KV pool per worker: too small to hold every session on one worker")
    w.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "auto"),
                   help="the engines' dtype (default float32: a bfloat16 pool holds twice the tokens, so kvbus "
                        "up's 'auto', bfloat16 on a CPU with avx512_bf16 or AMX, would take the pool pressure away)")
    w.add_argument("--hicache", action="store_true",
                   help="kvbus up --hicache: each host's kv_store keeps evicted pages in host memory (docs/hicache.md)")
    w.add_argument("--baseline-affinity", action="store_true", help="keep session affinity on for the baselines")
    w.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"# {machine()}")
    if args.what == "decision":
        r = decision_bench(args.pages, args.workers, args.decisions, args.prompt_tokens, args.seed, args.warm)
        print(json.dumps(r))
        print(table([[f"{r['pages']:,}", r["workers"], r["prompt_tokens"], f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}",
                      f"{r['max_ms']:.3f}", f"{r['cpu_p50_ms']:.3f}", f"{r['cpu_p99_ms']:.3f}",
                      f"{r['resent_to_holder']:.0%}"]],
                    ["indexed pages", "workers", "prompt tokens", "p50 ms", "p99 ms", "max ms", "CPU p50 ms",
                     "CPU p99 ms", "resent prompts sent to their holder"]))
        return
    if args.quick:
        args.layouts, args.policies = ["aggregated-2"], ["kv", "round_robin"]
        args.sessions, args.sessions_per_system, args.turns = 4, 2, 3
        args.system_tokens, args.first_tokens, args.turn_tokens, args.answer_tokens = 128, 64, 32, 8
    print(workload_table(workload_bench(args)))


if __name__ == "__main__":
    main()
